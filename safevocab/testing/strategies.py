"""Hypothesis strategies for testing your own thresholds: logits, rules and logit perturbations.

See :mod:`safevocab.testing` for the overview; needs ``hypothesis``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from hypothesis import strategies as st

from safevocab.rules import Intersection, MinP, MinProb, NoPruning, SafeVocabRule, TopK, TopP

__all__ = ["logits", "rules", "perturbations", "LOGIT_KINDS", "PERTURBATION_KINDS"]

T = TypeVar("T")

#: Shapes of distribution :func:`logits` draws from.
LOGIT_KINDS = ("gaussian", "flat", "peaked", "zipf", "ties")
#: Patterns :func:`perturbations` draws from.
PERTURBATION_KINDS = ("uniform", "signs", "adversarial", "reverse_adversarial", "constant", "sparse", "zero")

_RULE_KINDS = ("min_p", "min_prob", "top_k", "top_p")


def _value(draw: Any, x: T | st.SearchStrategy[T]) -> T:
    """A fixed value, or a draw when ``x`` is a strategy."""
    return draw(x) if isinstance(x, st.SearchStrategy) else x


def _check_dtype(dtype: object) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r} is not accepted: accepted a floating torch dtype")


def _check_kinds(kinds: Sequence[str], accepted: tuple[str, ...]) -> None:
    if isinstance(kinds, str) or not kinds or any(k not in accepted for k in kinds):
        raise ValueError(f"kinds={kinds!r} is not accepted: accepted a non-empty subset of {accepted}")


def logits(
    batch_shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]] = st.lists(st.integers(1, 4), max_size=2).map(
        tuple
    ),
    vocab_size: int | st.SearchStrategy[int] = st.integers(2, 64),
    dtype: torch.dtype = torch.float32,
    scale: float | st.SearchStrategy[float] = 1.0,
    kinds: Sequence[str] = LOGIT_KINDS,
    allow_neg_inf: bool = True,
) -> st.SearchStrategy[torch.Tensor]:
    """Strategy for logits ``[*batch_shape, V]`` covering flat, peaked and heavy-tailed distributions.

    Each example picks one kind for the whole tensor: ``"gaussian"`` (standard normal times a drawn scale
    in ``[0.3, 10]``), ``"flat"`` (near-uniform), ``"peaked"`` (one token ``~20`` nats above the rest),
    ``"zipf"`` (``-s * log(rank)`` in random order, like an LLM's heavy tail) or ``"ties"`` (small
    integers, many exact ties). Values come from a ``torch.Generator`` seeded by a hypothesis draw, so
    examples shrink and replay.

    Args:
        batch_shape: leading shape, or a strategy for it (default: up to 2 dims of size 1..4).
        vocab_size: ``V >= 1``, or a strategy for it (default 2..64).
        dtype: floating dtype of the result (values are generated in float64, then cast).
        scale: a multiplier applied to every kind (an inverse temperature), or a strategy for it.
        kinds: the subset of :data:`LOGIT_KINDS` to draw from.
        allow_neg_inf: sometimes set some entries to ``-inf`` (masked tokens); each row keeps its argmax
            finite, so it always has at least one token of nonzero probability.

    Returns:
        A hypothesis strategy of torch tensors.

    Raises:
        TypeError: when ``dtype`` is not floating.
        ValueError: on an unknown kind or an out-of-range fixed ``vocab_size`` or ``scale``.
    """
    _check_dtype(dtype)
    _check_kinds(kinds, LOGIT_KINDS)
    if isinstance(vocab_size, int) and vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} is out of range: accepted vocab_size >= 1")
    if isinstance(scale, (int, float)) and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} is out of range: accepted a finite scale > 0")
    return _logits(batch_shape, vocab_size, dtype, scale, tuple(kinds), allow_neg_inf)


@st.composite
def _logits(
    draw: Any,
    batch_shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]],
    vocab_size: int | st.SearchStrategy[int],
    dtype: torch.dtype,
    scale: float | st.SearchStrategy[float],
    kinds: tuple[str, ...],
    allow_neg_inf: bool,
) -> torch.Tensor:
    shape = tuple(_value(draw, batch_shape))
    vocab = _value(draw, vocab_size)
    if vocab < 1:
        raise ValueError(f"vocab_size={vocab!r} is out of range: accepted vocab_size >= 1")
    mult = float(_value(draw, scale))
    if not (math.isfinite(mult) and mult > 0):
        raise ValueError(f"scale={mult!r} is out of range: accepted a finite scale > 0")
    kind = draw(st.sampled_from(tuple(kinds)))
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    full = (*shape, vocab)

    if kind == "gaussian":
        sigma = draw(st.sampled_from([0.3, 1.0, 3.0, 10.0]))
        z = torch.randn(full, generator=g, dtype=torch.float64) * sigma
    elif kind == "flat":
        z = torch.randn(full, generator=g, dtype=torch.float64) * 1e-2
    elif kind == "peaked":
        z = torch.randn(full, generator=g, dtype=torch.float64)
        top = torch.randint(0, vocab, (*shape, 1), generator=g)
        z.scatter_add_(-1, top, torch.full((*shape, 1), 20.0, dtype=torch.float64))
    elif kind == "zipf":
        s = draw(st.sampled_from([0.5, 1.0, 1.5, 2.5]))
        ranks = torch.argsort(torch.rand(full, generator=g), dim=-1).to(torch.float64) + 1.0
        z = -s * torch.log(ranks)
    else:  # ties
        z = torch.randint(-3, 4, full, generator=g).to(torch.float64)
    z = z * mult

    if allow_neg_inf and vocab > 1 and draw(st.booleans()):
        frac = draw(st.sampled_from([0.1, 0.5, 0.9]))
        masked = torch.rand(full, generator=g) < frac
        masked.scatter_(-1, z.argmax(dim=-1, keepdim=True), False)  # keep the argmax finite
        z = z.masked_fill(masked, -math.inf)
    return z.to(dtype)


def rules(
    kinds: Sequence[str] = _RULE_KINDS,
    allow_intersections: bool = True,
    allow_none: bool = True,
    max_top_k: int = 64,
) -> st.SearchStrategy[SafeVocabRule]:
    """Strategy for random :class:`~safevocab.rules.SafeVocabRule` over valid ranges.

    ``min_p`` is one of the common values ``1e-4, 1e-3, 1e-2`` or uniform in ``[1e-4, 1]``, ``min_prob``
    likewise in ``[1e-4, 0.5]``, ``top_k`` is in ``[1, max_top_k]`` and ``top_p`` one of ``0.9, 0.95, 1``
    or uniform in ``[0.05, 1]``; intersections combine 2..len(kinds)
    different kinds (put into sampler order by :meth:`~safevocab.rules.Intersection.of`).

    Args:
        kinds: the rule keys to use, a non-empty subset of ``("min_p", "min_prob", "top_k", "top_p")``.
        allow_intersections: also draw intersections of several kinds.
        allow_none: also draw :class:`~safevocab.rules.NoPruning`.
        max_top_k: the largest ``k`` drawn for ``top_k``.

    Returns:
        A hypothesis strategy of rules.

    Raises:
        ValueError: on an unknown kind or ``max_top_k < 1``.
    """
    _check_kinds(kinds, _RULE_KINDS)
    if not isinstance(max_top_k, int) or max_top_k < 1:
        raise ValueError(f"max_top_k={max_top_k!r} is out of range: accepted an integer max_top_k >= 1")
    return _rules(tuple(kinds), allow_intersections, allow_none, max_top_k)


@st.composite
def _rules(
    draw: Any, kinds: tuple[str, ...], allow_intersections: bool, allow_none: bool, max_top_k: int
) -> SafeVocabRule:

    def one(key: str) -> SafeVocabRule:
        if key == "min_p":
            return MinP(draw(st.sampled_from([1e-4, 1e-3, 1e-2]) | st.floats(1e-4, 1.0)))
        if key == "min_prob":
            return MinProb(draw(st.sampled_from([1e-4, 1e-3, 1e-2]) | st.floats(1e-4, 0.5)))
        if key == "top_k":
            return TopK(draw(st.integers(1, max_top_k)))
        return TopP(draw(st.sampled_from([0.9, 0.95, 1.0]) | st.floats(0.05, 1.0)))

    options = ["single"] + (["intersection"] if allow_intersections and len(kinds) > 1 else [])
    options += ["none"] if allow_none else []
    shape = draw(st.sampled_from(options))
    if shape == "none":
        return NoPruning()
    if shape == "single":
        return one(draw(st.sampled_from(tuple(kinds))))
    chosen = draw(st.lists(st.sampled_from(tuple(kinds)), min_size=2, max_size=len(kinds), unique=True))
    return Intersection.of(*(one(k) for k in chosen))


def perturbations(
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]],
    eps: float | st.SearchStrategy[float],
    dtype: torch.dtype = torch.float32,
    kinds: Sequence[str] = PERTURBATION_KINDS,
) -> st.SearchStrategy[torch.Tensor]:
    """Strategy for bounded logit noise ``delta`` of ``shape`` with ``|delta_i| <= eps`` exactly.

    Kinds: ``"uniform"`` in ``[-eps, eps]``; ``"signs"`` (``+-eps`` at random); ``"adversarial"``
    (``-eps`` on one random token per row, ``+eps`` on the rest: the pattern that attains
    :func:`safevocab.bounds.logprob_mismatch_bound` for that token); ``"reverse_adversarial"`` (the
    opposite signs); ``"constant"`` (``+eps`` everywhere: a shift that changes no probability);
    ``"sparse"`` (``+-eps`` on a few tokens, 0 elsewhere); ``"zero"``. After the cast to ``dtype`` every
    entry is rounded toward zero if needed, so ``delta.abs().max() <= eps`` holds in ``dtype`` too.

    Args:
        shape: the shape of ``delta`` (the logits' shape, last dim ``V``), or a strategy for it.
        eps: the bound (finite, ``>= 0``), or a strategy for it.
        dtype: floating dtype of the result.
        kinds: the subset of :data:`PERTURBATION_KINDS` to draw from.

    Returns:
        A hypothesis strategy of torch tensors.

    Raises:
        TypeError: when ``dtype`` is not floating.
        ValueError: on an unknown kind or a fixed ``eps`` that is negative or not finite.
    """
    _check_dtype(dtype)
    _check_kinds(kinds, PERTURBATION_KINDS)
    if not isinstance(eps, st.SearchStrategy):
        _check_eps(eps)
    return _perturbations(shape, eps, dtype, tuple(kinds))


def _check_eps(eps: object) -> float:
    ok = isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0
    if not ok:
        raise ValueError(f"eps={eps!r} is out of range: accepted a finite eps >= 0")
    return float(eps)  # type: ignore[arg-type]


@st.composite
def _perturbations(
    draw: Any,
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]],
    eps: float | st.SearchStrategy[float],
    dtype: torch.dtype,
    kinds: tuple[str, ...],
) -> torch.Tensor:
    full = tuple(_value(draw, shape))
    bound = _check_eps(_value(draw, eps))
    kind = draw(st.sampled_from(tuple(kinds)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    f64 = torch.float64

    if kind == "uniform":
        delta = (torch.rand(full, generator=g, dtype=f64) * 2 - 1) * bound
    elif kind == "signs":
        delta = (torch.randint(0, 2, full, generator=g).to(f64) * 2 - 1) * bound
    elif kind in ("adversarial", "reverse_adversarial"):
        sign = 1.0 if kind == "adversarial" else -1.0
        delta = torch.full(full, sign * bound, dtype=f64)
        if len(full) and full[-1] > 0:
            token = torch.randint(0, full[-1], (*full[:-1], 1), generator=g)
            delta.scatter_(-1, token, -sign * bound)
    elif kind == "constant":
        delta = torch.full(full, bound, dtype=f64)
    elif kind == "sparse":
        spikes = torch.rand(full, generator=g) < 0.1
        signs = torch.randint(0, 2, full, generator=g).to(f64) * 2 - 1
        delta = torch.where(spikes, signs * bound, torch.zeros((), dtype=f64))
    else:  # zero
        delta = torch.zeros(full, dtype=f64)

    out = delta.to(dtype)
    # The cast can round an entry just above eps (0.1 -> 0.10000000149 in fp32): step it toward zero.
    too_big = out.to(f64).abs() > bound
    if bool(too_big.any()):
        out = torch.where(too_big, torch.nextafter(out, torch.zeros_like(out)), out)
    return out


# ----------------------------------------------------------------------------------------------------
# assertions
# ----------------------------------------------------------------------------------------------------
