"""The candidate phase of :mod:`safevocab.kernels.threshold_select` as one Triton kernel: each row's threshold decided
over its compacted candidates in one program, with no host read.

:func:`safevocab.kernels.candidate_thresholds.decide_thresholds` states the decision in torch (its module docstring
has the maths) and stays the readable statement and the tests' reference; it costs dozens of small torch launches a
chunk (a sort of the ``[n, KCAP]`` buffer, float64 cumsums, the stage logic). :func:`decide_thresholds_kernel` computes
the same ``(threshold, fallback)`` in one launch, one program per row:

- load the first ``min(count, kcap)`` candidates (the rest ``-inf``) and sort them descending (``tl.sort``; under
  Triton's interpreter torch sorts them before the launch, see :func:`decide_thresholds_kernel`);
  ``e = exp(z - m)`` in fp32 (``0`` past the candidates), running masses in float64 (``tl.cumsum``);
- the stages in the engine's order (compile-time: which stage each kind is in), each seeing the kept candidates
  ``z >= t`` of the stages before: ``top_k`` the ``k``-th largest (ties kept; ``-inf`` when fewer are kept),
  ``top_p`` the first sorted entry whose running mass reaches ``q T_prev``, certified when the first entries reaching
  ``q T_prev -+ MASS_MARGIN T_prev`` have one value, ``min_p`` ``m + log rho``, ``min_prob``
  ``(m + log kept) + log tau`` in fp32, flagged when a candidate lies within the margin of it; a stage's value is
  *known* unless it may lie below the floor ``c``, the parts and stages are combined as ``_combine`` does (exact when
  every value is known or a known one reaches ``c``), each stage capped at ``m``; the rows whose threshold is not
  known, whose candidates overflowed ``kcap``, or whose ``m`` or ``T`` is not finite are flagged;
- ``threshold = min(max(t, finite floor), m)`` (NaN propagated as torch's ``maximum``/``minimum`` do).

**Which ``exp`` and ``log``.** Compiled (CUDA), the kernel calls libdevice's ``expf``/``logf``, the CUDA math
library's functions that torch's CUDA ``exp``/``log`` also run, so its fp32 ``e`` and ``log kept`` are expected to be
torch's bit for bit (to confirm on a device). Under Triton's interpreter (the CPU tests) there is no libdevice: the
kernel rounds float64 ``exp``/``log`` to fp32, which agree with torch's CPU functions (SLEEF's, within 1 ulp) on about
99 % of inputs, where numpy's fp32 ``exp`` agrees on about two thirds. Where they differ it cannot change a decision:
an ``e`` one ulp apart moves a running mass by under 1e-7 relative, against the margin's 1.9e-6, so a certified
``top_p`` picks the torch phase's entry (thresholds and flags differ only where a mass lies within that of a margin's
edge); ``min_prob``'s value comes from the kept mass itself and may differ by an ulp of its terms, but the kept
candidates are the same (none lies within the margin of a certified value). The float64 sums and scans add in
another order than torch's (1e-16 relative; ``min_prob`` rounds its sum to fp32). Triton links libdevice flushing
subnormals: compiled, an ``e`` below ``2^-126`` is 0 where torch's is subnormal, which changes no float64 mass, the
kept set's largest ``e`` (the row maximum's) being 1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from safevocab.kernels import interpreter_on
from safevocab.kernels.candidate_thresholds import MASS_MARGIN, sorted_candidates
from safevocab.rules import MinP, MinProb, SafeVocabRule, TopK, TopP, finite_floor

__all__ = ["decide_thresholds_kernel"]

#: Whether this kernel was defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = interpreter_on()
_KINDS = (TopK, TopP, MinP, MinProb)


@triton.jit
def _exp(x, LIBM: tl.constexpr):
    """fp32 ``exp`` as torch computes it: libdevice's ``expf`` compiled, float64 ``exp`` rounded under the interpreter
    (module docstring)."""
    if LIBM:
        return libdevice.exp(x)
    else:
        return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _log(x, LIBM: tl.constexpr):
    """fp32 ``log``, as :func:`_exp`."""
    if LIBM:
        return libdevice.log(x)
    else:
        return tl.log(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _first_value(vals, hit, cols, BLOCK: tl.constexpr):
    """The value at the first ``hit`` column (column 0 where there is none), as ``candidate_thresholds._first_value``."""
    first = tl.min(tl.where(hit, cols, BLOCK), axis=0)
    first = tl.where(first == BLOCK, 0, first)
    return tl.max(tl.where(cols == first, vals, float("-inf")), axis=0)


@triton.jit
def _any(x):
    return tl.max(x.to(tl.int32), axis=0) > 0


@triton.jit
def _fold(value, known_value, all_known, any_reaches, v, known, floor):
    """One value into ``_combine``'s accumulators: the maximum (NaN propagated, as ``amax``), the maximum of the known
    values, whether all are known, whether a known one reaches ``floor``."""
    value = tl.maximum(value, v, propagate_nan=tl.PropagateNan.ALL)
    known_value = tl.maximum(known_value, tl.where(known, v, float("-inf")), propagate_nan=tl.PropagateNan.ALL)
    return value, known_value, all_known & known, any_reaches | (known & (v >= floor))


@triton.jit
def _decide_kernel(
    cand_ptr,  # [n, >= kcap] fp32: the candidates, the first min(count, kcap) of each row
    cand_stride,
    count_ptr,  # [n] int32
    floor_ptr,  # [n] fp32: c
    m_ptr,  # [n] fp32: row maximum
    total_ptr,  # [n] fp64: T
    threshold_ptr,  # [n] fp32 out
    bad_ptr,  # [n] int8 out: 1 for the fallback
    kcap,
    top_k,
    top_p: tl.float64,  # q, in float64 as the torch phase multiplies it (a plain float argument is fp32 on CUDA)
    log_min_p,
    log_min_prob,
    margin: tl.float64,  # MASS_MARGIN
    K_STAGE: tl.constexpr,  # the stage of each kind (-1: absent)
    P_STAGE: tl.constexpr,
    MIN_P_STAGE: tl.constexpr,
    MIN_PROB_STAGE: tl.constexpr,
    N_STAGES: tl.constexpr,
    FLOOR: tl.constexpr,  # finite_floor(fp32)
    BLOCK: tl.constexpr,  # next power of two >= kcap
    LIBM: tl.constexpr,  # libdevice's exp/log (compiled), else float64 ones rounded (interpreter)
    SORT: tl.constexpr,  # sort the candidates here (else the caller sorted them: the interpreter's default)
):
    """One row's threshold and fallback flag (module docstring); one program per row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    count = tl.load(count_ptr + row)
    c = tl.load(floor_ptr + row)
    m = tl.load(m_ptr + row)
    total = tl.load(total_ptr + row)
    n_valid = tl.minimum(count, kcap)
    # the candidates, and after the sort the same prefix: padding is -inf, below (or tied with) every candidate
    valid = cols < n_valid
    vals = tl.load(cand_ptr + row * cand_stride + cols, mask=valid, other=neg_inf)
    if SORT:
        vals = tl.sort(vals, descending=True)
    e = tl.where(valid, _exp(vals - m, LIBM), 0.0)
    # abs(x) < inf: false for NaN too
    bad = (count > kcap) | ~(tl.abs(m) < float("inf")) | ~(tl.abs(total) < float("inf"))
    complete = c <= FLOOR  # every finite logit is a candidate
    mass_margin = tl.cast(margin, tl.float32)

    t = tl.full((), neg_inf, tl.float32)
    known = tl.full((), 1, tl.int1)
    for s in tl.static_range(N_STAGES):
        if s == 0:
            kept_e = e
            kept_count = n_valid
            kept_complete = complete
        else:
            kept = (vals >= t) & valid  # a -inf t keeps the candidates, not the padding
            kept_e = tl.where(kept, e, 0.0)
            kept_count = tl.sum(kept.to(tl.int32), axis=0)
            kept_complete = complete | (known & (t >= c))
        # _combine over the stage's parts, accumulated part by part
        value = tl.full((), neg_inf, tl.float32)
        known_value = tl.full((), neg_inf, tl.float32)
        all_known = tl.full((), 1, tl.int1)
        any_reaches = tl.full((), 0, tl.int1)
        if K_STAGE == s:
            kth = tl.max(tl.where(cols == top_k - 1, vals, neg_inf), axis=0)  # -inf past the candidates
            enough = kept_count >= top_k
            value, known_value, all_known, any_reaches = _fold(
                value, known_value, all_known, any_reaches, tl.where(enough, kth, neg_inf), enough | kept_complete, c
            )
        if P_STAGE == s:
            if s == 0:
                t_prev = total
            else:
                t_prev = tl.sum(kept_e.to(tl.float64), axis=0)
                bad = bad | ~kept_complete  # the kept mass needs the whole kept set
            target = top_p * t_prev
            running = tl.cumsum(kept_e.to(tl.float64), axis=0)
            reached = running >= target
            any_reached = _any(reached)
            # certified when the first entries reaching q T_prev -+ w have one value (ties keep the same set)
            w = margin * t_prev
            low = running >= target - w
            high = running >= target + w
            differ = _first_value(vals, low, cols, BLOCK) != _first_value(vals, high, cols, BLOCK)
            bad = bad | (_any(low) & (~_any(high) | differ))
            if s == 0:
                bad = bad | (~any_reached & kept_complete)  # not reached over a complete set: rounding
            else:
                bad = bad | ~any_reached
            t_p = tl.where(any_reached, _first_value(vals, reached, cols, BLOCK), neg_inf)
            value, known_value, all_known, any_reaches = _fold(
                value, known_value, all_known, any_reaches, t_p, any_reached, c
            )
        if MIN_P_STAGE == s:
            t_m = m + tl.cast(log_min_p, tl.float32)
            value, known_value, all_known, any_reaches = _fold(
                value, known_value, all_known, any_reaches, t_m, tl.full((), 1, tl.int1), c
            )
        if MIN_PROB_STAGE == s:
            if s == 0:
                kept_mass = total.to(tl.float32)
            else:
                kept_mass = tl.sum(kept_e.to(tl.float64), axis=0).to(tl.float32)
                bad = bad | ~kept_complete
            t_q = (m + _log(kept_mass, LIBM)) + tl.cast(log_min_prob, tl.float32)
            # log kept is known to MASS_MARGIN (absolute, in logits), plus fp32 rounding of the sum
            near_width = mass_margin + tl.abs(t_q) * 9.5367431640625e-07  # 2^-20
            bad = bad | _any((tl.abs(vals - t_q) <= near_width) & valid)
            value, known_value, all_known, any_reaches = _fold(
                value, known_value, all_known, any_reaches, t_q, tl.full((), 1, tl.int1), c
            )
        ok = all_known | any_reaches
        stage_t = tl.where(ok, known_value, value)
        if s == 0:
            t = stage_t
            known = ok
        else:
            value, known_value, all_known, any_reaches = _fold(
                tl.full((), neg_inf, tl.float32),
                tl.full((), neg_inf, tl.float32),
                tl.full((), 1, tl.int1),
                tl.full((), 0, tl.int1),
                t,
                known,
                c,
            )
            value, known_value, all_known, any_reaches = _fold(
                value, known_value, all_known, any_reaches, stage_t, ok, c
            )
            known = all_known | any_reaches
            t = tl.where(known, known_value, value)
        t = tl.minimum(t, m, propagate_nan=tl.PropagateNan.ALL)
    bad = bad | ~known
    t = tl.maximum(t, tl.full((), FLOOR, tl.float32), propagate_nan=tl.PropagateNan.ALL)
    tl.store(threshold_ptr + row, tl.minimum(t, m, propagate_nan=tl.PropagateNan.ALL))
    tl.store(bad_ptr + row, bad.to(tl.int8))


def decide_thresholds_kernel(
    stages: tuple[tuple[SafeVocabRule, ...], ...],
    cand: torch.Tensor,
    count: torch.Tensor,
    floor: torch.Tensor,
    m: torch.Tensor,
    total: torch.Tensor,
    kcap: int,
    sort_in_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate phase in one launch: ``(threshold [n] fp32, fallback [n] bool)``, as
    :func:`safevocab.kernels.candidate_thresholds.decide_thresholds` (module docstring for the ``exp``/``log``).

    ``sort_in_kernel``: sort each row's candidates in the kernel (``tl.sort``), or with torch before it (the same
    values in the same order: padding is ``-inf``, below every candidate). Default: in the kernel when compiled; with
    torch under Triton's interpreter, which runs ``tl.sort``'s bitonic network element by element in Python (~9x the
    time of the kernel tests that reach it); the slow tier checks the kernel's sort under the interpreter too.

    Args:
        stages: :meth:`~safevocab.kernels.candidate_thresholds.SelectionPlan.active`: tuples of ``TopK``/``TopP``/
            ``MinP``/``MinProb`` parts, each kind at most once.
        cand: ``[n, >= kcap]`` fp32 candidates ``z >= floor`` (the first ``min(count, kcap)`` of each row; no NaN),
            columns contiguous.
        count: ``[n]`` int32 number of candidates (``> kcap``: overflow, a fallback row).
        floor, m: ``[n]`` fp32 floor ``c`` and row maximum; total: ``[n]`` fp64 ``sum_V exp(z - m)``.
        kcap: candidates per row, ``>= 1``.
    """
    sort_in_kernel = not INTERPRETED if sort_in_kernel is None else sort_in_kernel
    at: dict[type, tuple[int, SafeVocabRule]] = {}
    for i, stage in enumerate(stages):
        if not stage:
            raise ValueError(f"stages: stage {i} is empty (SelectionPlan.active drops empty stages)")
        for part in stage:
            if type(part) not in _KINDS or type(part) in at:
                raise ValueError(f"stages: {part} is not one of top_k/top_p/min_p/min_prob given once")
            at[type(part)] = (i, part)
    if isinstance(kcap, bool) or not isinstance(kcap, int) or kcap < 1:
        raise ValueError(f"kcap={kcap!r}: expected an int >= 1")
    if cand.dim() != 2 or cand.dtype != torch.float32 or cand.shape[1] < kcap or cand.stride(1) != 1:
        raise ValueError(
            f"cand: expected [n, >= kcap={kcap}] fp32 with contiguous columns, got {tuple(cand.shape)} {cand.dtype} "
            f"strides {tuple(cand.stride())}"
        )
    n = cand.shape[0]
    for name, x, dtype in (
        ("count", count, torch.int32),
        ("floor", floor, torch.float32),
        ("m", m, torch.float32),
        ("total", total, torch.float64),
    ):
        if x.shape != (n,) or x.dtype != dtype:
            raise ValueError(f"{name}: expected [{n}] {dtype}, got {tuple(x.shape)} {x.dtype}")
    threshold = torch.empty(n, device=cand.device, dtype=torch.float32)
    bad = torch.empty(n, device=cand.device, dtype=torch.int8)
    if n and not sort_in_kernel:
        cand = sorted_candidates(cand, count, kcap)[0]
    if n:
        stage_of = {kind: at[kind][0] if kind in at else -1 for kind in _KINDS}
        block = max(16, triton.next_power_of_2(kcap))
        _decide_kernel[(n,)](
            cand,
            cand.stride(0),
            count.contiguous(),
            floor.contiguous(),
            m.contiguous(),
            total.contiguous(),
            threshold,
            bad,
            kcap,
            int(at[TopK][1].k) if TopK in at else 1,
            float(at[TopP][1].q) if TopP in at else 0.5,
            math.log(at[MinP][1].rho) if MinP in at else 0.0,
            math.log(at[MinProb][1].tau) if MinProb in at else 0.0,
            MASS_MARGIN,
            K_STAGE=stage_of[TopK],
            P_STAGE=stage_of[TopP],
            MIN_P_STAGE=stage_of[MinP],
            MIN_PROB_STAGE=stage_of[MinProb],
            N_STAGES=len(stages),
            FLOOR=finite_floor(torch.float32),
            BLOCK=block,
            LIBM=not INTERPRETED,
            SORT=sort_in_kernel,
            # 256 columns a warp: at 4096, 16 warps hold the sort and the float64 scan in 90 registers a thread
            # (8 warps: 204; 4: spills), ptxas for sm_90
            num_warps=max(4, min(16, block // 256)),
        )
    return threshold, bad.view(torch.bool)
