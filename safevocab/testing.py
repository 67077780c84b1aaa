"""Hypothesis strategies and assertion helpers for testing your own thresholds and pipelines.

Import it explicitly (it needs ``hypothesis``; ``import safevocab`` never imports it)::

    from hypothesis import given
    from safevocab.testing import assert_pruning_bias_within, logits, rules

    @given(z=logits(vocab_size=32), rule=rules(kinds=("min_p",)))
    def test_my_threshold(z, rule): ...

Strategies:

- :func:`logits`: torch logits ``[*batch_shape, V]`` of many shapes of distribution (Gaussian at several
  scales, near-uniform, one-hot-like, Zipf-like heavy tails, tied values), optionally with ``-inf``
  entries (never a whole row).
- :func:`rules`: random :class:`~safevocab.rules.SafeVocabRule` (each kind, intersections, ``none``).
- :func:`perturbations`: logit noise with ``|delta| <= eps`` (uniform, random signs, the adversarial
  pattern that attains the mismatch bound, constant shifts, sparse spikes).

Assertions (raise ``AssertionError`` with the worst position and value):

- :func:`assert_pruning_bias_within`: per-position ``TV(p, p_S) = m`` and ``KL(p_S || p) = -log(1 - m)``.
- :func:`assert_mismatch_within_bound`: every kept token's log-probability gap between two sets of logits
  is within :func:`safevocab.bounds.logprob_mismatch_bound`.
- :func:`assert_sequence_bias_within`: sequence-level ``TV(P, Q)`` / ``KL(Q || P)`` from kept masses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from hypothesis import strategies as st

from safevocab.bounds import (
    pruned_logprob_mismatch_bound,
    sequence_kl,
    sequence_tv,
    sequence_tv_upper_bound,
)
from safevocab.logprobs import safe_log_softmax, transform_logits
from safevocab.rules import Intersection, MinP, MinProb, NoPruning, SafeVocabRule, TopK, TopP, parse_rule

__all__ = [
    "logits",
    "rules",
    "perturbations",
    "LOGIT_KINDS",
    "PERTURBATION_KINDS",
    "assert_pruning_bias_within",
    "assert_mismatch_within_bound",
    "assert_sequence_bias_within",
]

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


def _index(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    if len(shape) == 0:
        return ()
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(shape)))


# ----------------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------------


def logits(
    batch_shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]] = st.lists(
        st.integers(1, 4), max_size=2
    ).map(tuple),
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


def _check_max(name: str, value: float | None, upper: float | None) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    ok = ok and (math.isfinite(value) if upper is None else value <= upper)
    if not ok:
        accepted = f"0 <= {name} <= {upper}" if upper is not None else f"a finite {name} >= 0"
        raise ValueError(f"{name}={value!r} is out of range: accepted {accepted}")


def assert_pruning_bias_within(
    logits: torch.Tensor,
    rule: SafeVocabRule | str | None,
    max_tv: float | None = None,
    max_kl: float | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
) -> None:
    """Assert that pruning with ``rule`` costs at most ``max_tv`` / ``max_kl`` at every position.

    Per position, with ``m`` the pruned mass, ``TV(p, p_S) = m`` and ``KL(p_S || p) = -log(1 - m)``
    (exact; see :mod:`safevocab.bounds`). The logits are transformed as the sampler does
    (``logit_scale``, softcap, ``temperature``) and the safe set is the one
    :func:`safevocab.logprobs.safe_log_softmax` uses.

    Args:
        logits: raw logits ``[..., V]``.
        rule: a rule or a rule string such as ``"min_p=0.01"``.
        max_tv: the largest acceptable per-position TV (pruned mass), in ``[0, 1]``; ``None``: unchecked.
        max_kl: the largest acceptable per-position KL in nats, ``>= 0``; ``None``: unchecked.
        temperature: sampling temperature (> 0).
        softcap: final-logit softcap (> 0) or ``None``.
        logit_scale: logit multiplier applied first (> 0).

    Raises:
        AssertionError: naming the worst position, its TV or KL, ``|S|`` and ``V``.
        ValueError: when neither ``max_tv`` nor ``max_kl`` is given, or one is out of range.
    """
    if max_tv is None and max_kl is None:
        raise ValueError("max_tv=None and max_kl=None: give at least one of them")
    _check_max("max_tv", max_tv, 1.0)
    _check_max("max_kl", max_kl, None)
    rule = parse_rule(rule)
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError("logits must be a tensor [..., V]")
    targets = logits.detach().argmax(dim=-1)
    with torch.no_grad():
        out = safe_log_softmax(logits.detach(), targets, rule, temperature, softcap, logit_scale)
    log_kept = out.log_kept_mass.to(torch.float64).clamp(max=0.0)
    tv, kl = -torch.expm1(log_kept), -log_kept
    vocab = logits.shape[-1]
    batch_shape = tuple(logits.shape[:-1])

    for name, values, limit in (("TV", tv, max_tv), ("KL", kl, max_kl)):
        if limit is None or values.numel() == 0:
            continue
        bad = values > limit
        if bool(bad.any()):
            flat = int(values.reshape(-1).argmax())
            pos = _index(flat, batch_shape)
            worst = float(values.reshape(-1)[flat])
            size = int(out.safe_size.reshape(-1)[flat])
            raise AssertionError(
                f"pruning {name} {worst:.6g} at position {pos} exceeds max_{name.lower()}={limit!r} "
                f"(rule {str(rule)!r}, pruned mass {float(tv.reshape(-1)[flat]):.6g}, |S|={size} of V={vocab}; "
                f"{int(bad.sum())} of {values.numel()} positions exceed it)"
            )


def assert_mismatch_within_bound(
    train_logits: torch.Tensor,
    infer_logits: torch.Tensor,
    rule: SafeVocabRule | str | None = None,
    eps: float | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    atol: float = 1e-6,
) -> None:
    """Assert every kept token's log-probability gap is within the tight mismatch bound.

    With ``delta = infer_logits - train_logits`` and ``S`` the safe set of ``rule`` on the *training*
    logits, used on both sides (DESIGN section 4: same ``S``), checks for every position and every
    ``a in S``::

        |log pi_S(a) - log mu_S(a)| <= log(p_S + (1 - p_S) * exp(2 * eps))   (+ atol)

    with ``p_S = p(a) / (1 - m)`` the pruned training probability (``p_S = p`` without a rule). Computed
    in float64. Log-probabilities work as "logits" too (``log_softmax`` is shift invariant), so you can
    pass full-vocabulary log-probabilities from two engines.

    Args:
        train_logits: raw training logits ``[..., V]``.
        infer_logits: raw inference logits of the same shape; ``-inf`` entries must match the training ones.
        rule: the safe-vocabulary rule, a rule string, or ``None`` for the full softmax.
        eps: the perturbation size to check against, in units of the raw logits (scaled by
            ``logit_scale / temperature`` internally; softcap only shrinks differences). ``None``: each
            position uses its own measured ``max_a |delta_a|``, for which the bound is a theorem.
        temperature: sampling temperature (> 0).
        softcap: final-logit softcap (> 0) or ``None``.
        logit_scale: logit multiplier applied first (> 0).
        atol: absolute tolerance (nats) for float rounding.

    Raises:
        AssertionError: naming the worst position and token, its gap, the bound, ``p`` and the measured
            ``|delta|`` there.
        ValueError: on mismatched shapes, ``-inf`` patterns that differ, or a bad ``eps``/``atol``.
    """
    for name, x in (("train_logits", train_logits), ("infer_logits", infer_logits)):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1:
            raise TypeError(f"{name} must be a floating-point tensor [..., V]")
    if train_logits.shape != infer_logits.shape:
        raise ValueError(
            f"train_logits {tuple(train_logits.shape)} and infer_logits {tuple(infer_logits.shape)}: "
            "accepted the same shape [..., V]"
        )
    if eps is not None and not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps={eps!r} is out of range: accepted None or a finite eps >= 0")
    if not (isinstance(atol, (int, float)) and atol >= 0):
        raise ValueError(f"atol={atol!r} is out of range: accepted atol >= 0")
    rule = parse_rule(rule)

    f64 = torch.float64
    with torch.no_grad():
        z_t = transform_logits(train_logits.detach().to(f64), temperature, softcap, logit_scale)
        z_i = transform_logits(infer_logits.detach().to(f64), temperature, softcap, logit_scale)
    inf_t, inf_i = torch.isneginf(z_t), torch.isneginf(z_i)
    if bool((inf_t != inf_i).any()):
        flat = int(torch.nonzero((inf_t != inf_i).reshape(-1))[0])
        raise ValueError(
            f"train_logits and infer_logits have -inf at different entries (first at index "
            f"{_index(flat, tuple(z_t.shape))}): the perturbation there is infinite"
        )
    delta = torch.where(inf_t, torch.zeros((), dtype=f64), z_i - z_t)
    measured = delta.abs().amax(dim=-1, keepdim=True)
    eps_z = measured if eps is None else torch.tensor(eps * logit_scale / temperature, dtype=f64)

    keep = rule.keep_mask(z_t)
    log_p = torch.log_softmax(z_t, dim=-1)
    kept = torch.exp(torch.logsumexp(log_p.masked_fill(~keep, -math.inf), dim=-1, keepdim=True)).clamp(max=1.0)
    gap = (
        torch.log_softmax(z_t.masked_fill(~keep, -math.inf), dim=-1)
        - torch.log_softmax(z_i.masked_fill(~keep, -math.inf), dim=-1)
    ).abs()
    p = log_p.exp()
    # p(a) <= kept mass for every token (the argmax is kept); the minimum only absorbs rounding.
    bound = pruned_logprob_mismatch_bound(torch.minimum(p, kept), kept, eps_z)
    excess = torch.where(keep, gap - bound, torch.full((), -math.inf, dtype=f64))
    bad = excess > atol
    if bool(bad.any()):
        flat = int(excess.reshape(-1).argmax())
        index = _index(flat, tuple(z_t.shape))
        pos, token = index[:-1], index[-1]
        g, b = float(gap.reshape(-1)[flat]), float(bound.reshape(-1)[flat])
        row_delta = float(measured.reshape(-1)[flat // z_t.shape[-1]])
        used = "measured max |delta|" if eps is None else f"eps={eps!r} (x logit_scale/temperature)"
        raise AssertionError(
            f"log-prob gap {g:.6g} at position {pos}, token {token} exceeds the mismatch bound {b:.6g} "
            f"by {g - b:.3g} (p={float(p.reshape(-1)[flat]):.6g}, "
            f"kept mass={float(kept.reshape(-1)[flat // z_t.shape[-1]]):.6g}, rule {str(rule)!r}, bound from "
            f"{used}; measured max |delta| at this position = {row_delta:.6g}; "
            f"{int(bad.sum())} of {int(keep.sum())} kept tokens exceed it)"
        )


def assert_sequence_bias_within(
    kept_mass: torch.Tensor,
    mask: torch.Tensor | None = None,
    max_tv: float | None = None,
    max_kl: float | None = None,
    weights: torch.Tensor | None = None,
) -> None:
    """Assert the sequence-level pruning bias ``TV(P, Q)`` / ``KL(Q || P)`` is within limits.

    ``TV(P, Q) = 1 - E_Q[prod_t (1 - m_t)]`` and ``KL(Q || P) = E_Q[sum_t -log(1 - m_t)]`` are
    estimated from rollouts of the pruned sampler (or computed exactly with ``weights = Q(y)``), see
    :func:`safevocab.bounds.sequence_tv`. With a rewards range ``[r_min, r_max]``, ``max_tv`` bounds the
    objective bias by ``(r_max - r_min) * max_tv``.

    Args:
        kept_mass: per-token kept mass ``1 - m_t``, ``[B, T]`` (e.g. ``safe_log_softmax(...)
            .log_kept_mass.exp()``).
        mask: ``[B, T]`` bool marking real tokens; padding is ignored. ``None``: all real.
        max_tv: the largest acceptable ``TV(P, Q)``, in ``[0, 1]``; ``None``: unchecked.
        max_kl: the largest acceptable ``KL(Q || P)`` in nats, ``>= 0``; ``None``: unchecked.
        weights: optional ``[B]`` sequence weights (see :func:`safevocab.bounds.sequence_tv`).

    Raises:
        AssertionError: with the estimate, the upper bound ``E_Q[sum_t m_t]`` and the worst sequence.
        ValueError: when neither limit is given or one is out of range (and on bad ``kept_mass``,
            ``mask`` or ``weights``, from :mod:`safevocab.bounds`).
    """
    if max_tv is None and max_kl is None:
        raise ValueError("max_tv=None and max_kl=None: give at least one of them")
    _check_max("max_tv", max_tv, 1.0)
    _check_max("max_kl", max_kl, None)
    tv = float(sequence_tv(kept_mass, mask, weights))
    kl = float(sequence_kl(kept_mass, mask, weights))
    failures = []
    if max_tv is not None and tv > max_tv:
        failures.append(f"TV(P, Q) = {tv:.6g} exceeds max_tv={max_tv!r}")
    if max_kl is not None and kl > max_kl:
        failures.append(f"KL(Q || P) = {kl:.6g} exceeds max_kl={max_kl!r}")
    if failures:
        real = torch.ones_like(kept_mass, dtype=torch.bool) if mask is None else mask.bool()
        log_kept = torch.where(real, kept_mass.to(torch.float64), torch.ones((), dtype=torch.float64)).log()
        per_seq = -torch.expm1(log_kept.sum(dim=-1))
        worst = int(per_seq.argmax())
        upper = float(sequence_tv_upper_bound(kept_mass, mask, weights))
        raise AssertionError(
            "; ".join(failures)
            + f" (over {kept_mass.shape[0]} sequences; upper bound E_Q[sum_t m_t] = {upper:.6g}; worst sequence "
            f"{worst} loses 1 - prod(kept) = {float(per_seq[worst]):.6g} over {int(real[worst].sum())} tokens)"
        )
