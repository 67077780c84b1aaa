"""Sparse backward: the safe-set part of the input gradients from the stored entries of ``S``, no ``[rows, V]``.

The forward stored, per row ``t`` of a sparse chunk, the entries of ``S_t`` as CSR (int32 column ``a``, fp32
``s = z_{t,a} - m_S``; :class:`safevocab.fused.row_stats.SparseChunk`). Off ``S`` the safe-set part of the logits
gradient is exactly 0, and on ``S`` it is formed on the fly from ``s`` and the row's coefficients
(:class:`safevocab.fused.coefficients.Coefficients`), exactly the formula of :mod:`safevocab.kernels.backward_fold`::

    log pi_S = s - log sum_S exp(z - m_S)
    g_{t,a}  = g_lp 1[a = y] - pi_S (c_S + g_H (log pi_S + H))

times the transform's chain rule: the softcap derivative ``1 - tanh^2`` (``tanh = (s + m_S) T / c``, ``tanh^2``
clamped to 1) and ``logit_scale / T``. Then, in fp32 (fp64 for fp64 inputs)::

    dX[t] += sum_{a in S_t}       g_{t,a} W[a, :]     one program per (row, block of H)
    dW[a] += sum_{t : a in S_t}   g_{t,a} h[t, :]     entries sorted by a (stable: (a, t)), one program per
    db[a] += sum_{t : a in S_t}   g_{t,a}             (distinct a, block of H)

Every output row is read once, added to in the accumulator's precision and written once: a fixed summation order
(deterministic), no atomics, and no fp32 ``[V, H]`` buffer needed (the gradient may be the weight's own dtype): rows
of ``dW`` outside the union of the ``S`` are not touched. ``grad_shift`` (a power of two, fp16 inputs at tiny
temperatures, :func:`safevocab.fused.coefficients.fp16_grad_shift`): ``g`` is formed divided by it and the sums
multiplied back, exactly as the dense path scales its GEMM products.

These are the per-id kernels, one of the stored sets' three backwards: beside them the two GEMMs over each chunk's
union of kept ids (:mod:`safevocab.kernels.union_backward`, which forms ``g`` with :func:`_entry_grad` too) and the
dense recomputation; :mod:`safevocab.backends.triton.sparse_gate` chooses once per call. Given the call's distinct ids
(``kept_ids``, found by the caller without reading the device) the grouping by id reads nothing either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from safevocab.kernels import interpreter_on

#: Whether these kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = interpreter_on()
#: Entries one program loads at a time (rows of ``W`` or ``h`` gathered together).
BLOCK_ENTRIES = 32
#: Columns of ``H`` per program (tests lower it to exercise several blocks).
MAX_BLOCK_H = 256


@triton.jit
def _entry_grad(
    shifted,
    is_target,
    log_sum_safe,
    c_safe,
    g_lp,
    g_ent,
    entropy,
    set_max,
    tanh_of_z,
    grad_scale,
    HAS_ENTROPY_GRAD: tl.constexpr,
    SOFTCAP_GRAD: tl.constexpr,
    SCALE_GRAD: tl.constexpr,
):
    """The logits gradient at kept entries (``shifted = z - m_S``), as ``backward_fold`` forms it on ``S``."""
    log_p = shifted - log_sum_safe
    if HAS_ENTROPY_GRAD:
        grad = -(tl.exp(log_p) * ((log_p + entropy) * g_ent + c_safe))
    else:
        grad = tl.exp(log_p) * (-c_safe)
    grad = grad + tl.where(is_target, g_lp, 0.0)
    if SOFTCAP_GRAD:
        tanh_z = (shifted + set_max) * tl.cast(tanh_of_z, shifted.dtype)
        grad = grad * (1.0 - tl.minimum(tanh_z * tanh_z, 1.0))
    if SCALE_GRAD:
        grad = grad * tl.cast(grad_scale, shifted.dtype)
    return grad


@triton.jit
def _row_entries_grad(
    cols_ptr,
    shifted_ptr,
    e,
    e_mask,
    target,
    log_sum_safe,
    c_safe,
    g_lp,
    g_ent,
    entropy,
    set_max,
    tanh_of_z,
    grad_scale,
    HAS_ENTROPY_GRAD: tl.constexpr,
    SOFTCAP_GRAD: tl.constexpr,
    SCALE_GRAD: tl.constexpr,
):
    """A block ``e`` of one row's stored entries: their columns (int64) and logits gradients (:func:`_entry_grad`)."""
    a = tl.load(cols_ptr + e, mask=e_mask, other=0).to(tl.int64)
    shifted = tl.load(shifted_ptr + e, mask=e_mask, other=0.0)
    grad = _entry_grad(
        shifted,
        a == target,
        log_sum_safe,
        c_safe,
        g_lp,
        g_ent,
        entropy,
        set_max,
        tanh_of_z,
        grad_scale,
        HAS_ENTROPY_GRAD,
        SOFTCAP_GRAD,
        SCALE_GRAD,
    )
    return a, grad


@triton.jit
def _grad_hidden_kernel(
    rows_ptr,  # [R] int64: the global row of each stored row
    offsets_ptr,  # [R + 1] int64: its entries
    cols_ptr,
    shifted_ptr,
    targets_ptr,
    log_sum_safe_ptr,
    c_safe_ptr,
    g_lp_ptr,
    g_ent_ptr,
    entropy_ptr,
    set_max_ptr,
    weight_ptr,
    weight_stride,
    out_ptr,
    out_stride,
    n_h,
    tanh_of_z,
    grad_scale,
    out_scale,
    HAS_ENTROPY_GRAD: tl.constexpr,
    SOFTCAP_GRAD: tl.constexpr,
    SCALE_GRAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0)
    acc_t = shifted_ptr.dtype.element_ty  # fp32, or fp64 for fp64 inputs
    row = tl.load(rows_ptr + i)
    start = tl.load(offsets_ptr + i)
    end = tl.load(offsets_ptr + i + 1)
    h_offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h_offs < n_h
    target = tl.load(targets_ptr + row)
    log_sum_safe = tl.load(log_sum_safe_ptr + row)
    c_safe = tl.load(c_safe_ptr + row)
    g_lp = tl.load(g_lp_ptr + row)
    g_ent = tl.load(g_ent_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    set_max = tl.load(set_max_ptr + row)
    acc = tl.zeros((BLOCK_H,), acc_t)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_mask = e < end
        a, grad = _row_entries_grad(
            cols_ptr,
            shifted_ptr,
            e,
            e_mask,
            target,
            log_sum_safe,
            c_safe,
            g_lp,
            g_ent,
            entropy,
            set_max,
            tanh_of_z,
            grad_scale,
            HAS_ENTROPY_GRAD,
            SOFTCAP_GRAD,
            SCALE_GRAD,
        )
        grad = tl.where(e_mask, grad, 0.0)
        w = tl.load(
            weight_ptr + a[:, None] * weight_stride + h_offs[None, :],
            mask=e_mask[:, None] & h_mask[None, :],
            other=0.0,
        ).to(acc_t)
        acc += tl.sum(grad[:, None] * w, axis=0)
    at = out_ptr + row * out_stride + h_offs
    old = tl.load(at, mask=h_mask, other=0.0).to(acc_t)
    tl.store(at, (old + acc * tl.cast(out_scale, acc_t)).to(out_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def _grad_weight_kernel(
    group_cols_ptr,  # [U] int64: the distinct kept columns
    group_offsets_ptr,  # [U + 1] int64: their entries in the sorted order
    entry_rows_ptr,  # [nnz] int64: the global row of each sorted entry
    shifted_ptr,  # [nnz] sorted
    targets_ptr,
    log_sum_safe_ptr,
    c_safe_ptr,
    g_lp_ptr,
    g_ent_ptr,
    entropy_ptr,
    set_max_ptr,
    hidden_ptr,
    hidden_stride,
    gw_ptr,
    gw_stride,
    gb_ptr,
    n_h,
    tanh_of_z,
    grad_scale,
    out_scale,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    SOFTCAP_GRAD: tl.constexpr,
    SCALE_GRAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    k = tl.program_id(0)
    acc_t = shifted_ptr.dtype.element_ty
    a = tl.load(group_cols_ptr + k)
    start = tl.load(group_offsets_ptr + k)
    end = tl.load(group_offsets_ptr + k + 1)
    h_offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h_offs < n_h
    acc = tl.zeros((BLOCK_H,), acc_t)
    acc_b = tl.zeros((BLOCK_E,), acc_t)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_mask = e < end
        row = tl.load(entry_rows_ptr + e, mask=e_mask, other=0)
        shifted = tl.load(shifted_ptr + e, mask=e_mask, other=0.0)
        grad = _entry_grad(
            shifted,
            tl.load(targets_ptr + row, mask=e_mask, other=-1) == a,
            tl.load(log_sum_safe_ptr + row, mask=e_mask, other=0.0),
            tl.load(c_safe_ptr + row, mask=e_mask, other=0.0),
            tl.load(g_lp_ptr + row, mask=e_mask, other=0.0),
            tl.load(g_ent_ptr + row, mask=e_mask, other=0.0),
            tl.load(entropy_ptr + row, mask=e_mask, other=0.0),
            tl.load(set_max_ptr + row, mask=e_mask, other=0.0),
            tanh_of_z,
            grad_scale,
            HAS_ENTROPY_GRAD,
            SOFTCAP_GRAD,
            SCALE_GRAD,
        )
        grad = tl.where(e_mask, grad, 0.0)
        if HAS_WEIGHT:
            h = tl.load(
                hidden_ptr + row[:, None] * hidden_stride + h_offs[None, :],
                mask=e_mask[:, None] & h_mask[None, :],
                other=0.0,
            ).to(acc_t)
            acc += tl.sum(grad[:, None] * h, axis=0)
        if HAS_BIAS:
            acc_b += grad
    scale = tl.cast(out_scale, acc_t)
    if HAS_WEIGHT:
        at = gw_ptr + a * gw_stride + h_offs
        old = tl.load(at, mask=h_mask, other=0.0).to(acc_t)
        tl.store(at, (old + acc * scale).to(gw_ptr.dtype.element_ty), mask=h_mask)
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            old_b = tl.load(gb_ptr + a).to(acc_t)
            tl.store(gb_ptr + a, (old_b + tl.sum(acc_b, axis=0) * scale).to(gb_ptr.dtype.element_ty))


def row_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where each row's elements are adjacent, as the kernels index them (``row * stride(0) + column``),
    else a contiguous copy. A single column counts whatever its stride: torch calls a ``[V, 1]`` view with strides
    ``(1, V)`` contiguous, and it is, row by row."""
    return t if t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous()


def sparse_backward(
    rows: torch.Tensor,
    counts: torch.Tensor,
    cols: torch.Tensor,
    shifted: torch.Tensor,
    targets: torch.Tensor,
    log_sum_safe: torch.Tensor,
    c_safe: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    entropy: torch.Tensor | None,
    set_max: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    grad_bias: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    logit_scale: float,
    grad_shift: float = 1.0,
    kept_ids: torch.Tensor | None = None,
) -> None:
    """Add the safe-set part of the gradients of the stored rows ``rows`` to ``grad_hidden``/``grad_weight``/``grad_bias``.

    Args:
        rows: ``[R]`` int64, the global rows whose ``S`` is stored (ascending); ``counts``: ``[R]`` their ``|S|``.
        cols, shifted: ``[nnz]`` the entries row after row: int32 column, ``z - m_S`` (stats dtype).
        targets, log_sum_safe, c_safe, g_lp, g_ent, entropy, set_max: ``[N]`` per-row values indexed by the global
            row (``Coefficients``; ``g_ent``/``entropy`` ``None`` without an entropy gradient).
        hidden, weight: ``[N, H]``, ``[V, H]``, any strides (a view whose rows are not contiguous is copied).
        grad_hidden, grad_weight, grad_bias: added to (``None``: not needed), any float dtype; each touched row is
            read and written once.
        temperature, softcap, logit_scale: the transform (its chain rule).
        grad_shift: ``Coefficients.grad_shift``.
        kept_ids: the distinct ids of ``cols``, ascending (``[U]`` int64), when the caller has them
            (:func:`safevocab.kernels.union_backward.union_ids`): no read of the device here; default ``None``: found
            here (one read, for their count).
    """
    if rows.numel() == 0 or cols.numel() == 0:
        return
    hidden, weight = row_contiguous(hidden), row_contiguous(weight)
    n_h = hidden.shape[1]
    block_h = min(triton.next_power_of_2(n_h), MAX_BLOCK_H)
    has_ent = g_ent is not None
    grad_scale = logit_scale / temperature / grad_shift
    shared = dict(
        HAS_ENTROPY_GRAD=has_ent,
        SOFTCAP_GRAD=softcap is not None,
        SCALE_GRAD=grad_scale != 1.0,
        BLOCK_E=BLOCK_ENTRIES,
        BLOCK_H=block_h,
    )
    coefficients = (
        targets,
        log_sum_safe,
        c_safe,
        g_lp,
        g_ent if has_ent else c_safe,  # unused without HAS_ENTROPY_GRAD
        entropy if has_ent else c_safe,
        set_max,
    )
    scalars = (
        float(temperature / softcap) if softcap is not None else 1.0,
        float(grad_scale),
        float(grad_shift),
    )
    h_blocks = triton.cdiv(n_h, block_h)
    if grad_hidden is not None:
        assert grad_hidden.stride(1) == 1
        offsets = torch.zeros(rows.numel() + 1, device=rows.device, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        _grad_hidden_kernel[(rows.numel(), h_blocks)](
            rows,
            offsets,
            cols,
            shifted,
            *coefficients,
            weight,
            weight.stride(0),
            grad_hidden,
            grad_hidden.stride(0),
            n_h,
            *scalars,
            **shared,
        )
    if grad_weight is None and grad_bias is None:
        return
    # dW: the entries grouped by vocabulary id (a stable sort keeps each group's rows ascending)
    order = torch.sort(cols, stable=True).indices
    sorted_cols = cols.index_select(0, order)
    if kept_ids is None:
        group_cols, group_sizes = torch.unique_consecutive(sorted_cols, return_counts=True)
        group_offsets = torch.zeros(group_cols.numel() + 1, device=cols.device, dtype=torch.int64)
        torch.cumsum(group_sizes, 0, out=group_offsets[1:])
    else:  # each id's first entry in the sorted order, then the end
        group_cols = kept_ids
        group_offsets = torch.full((group_cols.numel() + 1,), cols.numel(), device=cols.device, dtype=torch.int64)
        group_offsets[:-1] = torch.searchsorted(sorted_cols, group_cols.to(sorted_cols.dtype))
    # output_size: the entries' count is known here, so no read of the device for it
    entry_rows = torch.repeat_interleave(rows, counts, output_size=cols.numel()).index_select(0, order)
    if grad_weight is not None:
        assert grad_weight.stride(1) == 1
    _grad_weight_kernel[(group_cols.numel(), h_blocks if grad_weight is not None else 1)](
        group_cols.to(torch.int64),
        group_offsets,
        entry_rows,
        shifted.index_select(0, order),
        *coefficients,
        hidden,
        hidden.stride(0),
        grad_weight if grad_weight is not None else shifted,  # unused without HAS_WEIGHT
        grad_weight.stride(0) if grad_weight is not None else 0,
        grad_bias if grad_bias is not None else shifted,  # unused without HAS_BIAS
        n_h,
        *scalars,
        HAS_WEIGHT=grad_weight is not None,
        HAS_BIAS=grad_bias is not None,
        **shared,
    )
