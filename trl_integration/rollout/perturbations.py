"""The injected logit perturbations of the mismatch lab: bounded noise, the biased ``lift`` and the ``tail``.

Every kind is a perturbation ``delta`` of the sampler's *transformed* logits ``z`` (after logit scale, softcap and
temperature) with the hard bound ``|delta_i| <= eps``, so the mismatch between the perturbed rollout policy
``mu = softmax(z + delta)`` and the trained policy ``pi = softmax(z)`` obeys
``|log pi(a) - log mu(a)| <= log(p + (1 - p) e^{2 eps})`` (`safevocab.bounds.logprob_mismatch_bound`):

- ``uniform``: ``delta_i ~ U[-eps, eps]``, independently per entry and step (`logit_noise`);
- ``clipped_gaussian``: ``delta_i = clamp(N(0, (eps/2)^2), -eps, eps)`` (`logit_noise`);
- ``lift``: deterministic and biased, ``delta_i = eps * min(1, (z_max - z_i) / 10)`` (`lift_perturbation`): every
  token but the top one gains up to ``eps``, a global flattening of the distribution;
- ``tail``: deterministic and biased, ``delta_i = eps * 1[i not in S(z)]`` (`tail_perturbation`), ``S(z)`` the safe
  set a rule keeps at these logits: exactly the tokens Dynamic Vocabulary Pruning with that rule would cut gain
  ``eps``, the kept ones nothing. For ``min_p=rho``: ``i`` is lifted iff ``p_i < rho * p_max``, i.e.
  ``z_max - z_i > ln(1 / rho)`` (the rule keeps its boundary: ``z_i = z_max + ln rho`` is kept and not lifted,
  computed as `safevocab.rules.MinP` computes it, in the logits' float precision). Any other rule works the same way
  through its own kept set (`SafeVocabRule.keep_mask`): ``top_k=k`` lifts every token below the ``k``-th largest
  logit, ``top_p=q`` every token outside the nucleus, ``min_prob=tau`` every token with ``p_i < tau`` but the
  argmax, an intersection everything outside the intersection. The rule ``none`` cuts nothing and is refused.

`LogitNoiseProcessor` injects any of them into ``generate``, before the rollout log-probability recorder and the
sampling warpers, so that tokens are sampled from, and recorded under, the perturbed distribution
(:mod:`trl_integration.rollout.mismatch` places it; ``trl_integration.rollout.recorder`` re-exports every name here).
"""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor

from safevocab import NoPruning, SafeVocabRule, parse_rule
from trl_integration.options import NOISE_KINDS

__all__ = [
    "NOISE_KINDS",
    "LIFT_SCALE",
    "RANDOM_NOISE_KINDS",
    "logit_noise",
    "lift_perturbation",
    "tail_rule",
    "tail_perturbation",
    "logit_delta",
    "LogitNoiseProcessor",
]

#: Logit distance (nats of transformed logit) below the top token at which `lift_perturbation` reaches ``eps``.
LIFT_SCALE = 10.0

#: The kinds `logit_noise` draws at random (``lift`` and ``tail`` are functions of the logits).
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

    (``"lift"`` and ``"tail"`` are not random: they depend on the logits, see `lift_perturbation`,
    `tail_perturbation` and `logit_delta`.)

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
        ValueError: on a negative or non-finite ``eps`` or an unknown ``kind`` (or ``"lift"``, ``"tail"``).
    """
    _check_noise(eps, kind)
    if kind not in RANDOM_NOISE_KINDS:
        raise ValueError(
            f"kind={kind!r} depends on the logits: use lift_perturbation, tail_perturbation or logit_delta"
        )
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


def tail_rule(rule: SafeVocabRule | str | None) -> SafeVocabRule:
    """The rule whose cut tokens the ``tail`` perturbation lifts, parsed (a string as `safevocab.parse_rule` reads it).

    Raises:
        ValueError: ``None``, a rule string that does not parse, or the rule ``none`` (it cuts nothing).
    """
    if rule is None:
        raise ValueError("rule=None is not accepted for kind='tail': accepted a rule that prunes, e.g. 'min_p=0.01'")
    parsed = parse_rule(rule) if isinstance(rule, str) else rule
    if not isinstance(parsed, SafeVocabRule):
        raise ValueError(f"rule={rule!r} is not accepted for kind='tail': accepted a SafeVocabRule or a rule string")
    if isinstance(parsed, NoPruning):
        raise ValueError(
            "rule='none' is not accepted for kind='tail': it cuts no token, so nothing would be "
            "lifted; accepted a rule that prunes, e.g. 'min_p=0.01'"
        )
    return parsed


def tail_perturbation(logits: torch.Tensor, eps: float, rule: SafeVocabRule | str) -> torch.Tensor:
    """The ``tail`` perturbation of transformed logits ``z`` (last dimension the vocabulary):

        delta_i = eps   if token i is outside the safe set S(z) that ``rule`` keeps at these logits,
        delta_i = 0     if it is inside,

    so exactly the tokens Dynamic Vocabulary Pruning with ``rule`` would cut gain ``eps`` nats (for ``min_p=rho``:
    ``z_max - z_i > ln(1 / rho)``; the module docstring says what other rules cut). ``0 <= delta_i <= eps`` exactly.
    A ``-inf`` logit is outside every safe set: it gets ``eps`` and stays ``-inf``.

    Args:
        logits: ``[..., V]`` transformed logits (after temperature, softcap and scale); the set is computed in their
            float precision (fp32, or fp64 for fp64 logits) as the trainer computes its safe set.
        eps: the lift of the cut tokens, finite and ``>= 0``.
        rule: the rule (a `SafeVocabRule` or its string, e.g. ``"min_p=0.01"``); ``none`` is refused.

    Returns:
        ``delta`` of ``logits``' shape and dtype.
    """
    _check_noise(eps, "tail")
    cut = ~tail_rule(rule).keep_mask(logits)
    return _hard_bound(cut.to(logits.dtype) * eps, eps)


def logit_delta(
    logits: torch.Tensor,
    eps: float,
    kind: str = "uniform",
    generator: torch.Generator | None = None,
    rule: SafeVocabRule | str | None = None,
) -> torch.Tensor:
    """The perturbation ``delta`` (``|delta_i| <= eps``) of kind ``kind`` for the transformed ``logits``: a random
    draw of their shape, dtype and device (`logit_noise`), the ``lift`` of these logits (`lift_perturbation`), or
    their ``tail`` under ``rule`` (`tail_perturbation`; ``rule`` is used by that kind only)."""
    if kind == "lift":
        return lift_perturbation(logits, eps)
    if kind == "tail":
        return tail_perturbation(logits, eps, rule)
    return logit_noise(logits.shape, eps, kind, generator=generator, device=logits.device, dtype=logits.dtype)


class LogitNoiseProcessor(LogitsProcessor):
    """Inject a bounded logit perturbation into ``generate`` (place it *before* the recorder).

    At every decoding step it draws ``delta`` with ``|delta_i| <= eps`` (`logit_noise`; for ``"lift"`` and
    ``"tail"``, `lift_perturbation` or `tail_perturbation` of the step's transformed logits ``scores / temperature``,
    the unperturbed logits of this rollout) and returns
    ``scores + temperature * delta``. HF applies its temperature warper afterwards, so the sampler's transformed
    logits become ``z / T + delta``: the perturbation bound ``eps`` holds on exactly the logits the rule and
    the softmax see (up to the fp32 rounding of the sum). The following processors — the
    `RolloutLogprobRecorder`, then the top-k/top-p/min-p warpers — see the perturbed scores, so the
    sampled tokens are drawn from the perturbed distribution and the recorded log-probabilities are its own.

    Args:
        eps: the hard bound on ``|delta_i|`` in nats of transformed logit, ``>= 0`` (0: identity).
        kind: ``"uniform"``, ``"clipped_gaussian"``, ``"lift"`` or ``"tail"`` (`NOISE_KINDS`).
        seed: seeds a private ``torch.Generator`` (created on the scores' device at the first call), so the
            noise is reproducible and the global RNG that drives sampling is not consumed.
        temperature: the sampler's temperature (the noise is scaled by it before the warper divides; the ``tail``
            kind's safe set is the rule's at this temperature).
        rule: the rule whose cut tokens kind ``"tail"`` lifts (a `SafeVocabRule` or its string); required by that
            kind, unused by the others.

    Attributes:
        max_abs_delta: the largest ``|delta_i|`` drawn so far (``<= eps``).
        num_calls: decoding steps perturbed so far.
    """

    def __init__(
        self,
        eps: float,
        kind: str = "uniform",
        seed: int = 0,
        temperature: float = 1.0,
        rule: SafeVocabRule | str | None = None,
    ):
        _check_noise(eps, kind)
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is out of range: accepted > 0")
        self.eps = float(eps)
        self.kind = kind
        self.rule = tail_rule(rule) if kind == "tail" else rule
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
        elif self.kind == "tail":
            delta = tail_perturbation(scores.float() / self.temperature, self.eps, self.rule)
        else:
            gen = self._generator_for(scores.device)
            delta = logit_noise(scores.shape, self.eps, self.kind, generator=gen, device=scores.device)
        self.max_abs_delta = max(self.max_abs_delta, float(delta.abs().max()) if delta.numel() else 0.0)
        return scores + (self.temperature * delta).to(scores.dtype)
