"""Assertions on the exact bounds, for your own tests: they raise ``AssertionError`` with the worst position.

See :mod:`safevocab.testing` for the overview.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from safevocab.bounds import (
    pruned_logprob_mismatch_bound,
    sequence_kl,
    sequence_tv,
    sequence_tv_upper_bound,
)
from safevocab.logprobs import safe_log_softmax, transform_logits
from safevocab.rules import SafeVocabRule, parse_rule

__all__ = ["assert_pruning_bias_within", "assert_mismatch_within_bound", "assert_sequence_bias_within"]


def _index(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    if len(shape) == 0:
        return ()
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(shape)))


# ----------------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------------


def _check_max(name: str, value: float | None, upper: float | None) -> None:
    __tracebackhide__ = True  # a misuse is shown at the caller
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
    __tracebackhide__ = True  # pytest shows the failure at the caller, with this message, not this source
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
    logits, used on both sides (docs/bounds.md: the same ``S``), checks for every position and every
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
    __tracebackhide__ = True  # pytest shows the failure at the caller, with this message, not this source
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
    __tracebackhide__ = True  # pytest shows the failure at the caller, with this message, not this source
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
