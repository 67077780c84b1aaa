"""Exact mismatch and pruning-bias bounds (docs/bounds.md states and derives them), as functions on tensors.

Notation, for one position: ``p`` is the full next-token distribution, ``S`` the safe set picked by a
rule, ``m = sum_{a not in S} p_a`` the pruned mass, ``1 - m`` the kept mass and
``p_S = p * 1_S / (1 - m)`` the pruned (renormalised) policy.

Per position:

- ``TV(p, p_S) = m``  (:func:`pruning_tv`), ``KL(p_S || p) = -log(1 - m)`` (:func:`pruning_kl`), and
  ``log p_S(a) - log p(a) = -log(1 - m)`` for every kept ``a``.
- ``MinP(rho)`` prunes ``m <= min(1 - p_max, (V - |S|) * rho * p_max)``
  (:func:`min_p_pruned_mass_bound`).
- Training-inference mismatch: if the inference logits are the training logits plus ``delta`` with
  ``|delta_i| <= eps``, a token of training probability ``p`` has
  ``|log pi(a) - log mu(a)| <= log(p + (1 - p) * exp(2 eps))`` (:func:`logprob_mismatch_bound`). The
  bound is tight (attained by ``delta_a = -eps``, ``+eps`` elsewhere). Its first-order form
  ``2 eps (1 - p)`` (:func:`logprob_mismatch_bound_first_order`) is *not* a strict bound.
- With the same ``S`` on both sides, a kept token obeys the same bound with ``p`` replaced by
  ``p_S(a) = p(a) / (1 - m) >= p(a)`` (:func:`pruned_logprob_mismatch_bound`): pruning never loosens it.

Per sequence, with ``P`` the unpruned policy, ``Q`` the per-step pruned one and ``m_t`` the pruned mass
at step ``t`` of a sequence ``y``:

- ``TV(P, Q) = 1 - E_{y~Q}[prod_t (1 - m_t)] <= E_Q[sum_t m_t]`` (:func:`sequence_tv`,
  :func:`sequence_tv_upper_bound`).
- ``KL(Q || P) = E_Q[sum_t -log(1 - m_t)]`` (:func:`sequence_kl`).
- For rewards in ``[r_min, r_max]``: ``|J(P) - J(Q)| <= (r_max - r_min) * TV(P, Q)``
  (:func:`objective_bias_bound`).

Rollouts sampled with the pruned sampler are draws from ``Q``, so averaging the per-sequence kept-mass
products over a batch of rollouts (no weights) is an unbiased estimate of ``TV(P, Q)``.

Every function validates its inputs first and raises ``ValueError``/``TypeError`` naming the argument,
the offending value and the accepted range. Functions that take "tensors or floats" return a Python
``float`` when every input is a Python number, and a tensor otherwise.
"""

from __future__ import annotations

import torch

from safevocab.support import SafeSupport
from safevocab.tensor_args import (
    TensorLike,
    as_tensor,
    broadcast,
    check_eps,
    check_kept_mass,
    check_probability,
    check_type,
    compute_dtype,
    device_of,
    first_bad,
    float_inputs,
    result_like,
    rounding_tol,
)

__all__ = [
    "logprob_mismatch_bound",
    "logprob_mismatch_bound_first_order",
    "pruned_mass",
    "pruning_tv",
    "pruning_kl",
    "pruned_logprob_mismatch_bound",
    "min_p_pruned_mass_bound",
    "objective_bias_bound",
    "sequence_tv",
    "sequence_kl",
    "sequence_tv_upper_bound",
]

# ----------------------------------------------------------------------------------------------------
# per-position statements
# ----------------------------------------------------------------------------------------------------


def logprob_mismatch_bound(p: TensorLike, eps: TensorLike) -> torch.Tensor | float:
    """Tight bound on the log-probability gap under a logit perturbation of size ``eps``.

    If the inference logits are the training logits plus ``delta`` with ``|delta_i| <= eps`` for every
    token ``i``, then a token ``a`` of training probability ``p`` obeys::

        |log pi(a) - log mu(a)| <= log(p + (1 - p) * exp(2 * eps))

    and the bound is attained by ``delta_a = -eps``, ``delta_i = +eps`` for ``i != a`` (or the reverse
    signs, up to swapping which side ``p`` is measured on). It vanishes as ``p -> 1`` and tends to
    ``2 * eps`` as ``p -> 0``. Computed as ``log1p((1 - p) * expm1(2 * eps))``, which stays accurate for
    tiny ``eps`` and ``p`` near 1, falling back to a ``logaddexp`` form when ``exp(2 * eps)`` overflows.

    Args:
        p: training probability of the token, in ``[0, 1]``; a tensor of any shape or a float.
        eps: the perturbation size ``max_i |delta_i|``, finite and ``>= 0``; a tensor broadcastable with
            ``p`` or a float.

    Returns:
        The bound in nats, of the broadcast shape of ``p`` and ``eps`` (dtype: the promoted floating
        dtype of the tensor inputs, at least float32); a Python float when both inputs are numbers.

    Raises:
        TypeError: when an input is not a float or a floating-point tensor.
        ValueError: when ``p`` is outside ``[0, 1]``, ``eps`` is negative or not finite, or the shapes do
            not broadcast.
    """
    dtype, (pt, et) = float_inputs(p=p, eps=eps)
    pt = check_probability("p", pt, dtype)
    et = check_eps("eps", et)

    q = 1.0 - pt
    small = torch.log1p(q * torch.expm1(2.0 * et))
    # exp(2 eps) overflowed (or 0 * inf at p = 1): log(p + q e^{2 eps}) = logaddexp(log p, log q + 2 eps).
    large = torch.logaddexp(torch.log(pt), torch.log(q) + 2.0 * et)
    out = torch.where(torch.isfinite(small), small, large)
    return result_like(out, p, eps)


def logprob_mismatch_bound_first_order(p: TensorLike, eps: TensorLike) -> torch.Tensor | float:
    """First-order approximation ``2 * eps * (1 - p)`` of :func:`logprob_mismatch_bound`.

    Warning:
        This is **not** a strict bound. By concavity of ``log``,
        ``log(p * 1 + (1 - p) * e^{2 eps}) >= p * 0 + (1 - p) * 2 eps``, with equality only at ``p = 0``,
        ``p = 1`` or ``eps = 0``; since the tight bound is attained, some perturbation produces a gap larger
        than ``2 eps (1 - p)`` for every ``0 < p < 1`` and ``eps > 0``. Use it only as a rule of thumb for
        small ``eps``.

    Args:
        p: training probability of the token, in ``[0, 1]``; a tensor or a float.
        eps: perturbation size, finite and ``>= 0``; a tensor broadcastable with ``p`` or a float.

    Returns:
        ``2 * eps * (1 - p)`` of the broadcast shape; a Python float when both inputs are numbers.

    Raises:
        TypeError: when an input is not a float or a floating-point tensor.
        ValueError: when ``p`` is outside ``[0, 1]`` or ``eps`` is negative or not finite.
    """
    dtype, (pt, et) = float_inputs(p=p, eps=eps)
    pt = check_probability("p", pt, dtype)
    et = check_eps("eps", et)
    return result_like(2.0 * et * (1.0 - pt), p, eps)


def pruned_mass(probs: torch.Tensor, keep: torch.Tensor | SafeSupport) -> torch.Tensor:
    """Pruned mass ``m = sum_{a not in S} p_a`` per position.

    Summed directly over the dropped tokens (not as ``1 - sum_{a in S} p_a``), so a tiny ``m`` keeps its
    relative precision.

    Args:
        probs: the full distribution ``p``, ``[..., V]``, floating point, entries ``>= 0``.
        keep: the safe set ``S`` as a bool mask of the same shape ``[..., V]`` (e.g. ``rule.keep_mask(z)``), or a
            replayed :class:`~safevocab.support.SafeSupport` with one row per position (flattened order): its
            kept mass feeds :func:`pruning_tv`, :func:`pruning_kl` and the sequence bounds like a rule's.

    Returns:
        ``m`` of shape ``[...]`` (dtype of ``probs``, at least float32).

    Raises:
        TypeError: when ``probs`` is not a floating-point tensor or ``keep`` not a bool tensor.
        ValueError: when the shapes differ or ``probs`` has a negative or non-finite entry.
    """
    if not isinstance(probs, torch.Tensor) or not probs.dtype.is_floating_point:
        got = probs.dtype if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise TypeError(f"probs must be a floating-point tensor [..., V], got {got}")
    if isinstance(keep, SafeSupport):
        keep = _support_mask(keep, probs)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise TypeError(f"keep must be a bool tensor [..., V], got {got}")
    if probs.shape != keep.shape or probs.dim() == 0:
        raise ValueError(f"probs {tuple(probs.shape)} and keep {tuple(keep.shape)}: accepted the same shape [..., V]")
    first_bad("probs", probs, ~((probs >= 0) & torch.isfinite(probs)), "finite probs >= 0")
    dtype = torch.promote_types(probs.dtype, torch.float32)
    return probs.to(dtype).masked_fill(keep, 0.0).sum(dim=-1)


def _support_mask(support: SafeSupport, probs: torch.Tensor) -> torch.Tensor:
    """The bool mask ``[..., V]`` of a replayed support laid out like ``probs``."""
    if not isinstance(probs, torch.Tensor) or probs.dim() == 0:
        raise TypeError("probs must be a floating-point tensor [..., V]")
    positions = probs.numel() // max(1, probs.shape[-1])
    if support.num_rows != positions:
        raise ValueError(
            f"keep: the support has {support.num_rows} rows but probs {tuple(probs.shape)} has {positions} "
            "positions: accepted one row per position"
        )
    return support.to(probs.device).to_dense(probs.shape[-1]).view(probs.shape)


def pruning_tv(kept_mass: TensorLike) -> torch.Tensor | float:
    """Exact total variation between the full and the pruned policy at one position.

    ``TV(p, p_S) = 0.5 * sum_a |p_a - p_S(a)| = m = 1 - kept_mass``: the kept tokens each gain mass,
    ``p_S(a) - p(a) = p(a) * m / (1 - m)``, summing to ``m``; the pruned ones each lose all of theirs,
    also summing to ``m``.

    Args:
        kept_mass: ``1 - m``, in ``(0, 1]``; a tensor of any shape or a float.

    Returns:
        ``m`` of the same shape (a Python float for a float input).

    Raises:
        TypeError: when ``kept_mass`` is not a float or a floating-point tensor.
        ValueError: when ``kept_mass`` is outside ``(0, 1]``.
    """
    dtype, (k,) = float_inputs(kept_mass=kept_mass)
    k = check_kept_mass("kept_mass", k, dtype)
    return result_like(1.0 - k, kept_mass)


def pruning_kl(kept_mass: TensorLike) -> torch.Tensor | float:
    """Exact ``KL(p_S || p) = -log(1 - m) = -log(kept_mass)`` at one position.

    It is also the log-ratio of every kept token: ``log p_S(a) - log p(a) = -log(1 - m)`` for ``a in S``
    (the ratio is constant on ``S``, which is why the KL equals it). Note ``KL(p || p_S)`` is infinite
    whenever ``m > 0``.

    Args:
        kept_mass: ``1 - m``, in ``(0, 1]``; a tensor of any shape or a float. Pass
            ``log_kept_mass.exp()`` from :func:`safevocab.logprobs.safe_log_softmax`, or negate its
            ``log_kept_mass`` directly.

    Returns:
        ``-log(kept_mass) >= 0`` of the same shape (a Python float for a float input).

    Raises:
        TypeError: when ``kept_mass`` is not a float or a floating-point tensor.
        ValueError: when ``kept_mass`` is outside ``(0, 1]``.
    """
    dtype, (k,) = float_inputs(kept_mass=kept_mass)
    k = check_kept_mass("kept_mass", k, dtype)
    return result_like(-torch.log(k), kept_mass)


def pruned_logprob_mismatch_bound(p: TensorLike, kept_mass: TensorLike, eps: TensorLike) -> torch.Tensor | float:
    """Mismatch bound on a kept token when both sides prune to the same safe set ``S``.

    With ``|delta_i| <= eps`` and the same ``S`` for training and inference, the renormalised
    log-probabilities of a kept token ``a`` obey::

        |log pi_S(a) - log mu_S(a)| <= log(p_S + (1 - p_S) * exp(2 * eps)),   p_S = p / kept_mass

    i.e. :func:`logprob_mismatch_bound` at ``p_S(a) >= p(a)``. Because that bound decreases in ``p``, it
    is never looser than the unpruned bound at ``p(a)``.

    Args:
        p: unpruned training probability ``p(a)`` of a kept token, in ``[0, kept_mass]``; tensor or float.
        kept_mass: ``1 - m`` at the same position, in ``(0, 1]``; tensor or float, broadcastable.
        eps: perturbation size, finite and ``>= 0``; tensor or float, broadcastable.

    Returns:
        The bound in nats of the broadcast shape; a Python float when all inputs are numbers.

    Raises:
        TypeError: when an input is not a float or a floating-point tensor.
        ValueError: when ``p`` is outside ``[0, 1]`` or above ``kept_mass`` (a kept token cannot hold more
            than the kept mass), ``kept_mass`` is outside ``(0, 1]``, ``eps`` is invalid, or the shapes do
            not broadcast.
    """
    dtype, (pt, kt, et) = float_inputs(p=p, kept_mass=kept_mass, eps=eps)
    pt = check_probability("p", pt, dtype)
    kt = check_kept_mass("kept_mass", kt, dtype)
    check_eps("eps", et)
    p_s = pt / kt
    first_bad("p", pt, p_s > 1 + rounding_tol(dtype), "0 <= p <= kept_mass (p of a kept token)")
    out = logprob_mismatch_bound(p_s.clamp(max=1.0), et)
    return result_like(out, p, kept_mass, eps)  # type: ignore[arg-type]


def min_p_pruned_mass_bound(
    p_max: TensorLike, safe_size: torch.Tensor | int, vocab_size: int, rho: TensorLike
) -> torch.Tensor | float:
    """Bound on the mass pruned by ``MinP(rho)``: ``m <= min(1 - p_max, (V - |S|) * rho * p_max)``.

    Every pruned token has ``p_a < rho * p_max`` and there are ``V - |S|`` of them; and the argmax is
    always kept, so ``m <= 1 - p_max``.

    Args:
        p_max: the largest probability at the position, in ``[0, 1]``; tensor or float.
        safe_size: ``|S|``, an int or an integer tensor broadcastable with ``p_max``, in ``[1, V]``
            (``safe_size`` from :func:`safevocab.logprobs.safe_log_softmax`).
        vocab_size: ``V``, an int ``>= 1``.
        rho: the ``min_p`` threshold, in ``(0, 1]``; tensor or float, broadcastable.

    Returns:
        The bound on ``m`` of the broadcast shape; a Python float when all inputs are numbers.

    Raises:
        TypeError: on a wrong input type (e.g. a float ``safe_size`` or ``vocab_size``).
        ValueError: when an input is out of range or the shapes do not broadcast.
    """
    check_type("p_max", p_max)
    check_type("safe_size", safe_size, integer=True)
    check_type("rho", rho)
    if not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool)):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}: {vocab_size!r}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} is out of range: accepted vocab_size >= 1")
    dtype, device = compute_dtype(p_max, rho), device_of(p_max, safe_size, rho)
    size = safe_size.to(device) if isinstance(safe_size, torch.Tensor) else torch.tensor(safe_size, device=device)
    first_bad("safe_size", size, ~((size >= 1) & (size <= vocab_size)), f"1 <= safe_size <= vocab_size={vocab_size}")
    pt, st, rt = broadcast(
        ("p_max", "safe_size", "rho"), as_tensor(p_max, dtype, device), size.to(dtype), as_tensor(rho, dtype, device)
    )
    pt = check_probability("p_max", pt, dtype)
    first_bad("rho", rt, ~((rt > 0) & (rt <= 1)), "0 < rho <= 1")
    out = torch.minimum(1.0 - pt, (vocab_size - st) * rt * pt)
    return result_like(out, p_max, safe_size, rho)


def objective_bias_bound(tv: TensorLike, r_min: TensorLike, r_max: TensorLike) -> torch.Tensor | float:
    """Bound on the change of expected reward: ``|J(P) - J(Q)| <= (r_max - r_min) * TV(P, Q)``.

    Holds for any two distributions ``P``, ``Q`` over sequences and any reward with values in
    ``[r_min, r_max]`` (shift the reward by ``(r_min + r_max) / 2``; then ``|r| <= (r_max - r_min) / 2``
    and ``|E_P r - E_Q r| <= 2 * sup|r| * TV``).

    Args:
        tv: ``TV(P, Q)`` in ``[0, 1]``, e.g. from :func:`sequence_tv`; tensor or float.
        r_min: lower end of the reward range (finite); tensor or float.
        r_max: upper end of the reward range (finite, ``>= r_min``); tensor or float.

    Returns:
        The bound, of the broadcast shape; a Python float when all inputs are numbers.

    Raises:
        TypeError: when an input is not a float or a floating-point tensor.
        ValueError: when ``tv`` is outside ``[0, 1]``, a reward end is not finite, or ``r_max < r_min``.
    """
    dtype, (tt, lo, hi) = float_inputs(tv=tv, r_min=r_min, r_max=r_max)
    tt = check_probability("tv", tt, dtype)
    first_bad("r_min", lo, ~torch.isfinite(lo), "a finite r_min")
    first_bad("r_max", hi, ~torch.isfinite(hi), "a finite r_max")
    if bool((hi < lo).any()):
        i = int(torch.nonzero((hi < lo).reshape(-1))[0])
        raise ValueError(
            f"r_max={hi.reshape(-1)[i].item()!r} is below r_min={lo.reshape(-1)[i].item()!r}: accepted r_max >= r_min"
        )
    return result_like((hi - lo) * tt, tv, r_min, r_max)


# ----------------------------------------------------------------------------------------------------
# sequence statements
# ----------------------------------------------------------------------------------------------------


def _sequence_inputs(
    kept_mass: torch.Tensor, mask: torch.Tensor | None, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, and return ``log kept`` ``[B, T]`` (0 on padding) and normalised weights ``[B]``, float64."""
    if not isinstance(kept_mass, torch.Tensor) or not kept_mass.dtype.is_floating_point:
        got = kept_mass.dtype if isinstance(kept_mass, torch.Tensor) else type(kept_mass).__name__
        raise TypeError(f"kept_mass must be a floating-point tensor [B, T], got {got}")
    if kept_mass.dim() != 2 or kept_mass.shape[0] == 0:
        raise ValueError(f"kept_mass has shape {tuple(kept_mass.shape)}: accepted [B, T] with B >= 1")
    batch = kept_mass.shape[0]
    if mask is None:
        real = torch.ones_like(kept_mass, dtype=torch.bool)
    else:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a bool (or 0/1) tensor [B, T], got {type(mask).__name__}")
        if mask.shape != kept_mass.shape:
            raise ValueError(
                f"mask has shape {tuple(mask.shape)}: accepted the shape of kept_mass {tuple(kept_mass.shape)}"
            )
        if mask.dtype == torch.bool:
            real = mask.to(kept_mass.device)
        elif mask.dtype.is_complex:
            raise TypeError(f"mask must be a bool (or 0/1) tensor [B, T], got dtype {mask.dtype}")
        else:
            first_bad("mask", mask, ~((mask == 0) | (mask == 1)), "mask values in {0, 1} (or a bool mask)")
            real = (mask != 0).to(kept_mass.device)
    # Padding is ignored: treated as kept mass 1 (its value may be anything, e.g. a 0 fill).
    k = torch.where(real, kept_mass.to(torch.float64), torch.ones((), dtype=torch.float64, device=kept_mass.device))
    first_bad(
        "kept_mass",
        torch.where(real, kept_mass, 1.0),
        ~((k > 0) & (k <= 1 + rounding_tol(kept_mass.dtype))),
        "0 < kept_mass <= 1 at real (mask=True) positions",
    )
    log_kept = torch.log(k.clamp(max=1.0))

    if weights is None:
        w = torch.full((batch,), 1.0 / batch, dtype=torch.float64, device=kept_mass.device)
    else:
        if not isinstance(weights, torch.Tensor) or not weights.dtype.is_floating_point:
            got = weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise TypeError(f"weights must be a floating-point tensor [B], got {got}")
        if weights.shape != (batch,):
            raise ValueError(f"weights has shape {tuple(weights.shape)}: accepted [B] = ({batch},)")
        w = weights.to(dtype=torch.float64, device=kept_mass.device)
        first_bad("weights", w, ~((w >= 0) & torch.isfinite(w)), "finite weights >= 0")
        total = w.sum()
        if not bool(total > 0):
            raise ValueError(f"weights sum to {total.item()!r}: accepted a positive sum")
        w = w / total
    return log_kept, w


def sequence_tv(
    kept_mass: torch.Tensor, mask: torch.Tensor | None = None, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``TV(P, Q) = 1 - E_{y~Q}[prod_t (1 - m_t)]`` for the unpruned policy ``P`` and pruned policy ``Q``.

    ``Q(y) = P(y) / prod_t (1 - m_t)`` on sequences whose every token is kept (and 0 elsewhere), so
    ``TV(P, Q) = sum_y max(Q(y) - P(y), 0) = E_Q[1 - prod_t (1 - m_t)]``. With rows sampled from ``Q``
    (rollouts of the pruned sampler) and no ``weights`` this is an unbiased Monte-Carlo estimate; with
    ``weights`` equal to the exact ``Q(y)`` of an enumeration of all sequences it is exact. The product
    is taken in log space in float64.

    Args:
        kept_mass: per-token kept mass ``1 - m_t``, ``[B, T]``, floating, in ``(0, 1]`` at real positions.
        mask: ``[B, T]`` bool (or 0/1) marking real tokens; padding is ignored (treated as kept mass 1,
            whatever value it holds). ``None`` means every position is real.
        weights: optional ``[B]`` non-negative weights of the sequences, normalised by their sum.
            ``None`` gives the plain mean.

    Returns:
        A 0-dim float64 tensor in ``[0, 1]``.

    Raises:
        TypeError: on a wrong dtype.
        ValueError: on a wrong shape or an out-of-range ``kept_mass``, ``mask`` or ``weights``.
    """
    log_kept, w = _sequence_inputs(kept_mass, mask, weights)
    # 1 - prod_t kept = -expm1(sum_t log kept), accurate even when the sequence lost almost no mass.
    return (w * -torch.expm1(log_kept.sum(dim=-1))).sum()


def sequence_kl(
    kept_mass: torch.Tensor, mask: torch.Tensor | None = None, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``KL(Q || P) = E_{y~Q}[sum_t -log(1 - m_t)]`` for the pruned policy ``Q`` and unpruned ``P``.

    ``log Q(y) - log P(y) = sum_t -log(1 - m_t)`` on the support of ``Q``. Same estimation semantics as
    :func:`sequence_tv` (Monte-Carlo without ``weights``, exact with ``weights = Q(y)`` over all ``y``).

    Args:
        kept_mass: per-token kept mass ``1 - m_t``, ``[B, T]``, floating, in ``(0, 1]`` at real positions.
        mask: ``[B, T]`` bool (or 0/1) marking real tokens; padding is ignored. ``None``: all real.
        weights: optional ``[B]`` non-negative sequence weights, normalised by their sum.

    Returns:
        A 0-dim float64 tensor ``>= 0`` (nats).

    Raises:
        TypeError: on a wrong dtype.
        ValueError: on a wrong shape or an out-of-range ``kept_mass``, ``mask`` or ``weights``.
    """
    log_kept, w = _sequence_inputs(kept_mass, mask, weights)
    return (w * -log_kept.sum(dim=-1)).sum()


def sequence_tv_upper_bound(
    kept_mass: torch.Tensor, mask: torch.Tensor | None = None, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Upper bound ``TV(P, Q) <= E_{y~Q}[sum_t m_t]`` (union bound: ``1 - prod(1 - m_t) <= sum m_t``).

    Args:
        kept_mass: per-token kept mass ``1 - m_t``, ``[B, T]``, floating, in ``(0, 1]`` at real positions.
        mask: ``[B, T]`` bool (or 0/1) marking real tokens; padding is ignored. ``None``: all real.
        weights: optional ``[B]`` non-negative sequence weights, normalised by their sum.

    Returns:
        A 0-dim float64 tensor ``>= 0`` (may exceed 1 for long sequences, where it is vacuous).

    Raises:
        TypeError: on a wrong dtype.
        ValueError: on a wrong shape or an out-of-range ``kept_mass``, ``mask`` or ``weights``.
    """
    log_kept, w = _sequence_inputs(kept_mass, mask, weights)
    # m_t = 1 - kept = -expm1(log kept); padding has log kept = 0, hence m = 0.
    return (w * -torch.expm1(log_kept).sum(dim=-1)).sum()
