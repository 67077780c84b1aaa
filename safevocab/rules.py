"""Safe-vocabulary rules: which tokens of a next-token distribution are kept.

Every rule here is a *threshold rule*: on transformed logits ``z`` (after logit scale, softcap and
temperature, see :func:`safevocab.logprobs.transform_logits`) it computes one threshold ``t`` per
position and keeps exactly the tokens with ``z_a >= t`` (and finite ``z_a``). That is what makes the
rules cheap to apply chunk by chunk, and lets the backward pass rebuild the safe set from a single
saved number per position.

| rule | keeps token ``a`` iff | matches |
|---|---|---|
| ``MinP(rho)`` | ``p_a >= rho * p_max`` | HF/vLLM ``min_p`` |
| ``MinProb(tau)`` | ``p_a >= tau`` (argmax always kept) | absolute threshold |
| ``TopK(k)`` | ``z_a >=`` k-th largest ``z`` (ties kept) | HF/vLLM ``top_k`` |
| ``TopP(q)`` | ``a`` is in the smallest highest-probability set of mass ``>= q`` | HF/vLLM ``top_p`` |

Rules compose by intersection with ``&`` (or :func:`parse_rule` on ``"top_k=50,min_p=0.01"``). The
intersection applies its parts in the sampler's order ``top_k -> top_p -> min_p -> min_prob``, each on
the distribution renormalised over what the previous ones kept, exactly as HF ``generate`` and vLLM do.
Every rule keeps the argmax, so the safe set is never empty.

A rule reads the logits through :class:`ShiftedLogits`, which computes ``exp(z - m)`` and its row sums at most
once: ``min_prob`` and ``top_p`` need them, and the fused op needs them for its statistics anyway.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from safevocab.nucleus import nucleus_threshold
from safevocab.validation import integer, real

__all__ = [
    "SafeVocabRule",
    "NoPruning",
    "MinP",
    "MinProb",
    "TopK",
    "TopP",
    "Intersection",
    "parse_rule",
    "RULE_KEYS",
    "finite_floor",
    "ShiftedLogits",
]


def finite_floor(dtype: torch.dtype) -> float:
    """The floor of every threshold: the most negative finite number of the statistics dtype.

    ``z >= t`` with a finite ``t`` never keeps a ``-inf`` logit (probability 0), so the safe-set size
    counts only tokens the sampler could actually draw. fp64 statistics get fp64's floor, so rows far
    below fp32's range still keep their argmax.
    """
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).min


class ShiftedLogits:
    """Transformed logits ``z`` ``[..., V]`` with their row maxima ``m`` and, computed on first use, ``e = exp(z - m)``
    and ``sum_V e``: what several rules and the fused op's statistics share, computed once.

    ``out``: a preallocated buffer of ``z``'s shape and dtype for ``e`` (the fused op reuses one per chunk).
    """

    def __init__(self, z: torch.Tensor, z_max: torch.Tensor, out: torch.Tensor | None = None):
        self.z, self.z_max = z, z_max
        self._out, self._exp, self._total = out, None, None
        #: ``(row, col, t)`` of ``z`` viewed as ``[rows, V]``, set by a rule that found its threshold ``t`` ``[rows]``
        #: from candidate entries: every entry with ``z >= t`` is among them (``top_p``), so any set ``{z >= t'}``
        #: with ``t' >= t`` can be read off them.
        self.cover: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def exp(self) -> torch.Tensor:
        """``exp(z - m)``, the same arithmetic as ``torch.logsumexp`` (``fl(z - m)``, then ``exp``)."""
        if self._exp is None:
            self._exp = torch.sub(self.z, self.z_max, out=self._out).exp_() if self._out is not None else (self.z - self.z_max).exp_()
        return self._exp

    @property
    def computed(self) -> bool:
        """Whether :attr:`exp` has been computed (by a rule)."""
        return self._exp is not None

    @property
    def total(self) -> torch.Tensor:
        """``sum_V exp(z - m)`` ``[..., 1]``."""
        if self._total is None:
            self._total = self.exp.sum(-1, keepdim=True)
        return self._total

    def kept_total(self, kept_from: torch.Tensor | None) -> torch.Tensor:
        """``sum exp(z - m)`` over ``{z >= kept_from}`` ``[..., 1]`` (all tokens for ``None``)."""
        if kept_from is None:
            return self.total
        return torch.where(self.z >= kept_from, self.exp, 0.0).sum(-1, keepdim=True)


class SafeVocabRule(ABC):
    """A per-position safe-vocabulary rule on transformed logits ``[..., V]``.

    Subclasses implement :meth:`_raw_threshold` (and may override :meth:`_threshold_after` to share
    :class:`ShiftedLogits`' work); users call :meth:`threshold` or :meth:`keep_mask`.
    """

    #: Key used in the string form, e.g. ``"min_p"``. Also the sampler order (see ``_ORDER``).
    key: ClassVar[str]
    #: Extra scratch memory (bytes per logit) the rule needs on a chunk, used to size fused chunks.
    scratch_bytes_per_logit: ClassVar[int] = 0

    @abstractmethod
    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        """Threshold ``[..., 1]`` on fp32 logits ``z`` ``[..., V]`` with row maxima ``z_max`` ``[..., 1]``
        (``-inf`` marks excluded tokens)."""

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        """Threshold ``[..., 1]`` on the distribution renormalised over ``{z >= kept_from}`` (the rules applied
        before; ``None``: every token). By default the dropped logits are masked to ``-inf`` for
        :meth:`_raw_threshold`; the built-in rules read what they need from ``logits`` instead."""
        z = logits.z if kept_from is None else logits.z.masked_fill(logits.z < kept_from, -math.inf)
        return self._raw_threshold(z, logits.z_max)

    @property
    def parts(self) -> tuple[SafeVocabRule, ...]:
        """The elementary rules, in sampler order (a single rule is its own only part)."""
        return (self,)

    @torch.no_grad()
    def threshold(self, z: torch.Tensor) -> torch.Tensor:
        """Per-position threshold ``t`` ``[..., 1]`` (fp32): the safe set is ``{a : z_a >= t}``.

        Args:
            z: transformed logits ``[..., V]`` (any float dtype; compared in fp32, or fp64 for fp64). ``-inf`` entries are
                allowed and never kept. Each row needs at least one finite entry.

        The threshold is never above the row maximum, so the argmax is always kept, and, for rows
        with a finite maximum, never below the most negative finite number of the statistics dtype
        (:func:`finite_floor`), so ``-inf`` logits are never kept.
        """
        return self.threshold_and_max(z)[0]

    @torch.no_grad()
    def threshold_and_max(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`threshold` and the row maximum ``z_max`` ``[..., 1]``, sharing one pass over ``z``."""
        z = stat_float(z)
        z_max = z.amax(dim=-1, keepdim=True)
        return self.threshold_of(ShiftedLogits(z, z_max)), z_max

    @torch.no_grad()
    def threshold_of(self, logits: ShiftedLogits) -> torch.Tensor:
        """:meth:`threshold` of stat-dtype logits whose row maxima are known (the fused op's entry point)."""
        t = self._threshold_after(logits, None)
        # Floor first, then cap: a row whose every logit lies below the floor still keeps its argmax.
        return torch.minimum(t.clamp_min(finite_floor(logits.z.dtype)), logits.z_max)

    @torch.no_grad()
    def keep_mask(self, z: torch.Tensor) -> torch.Tensor:
        """Boolean mask ``[..., V]`` of the safe set on transformed logits ``z``."""
        z = stat_float(z)
        return z >= self.threshold(z)

    def __and__(self, other: SafeVocabRule) -> SafeVocabRule:
        if not isinstance(other, SafeVocabRule):
            return NotImplemented
        return Intersection.of(*self.parts, *other.parts)

    def sampler_kwargs(self) -> dict[str, float | int]:
        """Keyword arguments that make HF ``generate``/vLLM ``SamplingParams`` sample from the same set.

        Raises:
            ValueError: when the rule has no sampler equivalent (``min_prob``).
        """
        kwargs: dict[str, float | int] = {}
        for part in self.parts:
            if isinstance(part, MinProb):
                raise ValueError(
                    f"rule {str(self)!r}: min_prob has no HF/vLLM sampler equivalent; "
                    "use min_p, top_k or top_p for sampler-consistent pruning"
                )
            if isinstance(part, (MinP, TopK, TopP)):
                kwargs[part.key] = part.value
        return kwargs

    def __str__(self) -> str:
        return ",".join(f"{p.key}={p.value!r}" for p in self.parts)


@dataclass(frozen=True)
class NoPruning(SafeVocabRule):
    """Keeps every token of nonzero probability (the full softmax). Prints as ``"none"``."""

    key: ClassVar[str] = "none"

    @property
    def parts(self) -> tuple[SafeVocabRule, ...]:
        return ()

    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        return torch.full_like(z_max, -math.inf)

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        return torch.full_like(logits.z_max, -math.inf)

    def __str__(self) -> str:
        return "none"


@dataclass(frozen=True)
class MinP(SafeVocabRule):
    """Keep tokens with ``p_a >= rho * p_max``, i.e. ``z_a >= z_max + log(rho)``. ``0 < rho <= 1``.

    Matches HF ``MinPLogitsWarper`` and vLLM ``min_p``. ``rho = 1`` keeps only the argmax (and ties).
    """

    rho: float
    key: ClassVar[str] = "min_p"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", real("min_p", self.rho, lambda x: 0.0 < x <= 1.0, "0 < min_p <= 1"))

    @property
    def value(self) -> float:
        return float(self.rho)

    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        return z_max + math.log(self.rho)

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        return logits.z_max + math.log(self.rho)  # the argmax is always kept: the renormalised maximum is m


@dataclass(frozen=True)
class MinProb(SafeVocabRule):
    """Keep tokens with ``p_a >= tau`` (absolute probability), and always the argmax. ``0 < tau < 1``."""

    tau: float
    key: ClassVar[str] = "min_prob"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tau", real("min_prob", self.tau, lambda x: 0.0 < x < 1.0, "0 < min_prob < 1"))

    @property
    def value(self) -> float:
        return float(self.tau)

    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        return self._threshold_after(ShiftedLogits(z, z_max), None)

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        # p_a >= tau  <=>  z_a >= logsumexp(z) + log(tau); ``threshold`` caps it at z_max (argmax kept).
        # logsumexp's own arithmetic: m + log sum exp(z - m), over the kept tokens.
        return (logits.z_max + logits.kept_total(kept_from).log()) + math.log(self.tau)


@dataclass(frozen=True)
class TopK(SafeVocabRule):
    """Keep tokens whose logit is at least the k-th largest (ties kept). ``k >= 1``.

    Matches HF ``TopKLogitsWarper`` and vLLM ``top_k``; ``k >= V`` keeps everything.
    """

    k: int
    key: ClassVar[str] = "top_k"

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", integer("top_k", self.k, lambda k: k >= 1, "an integer top_k >= 1"))

    @property
    def value(self) -> int:
        return int(self.k)

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        z = logits.z if kept_from is None else logits.z.masked_fill(logits.z < kept_from, -math.inf)
        return self._raw_threshold(z, logits.z_max)

    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        if self.k >= z.shape[-1]:
            return torch.full_like(z_max, -math.inf)
        return torch.topk(z, self.k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)


@dataclass(frozen=True)
class TopP(SafeVocabRule):
    """Keep the smallest highest-probability set of mass ``>= q`` (nucleus). ``0 < q <= 1``.

    Follows HF ``TopPLogitsWarper``/vLLM ``top_p``: a token is removed when the mass of the tokens at or
    below it (ascending order) is ``<= 1 - q``; ``q = 1`` keeps every token (no truncation). Tokens tied with the last kept one are all kept (the
    samplers break such ties by sort order instead; ties do not occur on continuous logits).
    The threshold is found without sorting the vocabulary (:func:`safevocab.nucleus.nucleus_threshold`, a radix select
    on the probabilities with float64 masses); HF's fp32 sort and cumulative sum can differ from it only where the mass
    at the boundary is within fp32 rounding of ``q``.
    """

    q: float
    key: ClassVar[str] = "top_p"
    # the candidates' bool mask
    scratch_bytes_per_logit: ClassVar[int] = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "q", real("top_p", self.q, lambda x: 0.0 < x <= 1.0, "0 < top_p <= 1"))

    @property
    def value(self) -> float:
        return float(self.q)

    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        if self.q >= 1.0:
            # top_p=1 is "no truncation" for HF and vLLM: keep every token, also those whose probability
            # underflows to 0 in the cumulative sum below.
            return torch.full_like(z_max, -math.inf)
        return self._threshold_after(ShiftedLogits(z, z_max), None)

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        z = logits.z
        if self.q >= 1.0:
            return torch.full_like(logits.z_max, -math.inf)
        vocab = z.shape[-1]
        flat_from = None if kept_from is None else kept_from.reshape(-1, 1)
        t, cover = nucleus_threshold(z.reshape(-1, vocab), logits.exp.reshape(-1, vocab), self.q, flat_from)
        t = t.view(logits.z_max.shape)
        logits.cover = (*cover, t.reshape(-1))
        return t


# The sampler's order (HF generate and vLLM): top_k, then top_p, then min_p; min_prob last.
_ORDER: dict[type[SafeVocabRule], int] = {TopK: 0, TopP: 1, MinP: 2, MinProb: 3}
RULE_KEYS: dict[str, type[SafeVocabRule]] = {cls.key: cls for cls in _ORDER}


@dataclass(frozen=True)
class Intersection(SafeVocabRule):
    """Intersection of elementary rules, applied in sampler order, each on the distribution
    renormalised over what the previous ones kept. Build it with ``&`` or :meth:`of`."""

    rules: tuple[SafeVocabRule, ...]
    key: ClassVar[str] = "intersection"

    @staticmethod
    def of(*rules: SafeVocabRule) -> SafeVocabRule:
        """Sort ``rules`` into sampler order; one rule of each kind at most (two would be ambiguous)."""
        seen: dict[type, SafeVocabRule] = {}
        for rule in rules:
            for part in rule.parts:
                if type(part) in seen:
                    raise ValueError(
                        f"rule: {part.key} given twice ({seen[type(part)]} and {part}); give each threshold once"
                    )
                seen[type(part)] = part
        ordered = tuple(sorted(seen.values(), key=lambda r: _ORDER[type(r)]))
        if not ordered:
            return NoPruning()
        if len(ordered) == 1:
            return ordered[0]
        return Intersection(ordered)

    @property
    def parts(self) -> tuple[SafeVocabRule, ...]:
        return self.rules

    @property
    def scratch_bytes_per_logit(self) -> int:  # type: ignore[override]
        return max(p.scratch_bytes_per_logit for p in self.rules) + 4  # + the masked copy of z

    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        return self._threshold_after(ShiftedLogits(z, z_max), None)

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        t = torch.full_like(logits.z_max, -math.inf) if kept_from is None else kept_from
        for i, part in enumerate(self.rules):
            # Renormalising over the kept set does not move logits: each part sees the distribution over
            # {z >= t} (the tokens the previous parts kept).
            part_t = part._threshold_after(logits, kept_from if i == 0 else t)
            # Capped at the row maximum, so every step keeps the argmax, as the samplers do.
            t = torch.minimum(torch.maximum(t, part_t), logits.z_max)
        return t


def stat_float(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype statistics are kept in: fp32, or fp64 for fp64 inputs (for gradcheck)."""
    return x if x.dtype == torch.float64 else x.float()


def parse_rule(spec: str | SafeVocabRule | None) -> SafeVocabRule:
    """Parse ``"min_p=1e-3"``, ``"top_k=50,min_p=0.01"`` or ``"none"`` into a rule.

    ``str(parse_rule(s))`` gives the canonical form (sampler order), and
    ``parse_rule(str(rule)) == rule`` for every rule. A :class:`SafeVocabRule` passes through, and
    ``None`` or ``""`` mean :class:`NoPruning`.

    Raises:
        ValueError: on an unknown key, a repeated key, a malformed item or an out-of-range value
            (the message names the key, the value and the accepted range).
    """
    if spec is None:
        return NoPruning()
    if isinstance(spec, SafeVocabRule):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"rule must be a str or a SafeVocabRule, got {type(spec).__name__}: {spec!r}")
    text = spec.strip()
    if text.lower() in ("", "none"):
        return NoPruning()
    parts: list[SafeVocabRule] = []
    for item in text.split(","):
        key, sep, raw = item.strip().partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if not sep or not raw:
            raise ValueError(f"rule item {item.strip()!r} in {spec!r}: expected key=value, e.g. 'min_p=1e-3'")
        cls = RULE_KEYS.get(key)
        if cls is None:
            raise ValueError(f"rule key {key!r} in {spec!r} is unknown: accepted {', '.join(RULE_KEYS)} or 'none'")
        if cls is TopK:
            try:
                value: float | int = int(raw)
            except ValueError:
                raise ValueError(f"top_k={raw!r} is out of range: accepted an integer top_k >= 1") from None
        else:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{key}={raw!r} is not a number") from None
        parts.append(cls(value))  # type: ignore[call-arg]
    return Intersection.of(*parts)
