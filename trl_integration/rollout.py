"""Rollout log-probabilities and rollout precision on the transformers ``generate`` path (no vLLM).

trl's plain ``generate`` path returns no log-probabilities, so neither the importance-sampling correction nor any
training–inference mismatch diagnostic can run without vLLM. `RolloutLogprobRecorder` is a
``LogitsProcessor`` that records, during KV-cached decoding and in the rollout's own precision, the
log-probability of every sampled token under the distribution the sampler actually drew from:

- HF ``generate`` runs custom logits processors *before* its sampling warpers (temperature, top-k, top-p, min-p),
  so the recorder sees the model's scores after any penalties but before truncation;
- it keeps each step's scores until the next step reveals the sampled token, and applies
  `safevocab.safe_log_softmax` with the sampler's own rule and temperature, i.e. ``log pi_S(y)``
  renormalised over the sampler's kept set — the same quantity vLLM returns with
  ``logprobs_mode="processed_logprobs"``.

Steps are scored in batches of up to ``max_buffer_bytes`` of fp32 scores (default
:data:`safevocab.logprobs.DEFAULT_MAX_CHUNK_BYTES`, 64 MiB, the fused log-softmax's chunk budget; a large-vocabulary
model scores every step as it comes, a small one its whole rollout in one call), never the
``[batch, steps, vocab]`` of ``output_scores=True``.

Controlled mismatch (the mismatch lab, docs/mismatch.md):

- `rollout_precision` runs generation in a chosen dtype without touching the fp32 master weights
  (autocast down, lossless temporary upcast up), to study or reproduce precision-induced mismatch;
- `LogitNoiseProcessor` adds a perturbation ``delta`` with a hard bound ``|delta_i| <= eps`` to the sampler's
  transformed logits: seeded zero-mean noise (``uniform``, ``clipped_gaussian``), or the deterministic, biased
  ``lift`` of the tail, ``delta_i = eps * min(1, (z_max - z_i) / 10)`` (`lift_perturbation`: the top token
  keeps its logit, tokens 10 nats or more below it gain ``eps``, so the rollout's tail is heavier). Placed before
  the recorder, the tokens are *sampled* from the perturbed distribution and the recorded rollout
  log-probabilities are those of the perturbed distribution, so the mismatch against the training engine obeys
  ``|log pi - log mu| <= log(p + (1 - p) e^{2 eps})`` (plus the engines' own float-level differences).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from safevocab import SafeVocabRule, safe_log_softmax
from safevocab.logprobs import DEFAULT_MAX_CHUNK_BYTES
from trl_integration.effective_rule import sampler_rule
from trl_integration.enums import NOISE_KINDS, ROLLOUT_DTYPES

__all__ = [
    "ROLLOUT_DTYPES",
    "NOISE_KINDS",
    "UNSUPPORTED_SAMPLING_KWARGS",
    "RolloutLogprobRecorder",
    "LogitNoiseProcessor",
    "LIFT_SCALE",
    "logit_noise",
    "lift_perturbation",
    "logit_delta",
    "sampler_rule",
    "sampler_rule_from_generation_config",
    "rollout_recorder",
    "rollout_precision",
    "recording_generate",
]

# ROLLOUT_DTYPES and NOISE_KINDS live in the config's leaf (trl_integration.enums); they stay importable from here.

#: Sampling settings that change the distribution after the recorder sees the scores and that it cannot
#: reproduce, with the value that disables each.
UNSUPPORTED_SAMPLING_KWARGS: dict[str, object] = {
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "num_beams": 1,
    "do_sample": True,
    "guidance_scale": None,
    "watermarking_config": None,
}


def sampler_rule_from_generation_config(generation_config) -> tuple[SafeVocabRule, float]:
    """``(rule, temperature)`` that a transformers ``GenerationConfig`` samples with.

    Raises:
        ValueError: when the config uses a sampling setting the recorder cannot reproduce (typical-p, epsilon/eta
            cutoffs, beams, greedy decoding, ...).
    """
    for key, neutral in UNSUPPORTED_SAMPLING_KWARGS.items():
        value = getattr(generation_config, key, neutral)
        if key == "guidance_scale" and value in (None, 1.0):
            continue
        if value is not None and value != neutral and not (key == "do_sample" and value):
            raise ValueError(
                f"generation {key}={value!r} changes the sampling distribution in a way the rollout log-prob "
                f"recorder cannot reproduce: set it to {neutral!r}, or set rollout_logprobs=False"
            )
    temperature = generation_config.temperature
    temperature = 1.0 if temperature is None else float(temperature)
    rule = sampler_rule(generation_config.top_k, generation_config.top_p, generation_config.min_p)
    return rule, temperature


def rollout_recorder(generation_config, importance_sampling: bool) -> tuple[RolloutLogprobRecorder | None, str | None]:
    """``(recorder, None)`` that records the rollout log-probabilities of ``generation_config``'s sampling, or
    ``(None, reason)`` when they cannot be recorded faithfully (a setting :func:`sampler_rule_from_generation_config`
    refuses; with ``importance_sampling``, a ``repetition_penalty``, which reshapes the distribution by the context
    in a way the trainer's log-probabilities do not reproduce)."""
    try:
        rule, temperature = sampler_rule_from_generation_config(generation_config)
    except ValueError as error:  # a sampling setting the recorder cannot reproduce (beams, typical_p, ...)
        return None, str(error)
    penalty = getattr(generation_config, "repetition_penalty", None)
    if importance_sampling and penalty not in (None, 1.0):
        return None, (
            f"generation repetition_penalty={penalty!r} reshapes the sampling distribution by the context, "
            "which the trainer's log-probabilities do not reproduce: no generate-path importance sampling"
        )
    return RolloutLogprobRecorder(rule, temperature), None


class RolloutLogprobRecorder(LogitsProcessor):
    """Record ``log pi_S(y_t)`` of each sampled token during ``generate`` (append it last to ``logits_processor``).

    Args:
        rule: the sampler's rule (``sampler_rule_from_generation_config``), applied on the recorded scores.
        temperature: the sampler's temperature.
        max_buffer_bytes: fp32 scores held before they are scored in one batched call (at least one step is
            always held: its token is only known at the next step).

    After ``generate`` returns, call `finalize` with the returned sequences; `logprobs` is then the
    fp32 ``[batch, generated_steps]`` tensor (positions after a sequence finished hold the pad token's value and
    are masked by the caller). `recording_generate` does that, and when the recording is unusable (``generate``
    ran no logits-processor loop, or fewer steps than it returned) sets `failure` to the reason instead of
    raising, so that the rollout goes on without log-probabilities.
    """

    def __init__(self, rule: SafeVocabRule, temperature: float = 1.0, max_buffer_bytes: int = DEFAULT_MAX_CHUNK_BYTES):
        self.rule = rule
        self.temperature = float(temperature)
        self.max_buffer_bytes = int(max_buffer_bytes)
        self.prompt_length: int | None = None
        self.num_calls = 0
        self.logprobs: torch.Tensor | None = None
        #: Why the recording is unusable (set by `recording_generate`), else ``None``.
        self.failure: str | None = None
        self._pending: torch.Tensor | None = None  # the latest step's scores; its token comes with the next call
        self._closed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scores, tokens) not scored yet
        self._closed_bytes = 0
        self._steps: list[torch.Tensor] = []  # [steps, batch] log-probabilities of the scored steps, per call

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        elif self._pending is not None:
            self._close_step(input_ids[:, -1])
        # The warpers that follow return new tensors, but a user processor might not: keep a private copy.
        self._pending = scores.detach().float().clone()
        self.num_calls += 1
        return scores

    def _close_step(self, tokens: torch.Tensor) -> None:
        self._closed.append((self._pending, tokens.to(self._pending.device)))
        self._closed_bytes += self._pending.numel() * 4
        self._pending = None
        if self._closed_bytes >= self.max_buffer_bytes:
            self._score_closed()

    def _score_closed(self) -> None:
        """Score the buffered steps in one `safe_log_softmax` call (the per-call overhead dominates small ones)."""
        if not self._closed:
            return
        batch = self._closed[0][0].shape[0]
        scores = torch.cat([s for s, _ in self._closed])
        tokens = torch.cat([t for _, t in self._closed])
        out = safe_log_softmax(scores, tokens, self.rule, temperature=self.temperature)
        self._steps.append(out.logprobs.view(-1, batch))  # [steps, batch], steps in order
        self._closed, self._closed_bytes = [], 0

    def finalize(self, sequences: torch.Tensor) -> torch.Tensor:
        """Close the last step with the final sampled tokens; returns ``[batch, steps]`` fp32 log-probabilities."""
        if self.prompt_length is None:
            raise RuntimeError(
                "the rollout log-prob recorder was never called: generate ran no logits-processor loop (a replaced "
                "or patched generate, or a decoding mode without logits processors)"
            )
        if self._pending is not None:
            self._close_step(sequences[:, -1])
        self._score_closed()
        steps = sequences.shape[1] - self.prompt_length
        scored = sum(chunk.shape[0] for chunk in self._steps)
        if steps != scored:
            raise RuntimeError(
                f"rollout log-prob recorder saw {scored} decoding steps but generate returned {steps} "
                "new tokens per sequence"
            )
        batch = sequences.shape[0]
        if not self._steps:
            self.logprobs = torch.zeros(batch, 0, device=sequences.device)
        else:
            self.logprobs = (self._steps[0] if len(self._steps) == 1 else torch.cat(self._steps)).T.contiguous()
        self._steps = []
        return self.logprobs

    def per_sequence(self, completion_ids: list[list[int]]) -> list[list[float]]:
        """The recorded log-probabilities cut to each completion's length (trl's list-of-lists format)."""
        if self.logprobs is None:
            raise RuntimeError("call finalize() after generate before reading the recorded log-probabilities")
        if len(completion_ids) != self.logprobs.shape[0]:
            raise RuntimeError(f"{len(completion_ids)} completions but {self.logprobs.shape[0]} recorded rows")
        rows = self.logprobs.cpu().tolist()  # one conversion, then plain list slicing
        return [row[: len(ids)] for row, ids in zip(rows, completion_ids)]

    def padded(self, lengths: list[int], width: int, device: torch.device | str | None = None) -> torch.Tensor:
        """trl's ``sampling_per_token_logps`` tensor built from :meth:`per_sequence`'s lists, made directly: the
        recorded ``[batch, width]`` log-probabilities, ``0.0`` after each completion's ``lengths[i]`` tokens (trl's
        right padding, to ``width`` columns), fp32. The same values without trl's one tensor per completion.

        Args:
            lengths: each completion's number of tokens (at most the recorded steps).
            width: the padded completion length of trl's ``completion_ids``.
            device: where the tensor goes (default: the recorder's).
        """
        if self.logprobs is None:
            raise RuntimeError("call finalize() after generate before reading the recorded log-probabilities")
        if len(lengths) != self.logprobs.shape[0]:
            raise RuntimeError(f"{len(lengths)} completions but {self.logprobs.shape[0]} recorded rows")
        recorded = self.logprobs.float()
        steps = recorded.shape[1]
        if width > steps:
            recorded = torch.nn.functional.pad(recorded, (0, width - steps))
        recorded = recorded[:, :width]
        columns = torch.arange(width, device=recorded.device)
        length = torch.tensor(lengths, device=recorded.device).unsqueeze(1)
        return torch.where(columns < length, recorded, 0.0).to(device if device is not None else recorded.device)


#: Logit distance (nats of transformed logit) below the top token at which `lift_perturbation` reaches ``eps``.
LIFT_SCALE = 10.0

#: The kinds `logit_noise` draws at random (``lift`` is a function of the logits, `lift_perturbation`).
RANDOM_NOISE_KINDS = ("uniform", "clipped_gaussian")


def _check_noise(eps: float, kind: str) -> None:
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps={eps!r} is out of range: accepted a finite float >= 0")
    if kind not in NOISE_KINDS:
        raise ValueError(f"kind={kind!r} is not accepted: accepted one of {NOISE_KINDS}")


def _hard_bound(delta: torch.Tensor, eps: float) -> torch.Tensor:
    """``delta`` clamped to ``[-b, b]``, ``b`` the largest value of its dtype that is ``<= eps`` (``eps`` itself may
    round up: float32(0.3) > 0.3), so that ``|delta_i| <= eps`` holds exactly."""
    bound = torch.tensor(eps, dtype=delta.dtype, device=delta.device)
    if float(bound) > eps:
        bound = torch.nextafter(bound, torch.zeros_like(bound))
    return torch.minimum(torch.maximum(delta, -bound), bound)


def logit_noise(
    shape: tuple[int, ...] | torch.Size,
    eps: float,
    kind: str = "uniform",
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A random logit perturbation ``delta`` of the given shape with ``|delta_i| <= eps`` for every entry.

    - ``"uniform"``: ``delta_i ~ U[-eps, eps]`` independently;
    - ``"clipped_gaussian"``: ``delta_i = clamp(N(0, (eps / 2)^2), -eps, eps)`` (about 4.6% of the entries sit
      on the clip at ``±eps``).

    (``"lift"`` is not random: it depends on the logits, see `lift_perturbation` and `logit_delta`.)

    Args:
        shape: output shape, e.g. ``[batch, vocab]``.
        eps: the hard bound, finite and ``>= 0``.
        kind: ``"uniform"`` or ``"clipped_gaussian"``.
        generator: a ``torch.Generator`` on ``device`` (for reproducible draws); ``None`` uses the global RNG.
        device: where to draw (the generator's device when ``None``).
        dtype: floating dtype of the result.

    Returns:
        The perturbation tensor.

    Raises:
        ValueError: on a negative or non-finite ``eps`` or an unknown ``kind`` (or ``"lift"``).
    """
    _check_noise(eps, kind)
    if kind not in RANDOM_NOISE_KINDS:
        raise ValueError(f"kind={kind!r} depends on the logits: use lift_perturbation(logits, eps) or logit_delta")
    if device is None and generator is not None:
        device = generator.device
    if kind == "uniform":
        delta = (torch.rand(shape, generator=generator, device=device, dtype=dtype) * 2.0 - 1.0) * eps
    else:
        delta = torch.randn(shape, generator=generator, device=device, dtype=dtype) * (eps / 2.0)
    # The clamp makes the bound hard for both kinds.
    return _hard_bound(delta, eps)


def lift_perturbation(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``lift`` perturbation of transformed logits ``z`` (last dimension the vocabulary):

        delta_i = eps * min(1, (z_max - z_i) / LIFT_SCALE),        LIFT_SCALE = 10

    Deterministic and biased: the top token gets 0, a token ``LIFT_SCALE`` nats or more below it gets ``eps``, so the
    perturbed distribution has a heavier tail (tail tokens gain up to ``eps`` nats of log-probability, the top
    tokens lose some). ``0 <= delta_i <= eps`` exactly, so the mismatch bound at ``eps`` holds. A ``-inf`` logit gets
    ``eps`` (and stays ``-inf``); positions without a finite maximum get 0.

    Args:
        logits: ``[..., V]`` transformed logits (after temperature, softcap and scale).
        eps: the lift, finite and ``>= 0``.

    Returns:
        ``delta`` of ``logits``' shape and dtype.
    """
    _check_noise(eps, "lift")
    z_max = logits.amax(dim=-1, keepdim=True)
    fraction = ((z_max - logits) / LIFT_SCALE).clamp(0.0, 1.0).nan_to_num(nan=0.0)
    return _hard_bound(fraction * eps, eps)


def logit_delta(
    logits: torch.Tensor, eps: float, kind: str = "uniform", generator: torch.Generator | None = None
) -> torch.Tensor:
    """The perturbation ``delta`` (``|delta_i| <= eps``) of kind ``kind`` for the transformed ``logits``: a random
    draw of their shape, dtype and device (`logit_noise`), or the ``lift`` of these logits (`lift_perturbation`)."""
    if kind == "lift":
        return lift_perturbation(logits, eps)
    return logit_noise(logits.shape, eps, kind, generator=generator, device=logits.device, dtype=logits.dtype)


class LogitNoiseProcessor(LogitsProcessor):
    """Inject a bounded logit perturbation into ``generate`` (place it *before* the recorder).

    At every decoding step it draws ``delta`` with ``|delta_i| <= eps`` (`logit_noise`; for ``"lift"``,
    `lift_perturbation` of the step's transformed logits ``scores / temperature``) and returns
    ``scores + temperature * delta``. HF applies its temperature warper afterwards, so the sampler's transformed
    logits become ``z / T + delta``: the perturbation bound ``eps`` holds on exactly the logits the rule and
    the softmax see (up to the fp32 rounding of the sum). The following processors — the
    `RolloutLogprobRecorder`, then the top-k/top-p/min-p warpers — see the perturbed scores, so the
    sampled tokens are drawn from the perturbed distribution and the recorded log-probabilities are its own.

    Args:
        eps: the hard bound on ``|delta_i|`` in nats of transformed logit, ``>= 0`` (0: identity).
        kind: ``"uniform"``, ``"clipped_gaussian"`` or ``"lift"`` (`NOISE_KINDS`).
        seed: seeds a private ``torch.Generator`` (created on the scores' device at the first call), so the
            noise is reproducible and the global RNG that drives sampling is not consumed.
        temperature: the sampler's temperature (the noise is scaled by it before the warper divides).

    Attributes:
        max_abs_delta: the largest ``|delta_i|`` drawn so far (``<= eps``).
        num_calls: decoding steps perturbed so far.
    """

    def __init__(self, eps: float, kind: str = "uniform", seed: int = 0, temperature: float = 1.0):
        _check_noise(eps, kind)
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is out of range: accepted > 0")
        self.eps = float(eps)
        self.kind = kind
        self.seed = int(seed)
        self.temperature = float(temperature)
        self.max_abs_delta = 0.0
        self.num_calls = 0
        self._generator: torch.Generator | None = None

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.num_calls += 1
        if self.eps == 0.0:
            return scores
        if self.kind == "lift":
            delta = lift_perturbation(scores.float() / self.temperature, self.eps)
        else:
            gen = self._generator_for(scores.device)
            delta = logit_noise(scores.shape, self.eps, self.kind, generator=gen, device=scores.device)
        self.max_abs_delta = max(self.max_abs_delta, float(delta.abs().max()) if delta.numel() else 0.0)
        return scores + (self.temperature * delta).to(scores.dtype)


@contextmanager
def rollout_precision(model: torch.nn.Module, dtype: torch.dtype | None):
    """Run the enclosed generation in ``dtype`` without changing the trained (master) weights.

    - ``None``: the model as it is (trl's behaviour: under ``bf16``/``fp16`` mixed precision, accelerate's autocast
      wrapper of the forward applies to generation too).
    - the parameters' own dtype: as is, with any enclosing autocast disabled.
    - ``float32`` over lower-precision parameters: parameters are upcast for the duration and restored
      afterwards (bf16/fp16 -> fp32 -> bf16/fp16 is exact).
    - a lower precision over fp32 parameters: ``torch.autocast`` to ``dtype`` (weights cast per matmul, the
      master weights untouched), which is how mixed-precision inference engines run.
    """
    if dtype is None:
        yield
        return
    from trl_integration.trl_private import mixed_precision_forward

    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params:
        yield
        return
    device_type = params[0].device.type
    dtypes = {p.dtype for p in params}
    # Under mixed precision, accelerate wraps `model.forward` in its own autocast (keeping the unwrapped one in
    # `_original_forward`); that inner autocast would override ours, so the rollout runs the unwrapped forward.
    unwrapped_forward = mixed_precision_forward(model)
    wrapped = unwrapped_forward is not None
    saved_forward = model.forward if wrapped else None
    originals = [(p, p.data) for p in params if p.dtype != torch.float32] if dtype == torch.float32 else []
    try:
        if wrapped:
            model.forward = unwrapped_forward
        if dtypes == {dtype} or dtype == torch.float32:
            for p, data in originals:  # lossless upcast of lower-precision parameters
                p.data = data.float()
            with torch.autocast(device_type, enabled=False):
                yield
        else:
            with torch.autocast(device_type, dtype=dtype):
                yield
    finally:
        for p, data in originals:
            p.data = data
        if wrapped:
            model.forward = saved_forward


@contextmanager
def recording_generate(
    model,
    recorder: RolloutLogprobRecorder | None,
    dtype: torch.dtype | None,
    processors: list[LogitsProcessor] | tuple[LogitsProcessor, ...] = (),
):
    """Patch ``model.generate`` for the enclosed block: append ``processors`` (e.g. a
    `LogitNoiseProcessor`) and then ``recorder`` to its logits processors, run it under
    `rollout_precision` and finalize the recorder with the returned sequences (a recording that cannot be finalized
    sets ``recorder.failure`` instead of raising)."""
    processors = list(processors)
    if recorder is None and dtype is None and not processors:
        yield
        return
    original = model.generate
    had_instance_attr = "generate" in vars(model)

    def generate(*args, **kwargs):
        extra = [*processors, *([recorder] if recorder is not None else [])]
        if extra:
            given = kwargs.get("logits_processor") or LogitsProcessorList()
            kwargs["logits_processor"] = LogitsProcessorList([*given, *extra])
        with rollout_precision(model, dtype) if dtype is not None else nullcontext():
            out = original(*args, **kwargs)
        if recorder is not None:
            try:
                recorder.finalize(out if isinstance(out, torch.Tensor) else out.sequences)
            except RuntimeError as error:  # degrade: the rollout is fine, only its log-probabilities are missing
                recorder.failure = str(error)
        return out

    model.generate = generate
    try:
        yield
    finally:
        if had_instance_attr:
            model.generate = original
        else:
            del model.generate
