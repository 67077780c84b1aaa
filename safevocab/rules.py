"""Safe-vocabulary rules: which tokens of a next-token distribution are kept.

Every rule here is a *threshold rule*: on transformed logits ``z`` (after logit scale, softcap and
temperature, see :func:`safevocab.logprobs.transform_logits`) it computes one threshold ``t`` per
position and keeps exactly the tokens with ``z_a >= t`` (and finite ``z_a``). That is what makes the
rules cheap to apply chunk by chunk, and lets the backward pass rebuild the safe set from a single
saved number per position.

| rule | keeps token ``a`` iff | matches |
|---|---|---|
| ``MinP(rho)`` | ``p_a >= rho * p_max`` | HF/vLLM/SGLang ``min_p`` |
| ``MinProb(tau)`` | ``p_a >= tau`` (argmax always kept) | HF ``epsilon_cutoff`` |
| ``TopK(k)`` | ``z_a >=`` k-th largest ``z`` (ties kept) | HF/vLLM/SGLang ``top_k`` |
| ``TopP(q)`` | ``a`` is in the smallest highest-probability set of mass ``>= q`` | HF/vLLM/SGLang ``top_p`` |

Rules compose by intersection with ``&`` (or :func:`parse_rule` on ``"top_k=50,min_p=0.01"``), in the order of
the rule's ``engine``, the inference engine whose sampler it reproduces; each part sees the distribution
renormalised over what the parts before it kept (:mod:`safevocab.engine_order`):

| ``engine`` | order |
|---|---|
| ``"hf"`` (default: transformers ``generate``) | ``top_k -> top_p -> min_p -> min_prob`` |
| ``"vllm"`` (V1 sampler and Model Runner V2) | ``min_p -> top_k -> top_p`` (``-> min_prob``, which vLLM lacks) |
| ``"sglang"`` | as ``"hf"`` when ``min_p`` is set; else ``top_k`` and ``top_p`` both on the full distribution |

Every rule keeps the argmax, so the safe set is never empty.

A rule reads the logits through :class:`~safevocab.shifted_logits.ShiftedLogits` (``exp(z - m)`` and its row sums,
computed at most once).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from safevocab.engine_order import ENGINES, check_engine, composition_stages, print_order
from safevocab.nucleus import nucleus_threshold
from safevocab.shifted_logits import ShiftedLogits
from safevocab.validation import float_tensor, integer, raise_on_nan_or_inf_rows, real, real_text

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
    "ENGINES",
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


@dataclass(frozen=True, repr=False)
class SafeVocabRule(ABC):
    """A per-position safe-vocabulary rule on transformed logits ``[..., V]``.

    Subclasses implement :meth:`_raw_threshold` (and may override :meth:`_threshold_after` to share
    :class:`ShiftedLogits`' work); users call :meth:`threshold` or :meth:`keep_mask`.

    ``engine`` (keyword only, one of :data:`ENGINES`, default ``"hf"``): the inference engine whose composition
    order an intersection follows (:mod:`safevocab.engine_order`). An elementary rule keeps the same set for every
    engine but carries it, so that ``&`` composes in that engine's order; equality and ``repr`` include it.
    """

    engine: str = field(default="hf", kw_only=True)

    #: Key used in the string form, e.g. ``"min_p"`` (:mod:`safevocab.engine_order` orders them by key).
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
        """The elementary rules, in the engine's order (a single rule is its own only part)."""
        return (self,)

    @torch.no_grad()
    def threshold(self, z: torch.Tensor) -> torch.Tensor:
        """Per-position threshold ``t`` ``[..., 1]`` (fp32): the safe set is ``{a : z_a >= t}``.

        Args:
            z: transformed logits ``[..., V]`` (any float dtype; compared in fp32, or fp64 for fp64). ``-inf`` entries are
                allowed and never kept. Each row needs at least one finite entry.

        The threshold is never above the row maximum, so the argmax is always kept, and, for rows
        with a finite maximum, never below the most negative finite number of the statistics dtype
        (:func:`finite_floor`), so ``-inf`` logits are never kept. A non-float ``z`` raises ``TypeError``, a row
        holding a NaN or ``+inf`` (it would keep nothing) a one-line ``ValueError`` naming the row.
        """
        t, z_max = self.threshold_and_max(z)
        raise_on_nan_or_inf_rows("z", z, z_max)
        return t

    @torch.no_grad()
    def threshold_and_max(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`threshold` and the row maximum ``z_max`` ``[..., 1]``, sharing one pass over ``z``.

        Raises:
            ValueError: ``z`` has no vocabulary dimension or an empty one (``V = 0``): there is no argmax to keep,
                and no sampler draws from an empty vocabulary. Zero positions (``[0, V]``) are fine.
        """
        float_tensor("z", z, "a float dtype (transformed logits)")
        if z.dim() < 1 or z.shape[-1] == 0:
            raise ValueError(f"z.shape={tuple(z.shape)}: expected [..., V] with a vocabulary size V >= 1")
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
        """Boolean mask ``[..., V]`` of the safe set on transformed logits ``z`` (raises as :meth:`threshold`)."""
        return stat_float(z) >= self.threshold(z)  # threshold checks z (stat_float runs first but raises nothing)

    def __and__(self, other: SafeVocabRule) -> SafeVocabRule:
        """The intersection, in the engine's order; both sides must name the same engine (one-line
        ``ValueError`` otherwise: the result's order would depend on which side wins)."""
        if not isinstance(other, SafeVocabRule):
            return NotImplemented
        return Intersection.of(self, other)

    def with_engine(self, engine: str) -> SafeVocabRule:
        """The same thresholds composed in ``engine``'s order (``self`` when it already is)."""
        engine = check_engine(engine)
        if engine == self.engine:
            return self
        copy = dataclasses.replace(self, engine=engine)
        if hasattr(self, "_text"):
            object.__setattr__(copy, "_text", self._text)  # the value as the user gave it prints the same
        return copy

    def sampler_kwargs(self) -> dict[str, float | int]:
        """Keyword arguments that make the rule's engine sample from the same set: HF ``generate``
        (``min_prob`` as ``epsilon_cutoff``), vLLM ``SamplingParams`` or SGLang's ``sampling_params``.

        Raises:
            ValueError: when the engine has no sampler equivalent of a part (``min_prob`` with vLLM or SGLang).
        """
        kwargs: dict[str, float | int] = {}
        for part in self.parts:
            if isinstance(part, MinProb):
                if self.engine != "hf":
                    raise ValueError(
                        f"rule {str(self)!r} (engine={self.engine!r}): min_prob has no {self.engine} sampler "
                        "equivalent; use min_p, top_k or top_p for sampler-consistent pruning"
                    )
                kwargs["epsilon_cutoff"] = part.value
            elif isinstance(part, (MinP, TopK, TopP)):
                kwargs[part.key] = part.value
        return kwargs

    def __str__(self) -> str:
        """The rule's spec, parts in the engine's order; the engine is not part of it (see :func:`parse_rule`)."""
        return ",".join(f"{p.key}={getattr(p, '_text', '') or repr(p.value)}" for p in self.parts)

    def __repr__(self) -> str:
        return self._repr(with_engine=True)

    def _repr(self, with_engine: bool) -> str:
        """The dataclass repr, ``engine`` shown when not ``"hf"`` (and ``with_engine``: an intersection shows it once)."""

        def shown(value: object) -> str:
            if isinstance(value, tuple):
                return "(" + ", ".join(shown(v) for v in value) + ("," if len(value) == 1 else "") + ")"
            return value._repr(with_engine=False) if isinstance(value, SafeVocabRule) else repr(value)

        names = [f.name for f in dataclasses.fields(self) if f.repr and f.name != "engine"]
        fields = [f"{name}={shown(getattr(self, name))}" for name in names]
        fields += [f"engine={self.engine!r}"] if with_engine and self.engine != "hf" else []
        return f"{type(self).__name__}({', '.join(fields)})"

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", check_engine(self.engine))


@dataclass(frozen=True, repr=False)
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


@dataclass(frozen=True, repr=False)
class MinP(SafeVocabRule):
    """Keep tokens with ``p_a >= rho * p_max``, i.e. ``z_a >= z_max + log(rho)``. ``0 < rho <= 1``.

    Matches HF ``MinPLogitsWarper``, vLLM's and SGLang's ``min_p``. ``rho = 1`` keeps only the argmax (and ties).
    """

    rho: float
    _text: str = field(default="", init=False, repr=False, compare=False)  # rho as given, for str()
    key: ClassVar[str] = "min_p"

    def __post_init__(self) -> None:
        super().__post_init__()
        given = self.rho
        object.__setattr__(self, "rho", real("min_p", given, lambda x: 0.0 < x <= 1.0, "0 < min_p <= 1"))
        object.__setattr__(self, "_text", real_text(given))

    @property
    def value(self) -> float:
        return float(self.rho)

    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        return z_max + math.log(self.rho)

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        return logits.z_max + math.log(self.rho)  # the argmax is always kept: the renormalised maximum is m


@dataclass(frozen=True, repr=False)
class MinProb(SafeVocabRule):
    """Keep tokens with ``p_a >= tau`` (absolute probability), and always the argmax. ``0 < tau < 1``.

    Matches HF ``EpsilonLogitsWarper`` (``epsilon_cutoff``); vLLM and SGLang have no equivalent."""

    tau: float
    _text: str = field(default="", init=False, repr=False, compare=False)  # tau as given, for str()
    key: ClassVar[str] = "min_prob"

    def __post_init__(self) -> None:
        super().__post_init__()
        given = self.tau
        object.__setattr__(self, "tau", real("min_prob", given, lambda x: 0.0 < x < 1.0, "0 < min_prob < 1"))
        object.__setattr__(self, "_text", real_text(given))

    @property
    def value(self) -> float:
        return float(self.tau)

    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        return self._threshold_after(ShiftedLogits(z, z_max), None)

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        # p_a >= tau  <=>  z_a >= logsumexp(z) + log(tau); ``threshold`` caps it at z_max (argmax kept).
        # logsumexp's own arithmetic: m + log sum exp(z - m), over the kept tokens.
        return (logits.z_max + logits.kept_total(kept_from).log()) + math.log(self.tau)


@dataclass(frozen=True, repr=False)
class TopK(SafeVocabRule):
    """Keep tokens whose logit is at least the k-th largest (ties kept). ``k >= 1``.

    Matches HF ``TopKLogitsWarper``, vLLM's and SGLang's ``top_k``; ``k >= V`` keeps everything.
    """

    k: int
    key: ClassVar[str] = "top_k"

    def __post_init__(self) -> None:
        super().__post_init__()
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


@dataclass(frozen=True, repr=False)
class TopP(SafeVocabRule):
    """Keep the smallest highest-probability set of mass ``>= q`` (nucleus). ``0 < q <= 1``.

    Follows HF ``TopPLogitsWarper``/vLLM ``top_p``: a token is removed when the mass of the tokens at or
    below it (ascending order) is ``<= 1 - q``; ``q = 1`` keeps every token (no truncation). Tokens tied with the last kept one are all kept (the
    samplers break such ties by sort order instead; ties do not occur on continuous logits).
    The threshold is found without sorting the vocabulary (:func:`safevocab.nucleus.nucleus_threshold`, a radix select
    on the probabilities with float64 masses; rows of at most 256 logits are sorted, with the same result); HF's fp32 sort and cumulative sum can differ from it only where the mass
    at the boundary is within fp32 rounding of ``q``.
    Near ``q = 1`` that is not rare: the engines' float32 cumsums (transformers, vLLM) differ from this exact set in
    ~1 % of Gaussian rows at ``q = 0.9999``, 4-5 % at 0.99999, 14-15 % at 0.999999 (docs/guide.md). There, replay the
    engine's sets (:class:`~safevocab.support.SafeSupport`, ``safe_vocab_support="replay"``): the exact route.
    """

    q: float
    _text: str = field(default="", init=False, repr=False, compare=False)  # q as given, for str()
    key: ClassVar[str] = "top_p"
    # the candidates' bool mask
    scratch_bytes_per_logit: ClassVar[int] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        given = self.q
        object.__setattr__(self, "q", real("top_p", given, lambda x: 0.0 < x <= 1.0, "0 < top_p <= 1"))
        object.__setattr__(self, "_text", real_text(given))

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
        flat_e = logits.exp.reshape(-1, vocab)
        t, cover = nucleus_threshold(z.reshape(-1, vocab), flat_e, self.q, flat_from, sync_free=logits.sync_free)
        t = t.view(logits.z_max.shape)
        if logits.sync_free:  # no candidates: the rows near a mass boundary instead
            logits.near = cover if logits.near is None else logits.near | cover
        else:
            logits.cover = (*cover, t.reshape(-1))
        return t


#: The rule kinds by key, in HF's order (the order ``str`` lists them in for ``"hf"`` and ``"sglang"``).
RULE_KEYS: dict[str, type[SafeVocabRule]] = {cls.key: cls for cls in (TopK, TopP, MinP, MinProb)}


@dataclass(frozen=True, repr=False)
class Intersection(SafeVocabRule):
    """Intersection of elementary rules, composed in the order of its ``engine``
    (:func:`safevocab.engine_order.composition_stages`): each part sees the distribution renormalised over what
    the parts of the earlier stages kept. Build it with ``&`` or :meth:`of`."""

    rules: tuple[SafeVocabRule, ...]
    key: ClassVar[str] = "intersection"

    def __post_init__(self) -> None:
        super().__post_init__()
        # the parts carry the composed rule's engine, in its order, so that ``parts`` recompose to the same rule
        order = print_order(self.engine)
        parts = sorted((part.with_engine(self.engine) for part in self.rules), key=lambda part: order.index(part.key))
        object.__setattr__(self, "rules", tuple(parts))

    @staticmethod
    def of(*rules: SafeVocabRule, engine: str | None = None) -> SafeVocabRule:
        """Sort ``rules`` into the engine's order; one rule of each kind at most (two would be ambiguous).

        Args:
            rules: rules of one engine (a one-line ``ValueError`` names two that differ).
            engine: the engine of the result, overriding the rules' own (``None``: theirs, ``"hf"`` for no rules).
        """
        if engine is None:
            engines = {rule.engine: rule for rule in rules}
            if len(engines) > 1:
                (one, a), (other, b) = list(engines.items())[:2]
                raise ValueError(
                    f"rule {a} has engine={one!r} and rule {b} engine={other!r}: accepted rules of one engine (the "
                    "engines compose rules in different orders); build both with parse_rule(spec, engine=...)"
                )
            engine = next(iter(engines), "hf")
        engine = check_engine(engine)
        seen: dict[type, SafeVocabRule] = {}
        for rule in rules:
            for part in rule.parts:
                if type(part) in seen:
                    raise ValueError(
                        f"rule: {part.key} given twice ({seen[type(part)]} and {part}); give each threshold once"
                    )
                seen[type(part)] = part.with_engine(engine)
        if not seen:
            return NoPruning(engine=engine)
        if len(seen) == 1:
            return next(iter(seen.values()))
        return Intersection(tuple(seen.values()), engine=engine)

    @property
    def parts(self) -> tuple[SafeVocabRule, ...]:
        return self.rules

    @property
    def scratch_bytes_per_logit(self) -> int:  # type: ignore[override]
        return max(p.scratch_bytes_per_logit for p in self.rules) + 4  # + the masked copy of z

    def _raw_threshold(self, z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
        return self._threshold_after(ShiftedLogits(z, z_max), None)

    def _threshold_after(self, logits: ShiftedLogits, kept_from: torch.Tensor | None) -> torch.Tensor:
        by_key = {part.key: part for part in self.rules}
        t = kept_from
        for stage in composition_stages(self.engine, frozenset(by_key)):
            # Renormalising over the kept set does not move logits: the parts of a stage all see the distribution
            # over {z >= t} (what the earlier stages kept), and the stage keeps what every one of them keeps.
            stage_t = [by_key[key]._threshold_after(logits, t) for key in stage]
            t_new = stage_t[0] if len(stage_t) == 1 else torch.maximum(*stage_t)
            # Capped at the row maximum, so every stage keeps the argmax, as the samplers do.
            t = torch.minimum(t_new if t is None else torch.maximum(t, t_new), logits.z_max)
        return torch.full_like(logits.z_max, -math.inf) if t is None else t


def stat_float(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype statistics are kept in: fp32, or fp64 for fp64 inputs (for gradcheck)."""
    return x if x.dtype == torch.float64 else x.float()


def parse_rule(spec: str | SafeVocabRule | None, engine: str | None = None) -> SafeVocabRule:
    """Parse ``"min_p=1e-3"``, ``"top_k=50,min_p=0.01"`` or ``"none"`` into a rule composed in ``engine``'s order.

    Args:
        spec: the rule's spec (parts in any order, keys and ``none`` case-insensitive), a :class:`SafeVocabRule`
            (passed through), or ``None``/``""`` for :class:`NoPruning`.
        engine: ``"hf"`` (transformers ``generate``), ``"vllm"`` or ``"sglang"``: whose composition order the rule
            follows (:mod:`safevocab.engine_order`). ``None`` (the default): ``"hf"`` for a string, the rule's own
            engine for a rule; a rule of another engine is returned with the given one (:meth:`SafeVocabRule.with_engine`).

    ``str(rule)`` gives the canonical spec (parts in the engine's order; the engine itself is not part of a spec),
    and ``parse_rule(str(rule), engine=rule.engine) == rule`` for every rule whose values were given as Python
    numbers or strings (a float32 value prints as its shortest float32 decimal, which parses to the float64
    nearest it).

    Raises:
        ValueError: on an unknown key, a repeated key, a malformed item, an out-of-range value or an unknown
            engine (the message names the key or argument, the value and the accepted range).
    """
    if engine is not None:
        engine = check_engine(engine)
    if spec is None:
        return NoPruning(engine=engine or "hf")
    if isinstance(spec, SafeVocabRule):
        return spec if engine is None else spec.with_engine(engine)
    if not isinstance(spec, str):
        raise TypeError(f"rule must be a str or a SafeVocabRule, got {type(spec).__name__}: {spec!r}")
    text = spec.strip()
    if text.lower() in ("", "none"):
        return NoPruning(engine=engine or "hf")
    parts: list[SafeVocabRule] = []
    for item in text.split(","):
        key, sep, raw = item.strip().partition("=")
        key, raw = key.strip().lower(), raw.strip()
        for other in (";", " ", "&", "|"):  # another separator between two parts: say which one rules take
            if other in raw and "=" in raw:
                raise ValueError(f"rule {spec!r}: separate its parts with a comma, e.g. 'min_p=0.01,top_k=5'")
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
    return Intersection.of(*parts, engine=engine or "hf")
