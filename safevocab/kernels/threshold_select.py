"""Top-k / top-p thresholds (and their compositions) from the raw GEMM output: no sort of ``V``, no fp32 copy.

For ``TopK``, ``TopP`` and ``Intersection`` rules of the four elementary kinds, :func:`select_thresholds` computes
each row's ``threshold`` and ``row_max`` exactly as ``rule.threshold_and_max`` does on the fp32 logits the fold
kernels see (the raw ``[rows, V]`` chunk in the inputs' dtype, transformed in the kernel by
:func:`safevocab.kernels.common.transform`, so forward and backward rebuild ``S = {z >= t}`` bit for bit). One program
per row, ``BLOCK`` columns at a time:

**Pass A** (online): the maximum ``m``; ``T = sum_V e``, ``e = exp(z - m)`` in fp32, summed as
``safevocab.nucleus.row_sum64`` does (fp32 partial sums of 64 aligned columns, added in fp64; rescaled by
``exp(m_old - m_new)`` when the maximum grows); and a *slot-max sketch*: ``slot[j] = max z`` over the columns
``= j (mod BLOCK)``. From them a per-row **floor** ``c <= t`` (any value at most the final threshold is valid):

- ``top_k``: the ``k``-th largest slot (``-inf`` if ``k > BLOCK``). The slots' maxima are ``BLOCK`` distinct entries
  of the row, and the ``k``-th largest of a subset is at most the ``k``-th largest of the row;
- ``top_p`` (``q``, on the full distribution): with the slots sorted descending, the first ``s_i`` whose slot-mass
  prefix ``sum_{j <= i} e(s_j)`` reaches ``q T (1 + 1e-4)``. The slots ``>= s_i`` are distinct entries ``>= s_i``, so
  the mass ``M(s_i)`` of the row at or above ``s_i`` reaches ``q T``, hence ``s_i <= t_p = max {z : M(z) >= q T}``
  (the ``1e-4`` margin covers the rounding of ``T`` and of ``exp``). Also, and kept if higher,
  ``m + log(0.99 (1 - q) T / V)``: the tokens below it carry less than ``(1 - q) T`` in total, so the mass at or
  above it exceeds ``q T`` and ``t_p`` is not below it. Both order statistics of the slots are found by bisection on
  their ordered integer keys (33 counting steps over the ``BLOCK`` slots: no sort; the sketch is the row itself when
  ``V <= BLOCK``);
- ``min_p``: ``m + log rho`` (exact); ``min_prob`` (only after another stage): ``m + log tau``, because the kept
  mass is at least the argmax's ``e = 1``, so ``m + log(kept) + log tau`` is not below it;
- compositions (:func:`safevocab.engine_order.composition_stages`): the final ``t`` is the maximum of the stages'
  thresholds, and a stage's threshold on a renormalised distribution is never below its floor on the full one
  (``top_k``/``min_p`` keep the same set, ``top_p`` over a smaller total only rises). So the maximum of the
  floors is a floor, **but** a mass-dependent stage (``top_p``, ``min_prob``) after the first needs the whole kept set
  of the stages before it, to sum its mass. The floor is therefore the maximum over the stages up to, not including,
  the first mass-dependent stage after the first stage (all stages when there is none): e.g. ``c = c_k`` for HF's
  ``top_k -> top_p``, ``max(c_m, c_k)`` for vLLM's ``min_p -> top_k -> top_p``, ``max(c_k, c_p)`` for SGLang's joint
  stage. ``c`` is raised to the finite floor (``-inf`` logits are never kept); a row whose ``c`` was raised has every
  finite logit among its candidates (*complete*).

**Pass B** compacts the candidates ``z >= c`` into a ``[rows, KCAP]`` buffer (positions by ``tl.cumsum``; the count
goes on past ``KCAP`` to flag an overflow).

**Candidate phase** (one kernel, :mod:`safevocab.kernels.candidate_decide`, on ``[rows, <= KCAP]``; stated in torch by
:mod:`safevocab.kernels.candidate_thresholds`): the candidates are sorted and the stages applied in the engine's
order as the rules' torch code does: ``top_k`` keeps ties (``t_k`` = the ``k``-th largest, ``-inf`` when fewer
are kept), ``top_p`` takes the first sorted entry whose float64 running mass of the fp32 ``e`` reaches ``q T_prev``
(``T_prev``: ``T`` for a first stage, else the float64 sum over the kept candidates), ``min_p`` is ``m + log rho``,
``min_prob`` is ``(m + log kept) + log tau`` in fp32; each stage's threshold is capped at ``m``, the result floored
and capped as ``SafeVocabRule.threshold_of`` does. A stage whose threshold lies below ``c`` is not known exactly but
then does not decide ``t``; the row goes to the fallback only when it would (or a later stage needs its mass). So the
phase certifies its floor: a floor above ``t`` leaves a deciding stage unknown (too few candidates for ``top_k``,
``q T`` never reached for ``top_p``, a known threshold below ``c``) and sends the row to the fallback; a wrong floor
costs time, not exactness.

**Fallback.** A row whose candidates overflow ``KCAP`` first gets a bounded pivot refinement of its floor
(GPU_DESIGN.md §3.2, :data:`REFINE_PASSES` passes over the row, 4 pivots each): a pivot that one of the floor's parts
certifies (``top_k``: at least ``k`` logits at or above it; ``top_p``: their mass reaches ``q T (1 + 1e-4)``;
``min_p``/``min_prob``: not above their threshold) is still at most ``t``, by the same arguments as the floors, and
becomes the new floor; the candidates are then compacted again. Rows the candidates still leave undecided (an
overflow: ties wider than ``KCAP``, or a flat row whose kept set itself is wider, as ``top_p=0.9`` over a flat
``V = 151936``; a floor that did not certify) are decided on their whole row, in the kernel, by the exact radix select
of :mod:`safevocab.kernels.radix_select` (the stages in the engine's order; ``32 / DIGIT_BITS`` passes a
``top_k``/``top_p`` stage). The last resort, exact by definition: rows whose ``top_p`` or ``min_prob`` decision lies
within ``MASS_MARGIN`` of a boundary there too, or where ``(q + MASS_MARGIN) T_prev`` is out of reach by rounding,
and rows of a non-finite ``m`` or ``T``, are transformed in the kernel into fp32 (only those rows, in batches) and
given to the rule's own torch code.

**Host reads.** None with ``undecided=`` (the Triton forward's default): where a stage decides on masses (``top_p``,
``min_prob``), the fallback's rows are decided in one **bounded batch** a chunk, always ``ceil(n / BATCH_DIVISOR)``
rows (their indices from ``torch.nonzero_static``, padding to a scratch slot), by the rule's torch code with fixed
shapes (``top_p`` sorts those rows instead of its radix select, which reads the device to size its candidates);
rows past the batch, and rows whose sorted crossing lies within float64 summation-order rounding of its target, are
flagged for the caller, which folds the chunk again with the read below (:mod:`safevocab.kernels.rule_rows`).
Without it, one read per chunk: the fallback's rows, given to the rule's torch code before the fold reads the
thresholds. None for ``top_k``/``min_p`` compositions either way: the radix select decides every row with a finite
maximum exactly, and a row without one makes the op raise at its end. The refinement and the radix select run on the
rows flagged on the device (one program a row, the others exit at once) and the candidate phase works on the buffer's
whole width (``KCAP`` columns), so none of them reads the device.

The masses follow ``safevocab.nucleus``: ``T`` in fp32 partials added in fp64. The kernel's and the rule's ``T`` are
two roundings of one sum (~1e-8 relative apart): a row whose ``top_p`` or ``min_prob`` decision lies within
``safevocab.kernels.candidate_thresholds.MASS_MARGIN`` of a boundary goes to the fallback, so the sets stay the
rule's.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from safevocab.kernels import interpreter_on
from safevocab.kernels.candidate_decide import decide_thresholds_kernel
from safevocab.kernels.candidate_thresholds import MASS_DEPENDENT, SelectionPlan, selection_plan
from safevocab.kernels.common import transform, transform_flags
from safevocab.kernels.radix_select import radix_thresholds
from safevocab.kernels.rule_rows import decide_in_batch, decide_read, transformed_rows
from safevocab.rules import finite_floor

__all__ = [
    "SelectionPlan",
    "selection_plan",
    "select_thresholds",
    "transformed_rows",
    "KCAP",
    "REFINE_PASSES",
    "SKETCH_SLOTS",
]

#: Whether these kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = interpreter_on()
#: Candidates kept per row (more: the row takes the fallback).
KCAP = 4096
#: Pivot-refinement passes (4 pivots each) for a row whose candidates overflow ``KCAP``, before the radix select.
REFINE_PASSES = 6
#: Slots of the max sketch (= the column block; tests lower it to exercise ``k > slots`` and the column loop).
SKETCH_SLOTS = 2048
#: Relative margin on ``q T`` for the sketch's top-p floor (covers the rounding of ``T`` and ``exp``).
_SKETCH_MARGIN = 1e-4
#: Factor on ``(1 - q) T / V`` for the flat-row top-p floor (strict inequality with room for rounding).
_FLAT_FACTOR = 0.99


@triton.jit
def _ordered_key(x):
    """fp32 -> int64 keys in the same order (``-0`` just below ``+0``; ``-inf`` the smallest)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _select_kernel(
    z_ptr,
    z_stride,
    n_cols,
    scale,
    softcap,
    temperature,
    top_k,
    top_p,
    log_min_p,
    log_min_prob,
    row_max_ptr,  # [n] fp32 out
    total_ptr,  # [n] fp64 out: T = sum_V exp(z - m)
    floor_ptr,  # [n] fp32 out: c
    count_ptr,  # [n] int32 out: #{z >= c} (may exceed KCAP)
    cand_ptr,  # [n, KCAP] fp32 out: the candidates' z, in column order
    kcap,
    USE_K: tl.constexpr,
    USE_P: tl.constexpr,
    USE_MIN_P: tl.constexpr,
    USE_MIN_PROB: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,  # columns per fp32 partial sum of T (64, as nucleus.row_sum64)
    MARGIN: tl.constexpr,
    FLAT: tl.constexpr,
    GIVEN_C: tl.constexpr,  # recompaction: only the rows flagged in active_ptr, c is read from floor_ptr
    active_ptr,
):
    row = tl.program_id(0).to(tl.int64)
    live = tl.full((), 1, tl.int8)
    if GIVEN_C:
        live = tl.load(active_ptr + row).to(tl.int8)
    row_ptr = z_ptr + row * z_stride
    cols = tl.arange(0, BLOCK)
    neg_inf = float("-inf")

    # PASS A: online maximum and T, and the slot-max sketch (a recompaction knows them)
    slot = tl.full((BLOCK,), neg_inf, tl.float32)
    m = tl.full((), neg_inf, tl.float32)
    total = tl.zeros((), tl.float64)
    for start in range(0, 0 if GIVEN_C else n_cols, BLOCK):
        offs = start + cols
        mask = offs < n_cols
        z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
        z = tl.where(mask, z, neg_inf)
        slot = tl.maximum(slot, z)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        shift = tl.where(m_new == neg_inf, 0.0, m_new)  # an all -inf prefix: e = 0, no NaN
        e = tl.where(z == neg_inf, 0.0, tl.exp(z - shift))
        partial = tl.sum(tl.reshape(e, (BLOCK // GROUP, GROUP)), axis=1).to(tl.float64)
        rescale = tl.where(m == neg_inf, 0.0, tl.exp((m - shift).to(tl.float64)))
        total = total * rescale + tl.sum(partial, axis=0)
        m = m_new

    # FLOORS c <= t (module docstring)
    c = tl.full((), neg_inf, tl.float32)
    # the sketch's order statistics by bisection on the slots' ordered integer keys (no sort: 33 counting steps)
    keys = _ordered_key(slot)
    if USE_K:
        lo = tl.min(keys, axis=0)
        hi = tl.max(keys, axis=0)
        for _ in range(33):  # the largest key with >= k slots at or above it: the k-th largest slot
            mid = lo + (hi - lo + 1) // 2
            ok = tl.sum((keys >= mid).to(tl.int32), axis=0) >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        c_k = tl.max(tl.where(keys == lo, slot, neg_inf), axis=0)
        c = tl.maximum(c, tl.where(top_k <= BLOCK, c_k, neg_inf))
    if USE_P:
        e_s = tl.where(slot == neg_inf, 0.0, tl.exp(slot - m)).to(tl.float64)
        target = top_p * total * (1.0 + MARGIN)
        lo = tl.min(keys, axis=0)
        hi = tl.max(keys, axis=0)
        reachable = tl.sum(e_s, axis=0) >= target
        for _ in range(33):  # the largest slot whose slot mass at or above it reaches q T (1 + margin)
            mid = lo + (hi - lo + 1) // 2
            ok = tl.sum(tl.where(keys >= mid, e_s, 0.0), axis=0) >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        c_s = tl.max(tl.where(keys == lo, slot, neg_inf), axis=0)
        c = tl.maximum(c, tl.where(reachable, c_s, neg_inf))
        flat = (1.0 - top_p) * total * FLAT / n_cols
        c = tl.maximum(c, m + tl.log(flat.to(tl.float32)))
    if USE_MIN_P:
        c = tl.maximum(c, m + tl.cast(log_min_p, tl.float32))
    if USE_MIN_PROB:
        c = tl.maximum(c, m + tl.cast(log_min_prob, tl.float32))
    c = tl.maximum(c, tl.full((), FLOOR, tl.float32))  # -inf logits are never kept
    if GIVEN_C:
        c = tl.load(floor_ptr + row)
    else:
        tl.store(row_max_ptr + row, m)
        tl.store(total_ptr + row, total)
        tl.store(floor_ptr + row, c)

    # PASS B: compact the candidates z >= c (a recompaction: of the flagged rows only; the others exit here)
    base = tl.zeros((), tl.int32)
    out_ptr = cand_ptr + row * kcap
    for start in range(0, tl.where(live != 0, n_cols, 0), BLOCK):
        offs = start + cols
        mask = offs < n_cols
        z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
        cand = (mask & (z >= c)).to(tl.int32)
        n_cand = tl.sum(cand, axis=0)
        if n_cand > 0:
            pos = base + tl.cumsum(cand, axis=0) - 1
            tl.store(out_ptr + pos, z, mask=(cand > 0) & (pos < kcap))
            base += n_cand
    tl.store(count_ptr + row, base, mask=live != 0)


@triton.jit
def _from_key(key):
    """Inverse of :func:`_ordered_key`."""
    bits = key.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _refine_kernel(
    z_ptr,
    z_stride,
    active_ptr,  # [n]: nonzero for the rows to refine (overflowing, finite m and T); the others exit at once
    n_cols,
    scale,
    softcap,
    temperature,
    top_k,
    top_p,
    log_min_p,
    log_min_prob,
    row_max_ptr,
    total_ptr,
    floor_ptr,  # read and raised
    count_ptr,  # read and lowered: #{z >= c}
    kcap,
    max_passes,
    USE_K: tl.constexpr,
    USE_P: tl.constexpr,
    USE_MIN_P: tl.constexpr,
    USE_MIN_PROB: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    BLOCK: tl.constexpr,
    MARGIN: tl.constexpr,
):
    """Raise an overflowing row's floor by pivot refinement: each pass counts, and sums ``e`` above, 4 pivots
    spread over the bracket ``[lo, hi]`` of ordered keys; a pivot that some floor part certifies (``top_k``:
    ``>= k`` logits at or above it; ``top_p``: mass at or above it ``>= q T (1 + margin)``; ``min_p``/``min_prob``:
    not above ``m + log rho``/``m + log tau``) is still ``<= t`` and becomes ``lo``; one that none certifies bounds
    ``hi``. Stops when ``#{z >= lo} <= kcap`` or after ``max_passes``. One program per row of the chunk, the rows not
    flagged in ``active_ptr`` untouched."""
    row = tl.program_id(0).to(tl.int64)
    live = tl.load(active_ptr + row) != 0
    row_ptr = z_ptr + row * z_stride
    cols = tl.arange(0, BLOCK)
    piv_ids = tl.arange(0, 4)
    m = tl.load(row_max_ptr + row)
    target = top_p * tl.load(total_ptr + row) * (1.0 + MARGIN)
    c = tl.load(floor_ptr + row)
    lo = _ordered_key(c)
    hi = _ordered_key(m)
    count = tl.load(count_ptr + row)
    passes = tl.zeros((), tl.int32)
    while live & (passes < max_passes) & (count > kcap) & (lo < hi):
        step = (hi - lo) // 5
        keys = lo + tl.maximum(step, 1) * (piv_ids + 1).to(tl.int64)
        keys = tl.minimum(keys, hi)
        pivots = _from_key(keys)
        n_above = tl.zeros((4,), tl.int32)
        mass = tl.zeros((4,), tl.float64)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
            z = tl.where(mask, z, float("-inf"))
            above = z[:, None] >= pivots[None, :]
            n_above += tl.sum(above.to(tl.int32), axis=0)
            e = tl.where(z == float("-inf"), 0.0, tl.exp(z - m))
            mass += tl.sum(tl.where(above, e[:, None], 0.0), axis=0).to(tl.float64)
        ok = piv_ids < 0
        if USE_K:
            ok = ok | (n_above >= top_k)
        if USE_P:
            ok = ok | (mass >= target)
        if USE_MIN_P:
            ok = ok | (pivots <= m + tl.cast(log_min_p, tl.float32))
        if USE_MIN_PROB:
            ok = ok | (pivots <= m + tl.cast(log_min_prob, tl.float32))
        # certification is monotone: the certified pivots are a prefix
        best = tl.max(tl.where(ok, keys, lo), axis=0)
        count = tl.where(tl.max(ok.to(tl.int32), axis=0) > 0, tl.min(tl.where(ok, n_above, 2147483647), axis=0), count)
        hi = tl.minimum(hi, tl.min(tl.where(ok, hi, keys - 1), axis=0))
        lo = best
        passes += 1
    tl.store(floor_ptr + row, _from_key(lo), mask=live)
    tl.store(count_ptr + row, count, mask=live)


def select_thresholds(
    z: torch.Tensor,
    plan: SelectionPlan,
    threshold: torch.Tensor,
    row_max: torch.Tensor,
    scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    kcap: int | None = None,
    refine_passes: int | None = None,
    radix: bool = True,
    fallback: bool = True,
    undecided: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``plan.rule``'s per-row ``threshold`` and ``row_max`` (``[n]`` fp32) for the raw chunk ``z`` ``[n, V]``
    (bf16/fp16/fp32, row-contiguous; transformed in the kernel). Returns ``(fallback, candidates)``: the indices of
    the rows that took the fallback (the rule's torch code on those rows) and the ``[n]`` int32 candidate counts
    (``> kcap``: overflow).

    Args:
        kcap: candidates per row (default :data:`KCAP`, at most ``V``).
        refine_passes: pivot-refinement passes for the rows whose candidates overflow ``kcap`` (default
            :data:`REFINE_PASSES`; ``0``: none).
        radix: the rows the candidates leave undecided (overflow, a floor that did not certify) take the exact radix
            select of :mod:`safevocab.kernels.radix_select` before the torch fallback (``False``: straight to the
            fallback; tests and measurements).
        fallback: ``False``: the rows left to the rule's torch code are flagged, not decided (their thresholds stay
            the kernels' estimates), and the device is not read: returns their ``[n]`` bool flags instead of their
            indices (measurements only: ``scripts/gpu_plan.py``'s ``fallback`` section prices the chunk's one read
            against a batch that would not need it).
        undecided: ``[n]`` bool, written: decide the rows left to the rule's code in one bounded batch, with no read
            of the device (:func:`~safevocab.kernels.rule_rows.decide_in_batch`: the first
            ``ceil(n / BATCH_DIVISOR)`` of them), flag here the rows past it (left with the kernels' estimates: the
            caller decides them again, as the Triton forward does with the chunk,
            :mod:`safevocab.backends.triton.forward`), and return the rows' ``[n]`` bool flags instead of their
            indices. ``None`` (default): read the device for them (one read a chunk).
    """
    n, vocab = z.shape
    assert fallback or undecided is None, "undecided decides the fallback's rows: it needs fallback=True"
    flags_only = not fallback or undecided is not None  # the rows come back as [n] bool flags, not read as indices
    if undecided is not None:
        undecided.zero_()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool if flags_only else torch.long, device=z.device), torch.zeros(
            0, dtype=torch.int32, device=z.device
        )
    assert z.stride(1) == 1, "the chunk must be row-contiguous"
    assert z.dtype != torch.float64, "fp64 inputs keep the torch threshold path"
    kcap = min(KCAP if kcap is None else kcap, vocab)
    refine_passes = REFINE_PASSES if refine_passes is None else refine_passes
    stages = plan.active(vocab)
    floors = {p.key: p for p in plan.floor_parts(vocab)}
    device = z.device
    total = torch.empty(n, device=device, dtype=torch.float64)
    floor = torch.empty(n, device=device, dtype=torch.float32)
    count = torch.empty(n, device=device, dtype=torch.int32)
    cand = torch.empty(n, kcap, device=device, dtype=torch.float32)
    block = max(64, min(triton.next_power_of_2(vocab), SKETCH_SLOTS))
    common = dict(
        z_ptr=z,
        z_stride=z.stride(0),
        n_cols=vocab,
        scale=float(scale),
        softcap=float(softcap) if softcap is not None else 1.0,
        temperature=float(temperature),
        top_k=int(floors["top_k"].k) if "top_k" in floors else 0,
        top_p=float(floors["top_p"].q) if "top_p" in floors else 0.0,
        log_min_p=math.log(floors["min_p"].rho) if "min_p" in floors else 0.0,
        log_min_prob=math.log(floors["min_prob"].tau) if "min_prob" in floors else 0.0,
        row_max_ptr=row_max,
        total_ptr=total,
        floor_ptr=floor,
        count_ptr=count,
        kcap=kcap,
        **transform_flags(scale, softcap, temperature),
        BLOCK=block,
        MARGIN=_SKETCH_MARGIN,
        num_warps=8 if block >= 2048 else 4,
    )
    uses = dict(USE_K="top_k" in floors, USE_P="top_p" in floors)
    uses.update(USE_MIN_P="min_p" in floors, USE_MIN_PROB="min_prob" in floors)
    select = dict(cand_ptr=cand, FLOOR=finite_floor(torch.float32), GROUP=64, FLAT=_FLAT_FACTOR)
    _select_kernel[(n,)](**common, **select, **uses, GIVEN_C=False, active_ptr=count)
    if refine_passes > 0:
        # FALLBACK, first step: pivot refinement of the floor (GPU_DESIGN.md 3.2), then the candidates again, of the
        # overflowing rows, flagged on the device (one program a row; the others exit at once: no read of the device)
        overflow = ((count > kcap) & torch.isfinite(row_max) & torch.isfinite(total)).to(torch.int8)
        _refine_kernel[(n,)](**common, **uses, active_ptr=overflow, max_passes=refine_passes)
        off = dict.fromkeys(uses, False)
        _select_kernel[(n,)](**common, **select, **off, GIVEN_C=True, active_ptr=overflow)
    t, bad = decide_thresholds_kernel(stages, cand, count, floor, row_max, total, kcap)
    threshold.copy_(t)
    if radix:
        # FALLBACK, second step: the undecided rows with a finite maximum and T, on their whole row (flagged on the
        # device: no read); only a mass decision within MASS_MARGIN of a boundary still goes to the rule's code
        radix_rows = (bad & torch.isfinite(row_max) & torch.isfinite(total)).to(torch.int8)
        flag = bad.to(torch.int8)
        radix_thresholds(z, stages, radix_rows, row_max, threshold, flag, scale, softcap, temperature)
        bad = flag != 0
        if not any(part.key in MASS_DEPENDENT for stage in stages for part in stage):
            # count and min_p stages only (no mass decision, known to MASS_MARGIN, among the stages): the radix select
            # decides every row with a finite maximum and T exactly
            # (no margin), and a row without one (no finite logit, a NaN) makes the op raise at its end-of-call check
            # (safevocab.fused.checks): nothing for the rule's code to do, so no read of the device
            none = torch.zeros(n if flags_only else 0, dtype=torch.bool if flags_only else torch.long, device=z.device)
            return none, count
    if not fallback:
        return bad, count
    kw = dict(scale=scale, softcap=softcap, temperature=temperature)
    if undecided is not None:
        decide_in_batch(z, plan.rule, bad, threshold, row_max, undecided, **kw)
        return bad, count
    return decide_read(z, plan.rule, bad, threshold, row_max, **kw), count
