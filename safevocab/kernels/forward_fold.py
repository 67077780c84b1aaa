"""Forward fold: one ``[rows, V]`` logits chunk -> per-row fp32 statistics of the safe softmax.

One program per row. With ``m`` the row maximum and ``t`` the threshold (``S = {z >= t}``):

- ``NoPruning`` (``MODE_NONE``): one online pass, as trl's ``_forward_kernel``: the running maximum ``m``, with
  ``sum e^{z - m}`` and ``sum_S e^{z - m} (z - m)`` rescaled whenever ``m`` grows (its threshold, the finite
  floor, does not depend on ``m``, so nothing waits for it);
- ``MinP``/``MinProb`` (their threshold depends on ``m``): pass 1 finds ``m`` (for ``MinProb`` a second pass
  ``logsumexp`` over ``V``), then the last pass: ``e = exp(z - m)`` summed over ``V`` and over ``S``,
  ``sum_S e (z - m)`` for the entropy, ``|S|``;
- either way the last pass may also append ``S``'s entries ``(column, z)`` to a bounded pool
  (:class:`safevocab.kernels.kept_entries.KeptPool`, ``kept_capacity``): one atomic add on the pool's counter reserves
  a block's places, an int32 scan inside the block gives each entry's, a block that keeps nothing writes nothing. The
  sparse backward's entries then cost no second read of the chunk (:func:`~safevocab.kernels.kept_entries.pack_kept`
  puts them in CSR order), and they are the very ``z`` the pass compared with ``t``, so they count ``|S|`` exactly;
- the transformed logits may be written back over the chunk in the last pass (fp32/fp64 inputs, ``store_z``).

Every sum is a scalar, reduced once per column block (as trl's kernel does), not a ``[BLOCK]`` vector:
fewer registers per program, more programs resident, more of the re-read row still in L2.

Outputs per row, max-shifted as :class:`safevocab.fused.row_stats.RowStats` (no ``m + log sum`` is ever
formed, so huge logits lose no precision): ``threshold``, ``row_max = m``, ``log_sum_safe = log sum_S e``,
``log_sum_full = log sum_V e``, ``target_shift = z_y - m``, ``in_safe = z_y >= t``, ``safe_size = |S|``
and ``entropy(pi_S) = log sum_S e - sum_S e (z - m) / sum_S e`` (the torch path's formula).

Thresholds are floored at the most negative finite number of the statistics dtype, then capped at
``m`` (the argmax is always kept; ``-inf`` logits never are). With ``MODE_GIVEN`` the chunk already
holds transformed logits and ``threshold``/``row_max`` come from the rule's torch code (``TopK``,
``TopP``, compositions): a single pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from safevocab.kernels import MODE_GIVEN, MODE_MIN_P, MODE_MIN_PROB, MODE_NONE, interpreter_on
from safevocab.kernels.common import transform, transform_flags
from safevocab.kernels.kept_entries import KeptPool, append_kept
from safevocab.rules import finite_floor

#: Whether these kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = interpreter_on()
#: Largest block of columns one program holds at a time (tests lower it to exercise the column loop).
MAX_BLOCK = 4096

_GIVEN: tl.constexpr = tl.constexpr(MODE_GIVEN)
_NONE: tl.constexpr = tl.constexpr(MODE_NONE)
_MIN_P: tl.constexpr = tl.constexpr(MODE_MIN_P)
_MIN_PROB: tl.constexpr = tl.constexpr(MODE_MIN_PROB)


@triton.jit
def _forward_fold_kernel(
    z_ptr,
    z_stride,
    targets_ptr,
    threshold_ptr,  # read in MODE_GIVEN, written otherwise
    row_max_ptr,  # read in MODE_GIVEN, written otherwise
    target_shift_ptr,
    log_sum_safe_ptr,
    log_sum_full_ptr,
    entropy_ptr,
    in_safe_ptr,
    safe_size_ptr,
    kept_cols_ptr,  # KEEP: the KeptPool's tensors (unused otherwise)
    kept_values_ptr,
    kept_counter_ptr,
    kept_start_ptr,
    kept_count_ptr,
    kept_capacity,
    n_cols,
    log_param,  # log rho (MinP) or log tau (MinProb)
    scale,
    softcap,
    temperature,
    MODE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    STORE_Z: tl.constexpr,
    KEEP: tl.constexpr,  # append S's entries to the pool in the last pass
    FLOOR: tl.constexpr,  # the most negative finite number of the statistics dtype
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    acc = log_sum_safe_ptr.dtype.element_ty  # fp32, or fp64 for fp64 inputs
    row_ptr = z_ptr + row * z_stride
    cols = tl.arange(0, BLOCK)
    slots = row * tl.cdiv(n_cols, BLOCK)  # this row's first entry of the pool's [rows, blocks] table
    full = tl.zeros((), tl.int32)  # KEEP: whether this program has seen the pool overflow (it then stops reserving)
    # The target logit, read before any STORE_Z write (same transform as the row, so the same value)
    z_y = tl.load(row_ptr + tl.load(targets_ptr + row)).to(acc)
    z_y = transform(z_y, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)

    # Every accumulator is a scalar reduced each iteration (as trl's kernel): [BLOCK] vectors of them would cost
    # registers, hence resident programs, hence the L2 hits of the next pass over the row.
    if MODE == _NONE:
        # ONE online pass: t is the finite floor whatever m is, so S is every finite logit and nothing waits for m.
        # Running maximum m; s = sum e^{z-m} and u = sum_S e^{z-m} (z-m), rescaled when m grows.
        m = tl.full((), float("-inf"), acc)
        s_full = tl.zeros((), acc)
        u_safe = tl.zeros((), acc)
        n_kept = tl.zeros((), tl.int32)
        floor = tl.full((), FLOOR, acc)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(acc)
            z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
            if STORE_Z:
                tl.store(row_ptr + offs, z.to(z_ptr.dtype.element_ty), mask=mask)
            z = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # shift by 0 while every logit so far is -inf: exp(-inf - (-inf)) would be NaN
            shift = tl.where(m_new == float("-inf"), 0.0, m_new).to(acc)
            alpha = tl.exp(m - shift)  # 1 when the maximum stays, 0 before the first finite logit
            kept = z >= floor  # S = {z >= floor}: the finite logits (the cap at m only matters for an all -inf row)
            x = z - shift
            e = tl.exp(x)  # 0 at -inf (and past the row's end); NaN at a NaN logit, so that log_sum_full shows it
            if HAS_ENTROPY:
                # sum e^{z-m_old}(z-m_old) -> alpha (u + (m_old - m_new) s); m_old - m_new is 0 while m_old = -inf
                u_safe = alpha * (u_safe + (tl.where(m == float("-inf"), shift, m) - shift) * s_full)
                u_safe += tl.sum(e * tl.where(kept, x, 0.0), axis=0)  # no 0 * -inf outside S
            s_full = alpha * s_full + tl.sum(e, axis=0)
            n_kept += tl.sum(kept.to(tl.int32), axis=0)
            if KEEP:
                slot = slots + start // BLOCK
                full = append_kept(kept, offs, z, slot, full, kept_cols_ptr, kept_values_ptr, kept_counter_ptr,
                                   kept_start_ptr, kept_count_ptr, kept_capacity)  # fmt: skip
            m = m_new
        t = tl.minimum(floor, m)
        tl.store(threshold_ptr + row, t)
        tl.store(row_max_ptr + row, m)
        # an all -inf row (the caller raises on its m): S = V, as z >= t = -inf says
        n_kept = tl.where(m == float("-inf"), n_cols, n_kept)
        s_safe = s_full
    else:
        if MODE == _GIVEN:
            m = tl.load(row_max_ptr + row).to(acc)
            t = tl.load(threshold_ptr + row).to(acc)
        else:
            m = tl.full((), float("-inf"), acc)
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                mask = offs < n_cols
                z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(acc)
                z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
                m = tl.maximum(m, tl.max(tl.where(mask, z, float("-inf")), axis=0))
            if MODE == _MIN_P:
                t = m + tl.cast(log_param, acc)
            else:  # MODE_MIN_PROB: p_a >= tau  <=>  z_a >= lse + log tau, capped at the maximum
                s_lse = tl.zeros((), acc)
                for start in range(0, n_cols, BLOCK):
                    offs = start + cols
                    mask = offs < n_cols
                    z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(acc)
                    z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
                    s_lse += tl.sum(tl.where(mask, tl.exp(z - m), 0.0), axis=0)
                t = m + tl.log(s_lse) + tl.cast(log_param, acc)
            # floor first, then cap: a row below the floor still keeps its argmax
            t = tl.minimum(tl.maximum(t, tl.full((), FLOOR, acc)), m)
            tl.store(threshold_ptr + row, t)
            tl.store(row_max_ptr + row, m)

        s_full = tl.zeros((), acc)
        s_safe = tl.zeros((), acc)
        u_safe = tl.zeros((), acc)
        n_kept = tl.zeros((), tl.int32)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(acc)
            z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
            if STORE_Z:
                tl.store(row_ptr + offs, z.to(z_ptr.dtype.element_ty), mask=mask)
            kept = mask & (z >= t)
            e = tl.where(mask, tl.exp(z - m), 0.0)
            s_full += tl.sum(e, axis=0)
            e_safe = tl.where(kept, e, 0.0)
            s_safe += tl.sum(e_safe, axis=0)
            if HAS_ENTROPY:
                # xlogy(e, e) = e (z - m) on S; dropped entries (z may be -inf) contribute 0 * 0
                u_safe += tl.sum(e_safe * (tl.where(kept, z, m) - m), axis=0)
            n_kept += tl.sum(kept.to(tl.int32), axis=0)
            if KEEP:
                slot = slots + start // BLOCK
                full = append_kept(kept, offs, z, slot, full, kept_cols_ptr, kept_values_ptr, kept_counter_ptr,
                                   kept_start_ptr, kept_count_ptr, kept_capacity)  # fmt: skip

    log_s_safe = tl.log(s_safe)
    tl.store(log_sum_safe_ptr + row, log_s_safe)
    tl.store(log_sum_full_ptr + row, tl.log(s_full))
    tl.store(safe_size_ptr + row, n_kept)
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, log_s_safe - u_safe / s_safe)

    tl.store(target_shift_ptr + row, z_y - m)
    tl.store(in_safe_ptr + row, z_y >= t)


def _block(n_cols: int) -> int:
    return min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK)


def forward_fold(
    z: torch.Tensor,
    targets: torch.Tensor,
    threshold: torch.Tensor,
    row_max: torch.Tensor,
    target_shift: torch.Tensor,
    log_sum_safe: torch.Tensor,
    log_sum_full: torch.Tensor,
    entropy: torch.Tensor | None,
    in_safe: torch.Tensor,
    safe_size: torch.Tensor,
    mode: int,
    log_param: float = 0.0,
    scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    store_z: bool = False,
    kept_capacity: int | None = None,
) -> KeptPool | None:
    """Fold the chunk ``z`` ``[n, V]`` (row-contiguous) into the per-row outputs (each ``[n]``, written); with
    ``kept_capacity``, also return ``S``'s entries in a :class:`~safevocab.kernels.kept_entries.KeptPool` of that
    many entries (else ``None``).

    Args:
        z: GEMM output in the inputs' dtype (raw logits; transformed in the kernel), or, with
            ``mode == MODE_GIVEN``, transformed fp32/fp64 logits.
        targets: ``[n]`` int64 token ids.
        threshold, row_max: ``[n]`` stats dtype: read for ``MODE_GIVEN``, written otherwise.
        target_shift, log_sum_safe, log_sum_full, entropy, in_safe, safe_size: ``[n]`` outputs
            (``entropy`` may be ``None``).
        mode, log_param: from :func:`safevocab.kernels.kernel_threshold` (or ``MODE_GIVEN``).
        scale, softcap, temperature: the logit transform applied in the kernel (identity for ``MODE_GIVEN``).
        store_z: write the transformed logits back over ``z`` (``z`` must then be fp32/fp64).
        kept_capacity: the pool's size in entries: the last pass appends every kept ``(column, z)`` while they fit,
            and the pool's counter counts them all (more than ``kept_capacity``: an overflow, the rest unwritten).
    """
    n, n_cols = z.shape
    block = _block(n_cols)
    pool = None
    if kept_capacity is not None:
        pool = KeptPool.empty(n, n_cols, block, kept_capacity, log_sum_safe.dtype, z.device)
    if n == 0:
        return pool
    assert z.stride(1) == 1, "the chunk must be row-contiguous"
    # without a pool the kernel never touches these arguments (KEEP is off): any tensors will do
    spare = log_sum_full
    kept_args = (
        (pool.cols, pool.values, pool.counter, pool.block_start, pool.block_count, pool.capacity)
        if pool is not None
        else (spare, spare, spare, spare, spare, 0)
    )
    _forward_fold_kernel[(n,)](
        z,
        z.stride(0),
        targets,
        threshold,
        row_max,
        target_shift,
        log_sum_safe,
        log_sum_full,
        entropy if entropy is not None else log_sum_full,  # unused without HAS_ENTROPY
        in_safe,
        safe_size,
        *kept_args,
        n_cols,
        float(log_param),
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        float(temperature),
        MODE=mode,
        **transform_flags(scale, softcap, temperature),
        HAS_ENTROPY=entropy is not None,
        STORE_Z=store_z,
        KEEP=pool is not None,
        FLOOR=finite_floor(log_sum_safe.dtype),
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return pool
