"""Exact thresholds, in the kernel, for the rows the candidate buffer cannot decide: an MSB-first radix select.

:mod:`safevocab.kernels.threshold_select` decides a row from the candidates above its floor, at most ``KCAP`` of them.
A row whose *kept set itself* is wider than that (flat logits: ``top_p=0.9`` over ``V = 151936`` keeps thousands
of tokens; ties wider than ``KCAP`` under ``top_k``), or whose floor did not certify, would go to the rule's torch
code. This kernel decides such rows on the whole row instead, one program per flagged row (the others exit at once),
with the stages in the engine's order as :class:`safevocab.rules.Intersection` applies them.

**Keys.** Each transformed fp32 logit ``z`` (``-0`` taken as ``+0``) maps to an unsigned 32-bit key
``u(z) = bits + 2^31`` (``z >= 0``) or ``2^31 - 1 - |bits|`` (``z < 0``), so that ``z < z'`` iff ``u(z) < u(z')``
(``-inf`` the smallest); distinct keys are distinct values.

**Select.** For a weight ``w`` (``1``: top_k; ``e = exp(z - m)``: top_p), a lower bound ``l`` (the threshold of the
stages before: only ``{z >= l}`` is the distribution a stage sees) and a target ``tau``, the select finds
``v* = max {v in row : W(v) >= tau}``, ``W(v) = sum {w_b : z_b >= max(v, l)}``, ``DIGIT_BITS`` bits of ``u(v*)``
per pass, most significant first. A pass adds the weights of the entries whose key has the prefix decided so far
into ``2^DIGIT_BITS`` buckets of the next digit (counts and masses in float64); with ``A`` the weight above the
prefix's range, the digit is the highest bucket ``b`` with ``A + sum_{b' >= b} hist[b'] >= tau``, and ``A`` grows by
the buckets above ``b``. After ``32 / DIGIT_BITS`` passes the prefix is ``u(v*)``, ``A`` the weight strictly above
``v*``, and ``A + hist[b]`` the weight at or above it. The first pass's buckets hold the whole kept weight ``W(l)``
(the stage's ``T_prev``), so a fraction ``tau = q W(l)`` costs no extra pass.

**Stages** (:func:`safevocab.engine_order.composition_stages`; ``t`` starts at ``-inf``, each stage's threshold is the
maximum of its parts', ``t = min(max(t, t_stage), m)``, the result floored at the finite floor and capped at ``m``, as
``SafeVocabRule.threshold_of`` does):

- ``top_k``: ``v*`` by count with ``tau = k``; fewer than ``k`` kept entries: ``-inf`` (``rule``: the k-th largest of
  the masked row, then ``-inf``);
- ``top_p``: ``v*`` by mass (the fp32 ``e`` of the kernel's ``exp``, summed in float64). The rule takes the first
  sorted entry whose running mass reaches ``q T_prev``: ``max {v : M(v) >= q T_prev}``, the same ``v*`` when its
  masses and the kernel's agree. They are two roundings of one sum (``exp`` within ~2 ulps, ``T`` in fp32 partials:
  ``|M_kernel(v) - M_rule(v)| + q |T_kernel - T_rule| < w = MASS_MARGIN T_prev``, see
  :mod:`safevocab.kernels.candidate_thresholds`), so the row is certified only when ``v*`` found for ``q T_prev + w``
  also has its mass strictly above it (if anything lies above) below ``q T_prev - w``: then the rule's
  ``M_rule(v*) >= q T_rule`` and its mass above ``v*`` stays below ``q T_rule``, so it picks ``v*`` too. Otherwise
  (the crossing within the margin, or ``q T_prev + w`` not reached) the row is flagged for the torch fallback;
- ``min_p``: ``m + log rho`` in fp32, as the rule;
- ``min_prob``: ``(m + log kept) + log tau`` in fp32 (one pass for the kept mass), flagged when an entry of the kept
  set lies within ``MASS_MARGIN + |value| 2^-20`` of it (a second pass), as the candidate phase does.

**Cost.** ``32 / DIGIT_BITS`` passes over the (L2-resident) row per top_k/top_p stage, each ``2^DIGIT_BITS`` compare
and add per entry (the buckets are an in-register one-hot reduction: no atomics, deterministic). ``DIGIT_BITS = 4``
(16 buckets, 8 passes: 128 bucket updates an entry) beats 8 (256 buckets, 4 passes: 1024). No host read: the rows
are flagged on the device, the thresholds and fallback flags written there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from safevocab.kernels import interpreter_on
from safevocab.kernels.candidate_thresholds import MASS_MARGIN
from safevocab.kernels.common import transform, transform_flags
from safevocab.rules import MinP, MinProb, SafeVocabRule, TopK, TopP, finite_floor

__all__ = ["radix_thresholds", "DIGIT_BITS", "RADIX_BLOCK"]

#: Whether these kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = interpreter_on()
#: Key bits decided per pass (``2^DIGIT_BITS`` buckets, ``32 / DIGIT_BITS`` passes); a divisor of 32.
DIGIT_BITS = 4
#: Columns per step of a pass (the one-hot is ``[RADIX_BLOCK, 2^DIGIT_BITS]`` float64 values in registers).
RADIX_BLOCK = 512
_KINDS = (TopK, TopP, MinP, MinProb)


@triton.jit
def _key(z):
    """fp32 -> unsigned ordered key in ``[0, 2^32)`` (int64); ``-0`` has the key of ``+0``."""
    bits = tl.where(z == 0.0, 0.0, z).to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits < 0, -1 - bits, bits + 2147483648)


@triton.jit
def _value(key):
    """Inverse of :func:`_key`."""
    bits = tl.where(key >= 2147483648, key - 2147483648, -1 - key)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _row_block(row_ptr, offs, n_cols, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE):
    """Columns ``offs`` of the row, transformed in fp32, and which of them exist."""
    mask = offs < n_cols
    z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE), mask


@triton.jit
def _radix_select(
    row_ptr,
    n_cols,
    scale,
    softcap,
    temperature,
    m,
    lower,
    k,
    q_hi,
    BY_MASS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    BLOCK: tl.constexpr,
    DIGIT: tl.constexpr,
    BINS: tl.constexpr,
):
    """``(v*, weight strictly above v*, kept weight W(lower), reached)`` (module docstring): the target is ``k``
    (count) or ``q_hi W(lower)`` (mass); ``reached``: every pass found its bucket (else ``v*`` is meaningless)."""
    bins = tl.arange(0, BINS)
    cols = tl.arange(0, BLOCK)
    lower_key = _key(lower)
    prefix = tl.zeros((), tl.int64)
    above = tl.zeros((), tl.float64)
    kept = tl.zeros((), tl.float64)
    target = tl.zeros((), tl.float64) + k
    reached = tl.full((), 1, tl.int1)
    for p in tl.static_range(32 // DIGIT):
        shift = 32 - (p + 1) * DIGIT  # a constexpr: the loop is unrolled
        hist = tl.zeros((BINS,), tl.float64)
        for start in range(0, n_cols, BLOCK):
            z, mask = _row_block(
                row_ptr, start + cols, n_cols, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE
            )
            key = _key(z)
            sel = mask & (key >= lower_key) & ((key >> (shift + DIGIT)) == prefix)
            if BY_MASS:
                w = tl.where(z == float("-inf"), 0.0, tl.exp(z - m)).to(tl.float64)
            else:
                w = tl.full((BLOCK,), 1.0, tl.float64)
            hit = sel[:, None] & (((key >> shift) & (BINS - 1))[:, None] == bins[None, :])
            hist += tl.sum(tl.where(hit, w[:, None], 0.0), axis=0)
        if p == 0:
            kept = tl.sum(hist, axis=0)
            if BY_MASS:
                target = q_hi * kept
        # from the top: the weight at or above each bucket (a 2^DIGIT x 2^DIGIT sum, no scan)
        suffix = above + tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0.0), axis=1)
        ge = suffix >= target
        found = tl.max(ge.to(tl.int32), axis=0) > 0
        # not found: the target is out of reach (pass 0), or a re-summed bucket fell short by rounding (mass); keep
        # to a non-empty bucket and report it
        b = tl.where(found, tl.max(tl.where(ge, bins, -1), axis=0), tl.min(tl.where(hist > 0, bins, BINS - 1), axis=0))
        reached = reached & found
        above += tl.sum(tl.where(bins > b, hist, 0.0), axis=0)
        prefix = prefix * BINS + b.to(tl.int64)
    return _value(prefix), above, kept, reached


@triton.jit
def _kept_scan(
    row_ptr,
    n_cols,
    scale,
    softcap,
    temperature,
    m,
    lower,
    value,
    width,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``(sum e over z >= lower (float64), #{z >= lower : |z - value| <= width})``."""
    cols = tl.arange(0, BLOCK)
    mass = tl.zeros((), tl.float64)
    near = tl.zeros((), tl.int32)
    for start in range(0, n_cols, BLOCK):
        z, mask = _row_block(
            row_ptr, start + cols, n_cols, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE
        )
        kept = mask & (z >= lower)
        e = tl.where(kept & (z != float("-inf")), tl.exp(z - m), 0.0)
        mass += tl.sum(e.to(tl.float64), axis=0)
        near += tl.sum((kept & (tl.abs(z - value) <= width)).to(tl.int32), axis=0)
    return mass, near


@triton.jit
def _radix_kernel(
    z_ptr,
    z_stride,
    active_ptr,  # [n] int8: nonzero for the rows to decide; the others exit at once
    n_cols,
    scale,
    softcap,
    temperature,
    top_k,
    q_lo: tl.float64,  # top_p -+ MASS_MARGIN, in float64 (a plain float argument would be fp32 on CUDA)
    q_hi: tl.float64,
    log_min_p,
    log_min_prob,
    margin,
    row_max_ptr,  # [n] fp32 in
    threshold_ptr,  # [n] fp32 out (the flagged rows)
    flag_ptr,  # [n] int8 out (the flagged rows): 1 where the row still needs the fallback
    K_STAGE: tl.constexpr,  # the stage of each kind (-1: absent)
    P_STAGE: tl.constexpr,
    MIN_P_STAGE: tl.constexpr,
    MIN_PROB_STAGE: tl.constexpr,
    N_STAGES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    DIGIT: tl.constexpr,
    BINS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(active_ptr + row) != 0:
        row_ptr = z_ptr + row * z_stride
        m = tl.load(row_max_ptr + row)
        neg_inf = float("-inf")
        t = tl.full((), neg_inf, tl.float32)
        bad = tl.full((), 0, tl.int1)
        for s in tl.static_range(N_STAGES):
            stage_t = tl.full((), neg_inf, tl.float32)
            if K_STAGE == s:
                v, _, _, reached = _radix_select(
                    row_ptr, n_cols, scale, softcap, temperature, m, t, top_k, 0.0,
                    False, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE, BLOCK, DIGIT, BINS,
                )  # fmt: skip
                stage_t = tl.maximum(stage_t, tl.where(reached, v, neg_inf))  # fewer than k kept: -inf
            if P_STAGE == s:
                v, above, kept, reached = _radix_select(
                    row_ptr, n_cols, scale, softcap, temperature, m, t, 0, q_hi,
                    True, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE, BLOCK, DIGIT, BINS,
                )  # fmt: skip
                # certified: the mass at or above v* reaches (q + margin) T_prev (reached) and the mass strictly
                # above it, if anything lies above (q - margin may be <= 0), stays below (q - margin) T_prev: every
                # target within the margin picks v*
                bad = bad | ~reached | ((above > 0) & (above >= q_lo * kept))
                stage_t = tl.maximum(stage_t, v)
            if MIN_P_STAGE == s:
                stage_t = tl.maximum(stage_t, m + tl.cast(log_min_p, tl.float32))
            if MIN_PROB_STAGE == s:
                kept, _ = _kept_scan(
                    row_ptr, n_cols, scale, softcap, temperature, m, t, 0.0, -1.0,
                    HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE, BLOCK,
                )  # fmt: skip
                value = (m + tl.log(kept.to(tl.float32))) + tl.cast(log_min_prob, tl.float32)
                # log kept is known to the margin (relative mass: absolute in logits), plus fp32 rounding
                width = tl.cast(margin, tl.float32) + tl.abs(value) * 9.5367431640625e-07  # 2^-20
                _, near = _kept_scan(
                    row_ptr, n_cols, scale, softcap, temperature, m, t, value, width,
                    HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE, BLOCK,
                )  # fmt: skip
                bad = bad | (near > 0)
                stage_t = tl.maximum(stage_t, value)
            t = tl.minimum(tl.maximum(t, stage_t), m)
        t = tl.minimum(tl.maximum(t, tl.full((), FLOOR, tl.float32)), m)
        tl.store(threshold_ptr + row, t)
        tl.store(flag_ptr + row, bad.to(tl.int8))


def radix_thresholds(
    z: torch.Tensor,
    stages: tuple[tuple[SafeVocabRule, ...], ...],
    active: torch.Tensor,
    row_max: torch.Tensor,
    threshold: torch.Tensor,
    flag: torch.Tensor,
    scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> None:
    """Decide the rows flagged in ``active`` on their whole row: write their ``threshold`` and ``flag``.

    Args:
        z: the raw chunk ``[n, V]`` (bf16/fp16/fp32, row-contiguous), transformed in the kernel.
        stages: the rule's stages in its engine's order (:meth:`~safevocab.kernels.candidate_thresholds.SelectionPlan.
            active`), each a tuple of ``TopK``/``TopP``/``MinP``/``MinProb`` parts, each kind at most once.
        active: ``[n]`` int8, nonzero for the rows to decide (finite ``row_max``; the others are left as they are).
        row_max: ``[n]`` fp32 row maxima of the transformed rows.
        threshold: ``[n]`` fp32, written for the active rows.
        flag: ``[n]`` int8, written for the active rows: 1 where a mass decision lies within ``MASS_MARGIN`` of a
            boundary (the row needs the rule's own code), else 0.
    """
    n, vocab = z.shape
    if z.stride(1) != 1:
        raise ValueError(f"z.stride()={tuple(z.stride())}: expected a row-contiguous chunk")
    at: dict[type, tuple[int, SafeVocabRule]] = {}
    for i, stage in enumerate(stages):
        for part in stage:
            if type(part) not in _KINDS or type(part) in at:
                raise ValueError(f"stages: {part} is not one of top_k/top_p/min_p/min_prob given once")
            at[type(part)] = (i, part)
    if n == 0 or not stages:
        return
    stage_of = {kind: at[kind][0] if kind in at else -1 for kind in _KINDS}
    q = at[TopP][1].q if TopP in at else 0.5
    _radix_kernel[(n,)](
        z,
        z.stride(0),
        active,
        vocab,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        float(temperature),
        int(at[TopK][1].k) if TopK in at else 0,
        q - MASS_MARGIN,
        q + MASS_MARGIN,
        math.log(at[MinP][1].rho) if MinP in at else 0.0,
        math.log(at[MinProb][1].tau) if MinProb in at else 0.0,
        MASS_MARGIN,
        row_max,
        threshold,
        flag,
        K_STAGE=stage_of[TopK],
        P_STAGE=stage_of[TopP],
        MIN_P_STAGE=stage_of[MinP],
        MIN_PROB_STAGE=stage_of[MinProb],
        N_STAGES=len(stages),
        **transform_flags(scale, softcap, temperature),
        FLOOR=finite_floor(torch.float32),
        BLOCK=max(16, min(triton.next_power_of_2(vocab), RADIX_BLOCK)),
        DIGIT=DIGIT_BITS,
        BINS=1 << DIGIT_BITS,
        num_warps=8,
    )
