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
- `LogitNoiseProcessor` (:mod:`trl_integration.rollout.perturbations`) adds a perturbation
  ``delta`` with a hard bound ``|delta_i| <= eps`` to the sampler's transformed logits: seeded zero-mean noise
  (``uniform``, ``clipped_gaussian``), the deterministic, biased ``lift`` of the tail,
  ``delta_i = eps * min(1, (z_max - z_i) / 10)`` (`lift_perturbation`: the top token keeps its logit, tokens
  10 nats or more below it gain ``eps``, so the rollout's tail is heavier), or the ``tail``: ``eps`` on exactly
  the tokens a safe-vocabulary rule cuts at these logits, 0 elsewhere (`tail_perturbation`). Placed before
  the recorder, the tokens are *sampled* from the perturbed distribution and the recorded rollout
  log-probabilities are those of the perturbed distribution, so the mismatch against the training engine obeys
  ``|log pi - log mu| <= log(p + (1 - p) e^{2 eps})`` (plus the engines' own float-level differences).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from einops import rearrange
from transformers import LogitsProcessor, LogitsProcessorList

from safevocab import SafeVocabRule, safe_log_softmax
from safevocab.effective_rule import sampler_rule
from safevocab.logprobs import DEFAULT_MAX_CHUNK_BYTES

__all__ = [
    "UNSUPPORTED_SAMPLING_KWARGS",
    "RolloutLogprobRecorder",
    "sampler_rule_from_generation_config",
    "rollout_recorder",
    "rollout_precision",
    "recording_generate",
]

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
        # The buffered steps were concatenated step after step, each [batch, V]: unflatten to [steps, batch].
        self._steps.append(rearrange(out.logprobs, "(steps batch) -> steps batch", batch=batch))
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
    from trl_integration._private import mixed_precision_forward

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
