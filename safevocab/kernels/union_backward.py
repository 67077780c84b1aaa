"""Union backward: the safe-set part of the input gradients as two GEMMs over ``U``, the union of a chunk's kept ids.

The forward stored, per row ``t`` of a sparse chunk, the entries of ``S_t`` as CSR (int32 column ``a``, ``s = z_{t,a}
- m_S``; :class:`safevocab.fused.row_stats.SparseChunk`). With ``U = union_t S_t`` (ascending ids, each once) the
safe-set part of the logits gradient of the chunk's ``R`` rows is a dense ``G_U [R, |U|]``, zero where ``a`` is not in
``S_t``, formed per entry by the formula of :func:`safevocab.kernels.sparse_backward._entry_grad` (the one definition;
the scatter kernel here calls it)::

    g_{t,a} = (g_lp 1[a = y] - pi_S (c_S + g_H (log pi_S + H))) (1 - tanh^2) logit_scale / T,
    log pi_S = s - log sum_S exp(z - m_S)

and then, with ``W_U = W[U]`` and ``h`` the chunk's rows of ``hidden``::

    dX[rows] += G_U W_U            ([R, |U|] x [|U|, H]: one GEMM)
    dW[U]    += G_U^T h            ([|U|, R] x [R, H]: one GEMM)
    db[U]    += G_U^T 1

``4 R |U| H`` FLOPs on tensor cores instead of ``nnz`` gathers of ``2 H`` values each in
:mod:`safevocab.kernels.sparse_backward` (no per-id serial loop over the rows sharing an id), against ``6 R V H`` for
the dense backward's recomputation and two gradient GEMMs. Every ``(t, u)`` of ``G_U`` is written at most once (a
row's kept ids are distinct), the GEMMs and sums have a fixed order: deterministic, no atomics.

Accumulation in fp32 (fp64 for fp64 inputs): every product is added into an fp32/fp64 buffer; the call's ``dW``/``db``
rows are collected over all chunks in one ``[|U_call|, H]`` buffer and each row of ``grad_weight``/``grad_bias`` in
``U_call`` is read once, added to in that precision and written once (it may be the weight's own dtype, as the per-id
kernels allow). ``G_U`` itself enters the GEMMs in the accumulator's dtype, or, for bf16/fp16 inputs on an accelerator
where no stored row's gradient leaves ``S`` (``half_operands``), rounded once to the inputs' dtype, as the dense
backward writes its logits gradient (tensor cores; the products still accumulate in fp32). Where a row also has a
full-softmax part, this part stays fp32 so that the two meet before anything is rounded (issue 57, T1).
``grad_shift`` (fp16 at tiny temperatures): ``g`` is formed divided by it and the products multiplied back (exact).

The unions are found without reading the device (:func:`kept_ranks`): per chunk a presence row over ``V`` and its
running count, ``rank[a] = #{u in U : u <= a}``, so ``a`` sits at column ``rank[a] - 1`` of ``G_U`` and the ``k``-th id
of ``U`` is the first ``a`` with ``rank[a] >= k`` (:func:`union_ids`, a ``searchsorted``). Only ``|U|`` (the last
column) has to be read, for ``G_U``'s shape: the caller reads every chunk's at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from safevocab.fused.grads import addmm_fp32
from safevocab.kernels import interpreter_on
from safevocab.kernels.sparse_backward import _row_entries_grad, row_contiguous

__all__ = ["BLOCK_ENTRIES", "UnionChunk", "kept_ranks", "union_backward", "union_ids"]

#: Whether these kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = interpreter_on()
#: Entries one program of the scatter kernel handles at a time.
BLOCK_ENTRIES = 64


@triton.jit
def _scatter_grad_kernel(
    first_row,  # the global row of the chunk's first row
    offsets_ptr,  # [R + 1] int64: each row's entries
    cols_ptr,
    shifted_ptr,
    rank_ptr,  # [V] the chunk's running count of distinct kept ids: column of id a in G_U = rank[a] - 1
    targets_ptr,
    log_sum_safe_ptr,
    c_safe_ptr,
    g_lp_ptr,
    g_ent_ptr,
    entropy_ptr,
    set_max_ptr,
    g_u_ptr,  # [R, |U|] zeros, written at each row's kept ids
    g_u_stride,
    tanh_of_z,
    grad_scale,
    HAS_ENTROPY_GRAD: tl.constexpr,
    SOFTCAP_GRAD: tl.constexpr,
    SCALE_GRAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = first_row + i
    start = tl.load(offsets_ptr + i)
    end = tl.load(offsets_ptr + i + 1)
    target = tl.load(targets_ptr + row)
    log_sum_safe = tl.load(log_sum_safe_ptr + row)
    c_safe = tl.load(c_safe_ptr + row)
    g_lp = tl.load(g_lp_ptr + row)
    g_ent = tl.load(g_ent_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    set_max = tl.load(set_max_ptr + row)
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
        u = tl.load(rank_ptr + a, mask=e_mask, other=1).to(tl.int64) - 1
        tl.store(g_u_ptr + i * g_u_stride + u, grad.to(g_u_ptr.dtype.element_ty), mask=e_mask)


def kept_ranks(chunk_cols: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """``[C + 1, V]`` int32: row ``c`` the running count of the distinct ids among ``chunk_cols[c]`` (each chunk's
    kept columns), the last row the same for their union over all chunks (the call's ``U``). ``rank[c, a] - 1`` is
    the column of a kept id ``a`` in chunk ``c``'s ``G_U``; ``rank[:, -1]`` the sizes ``|U|``. No read of the device."""
    device = chunk_cols[0].device
    present = torch.zeros(len(chunk_cols) + 1, vocab, device=device, dtype=torch.int32)
    for c, cols in enumerate(chunk_cols):
        present[c].index_fill_(0, cols.long(), 1)  # every duplicate writes the same 1: order-free
    present[-1] = present[:-1].amax(0)
    return present.cumsum_(1)


def union_ids(rank: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` ids of a union, ascending (``[size]`` int64): the ``k``-th is the first ``a`` with
    ``rank[a] >= k`` (``rank``: a row of :func:`kept_ranks`, ``size`` its last value). No read of the device."""
    wanted = torch.arange(1, size + 1, device=rank.device, dtype=rank.dtype)
    return torch.searchsorted(rank, wanted)


@dataclass(frozen=True)
class UnionChunk:
    """One stored chunk as :func:`union_backward` takes it: its first global row, its rows' ``|S|`` (``[R]`` int64),
    its entries (``cols`` int32, ``shifted`` stats dtype, row after row) and its union's size ``|U|`` (read by the
    caller)."""

    start: int
    counts: torch.Tensor
    cols: torch.Tensor
    shifted: torch.Tensor
    size: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.counts.numel())


def union_backward(
    chunks: list[UnionChunk],
    ranks: torch.Tensor,
    call_size: int,
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
    half_operands: bool = False,
) -> None:
    """Add the safe-set part of the gradients of the stored ``chunks`` to ``grad_hidden``/``grad_weight``/``grad_bias``
    by the two GEMMs over each chunk's union (module docstring).

    Args:
        chunks: the stored chunks (:class:`UnionChunk`, each with its ``|U|``), in the order of ``ranks``' rows.
        ranks: :func:`kept_ranks` of the chunks' ``cols``; ``call_size``: its last row's ``|U|``.
        targets, log_sum_safe, c_safe, g_lp, g_ent, entropy, set_max: ``[N]`` per-row values indexed by the global
            row (``Coefficients``; ``g_ent``/``entropy`` ``None`` without an entropy gradient).
        hidden, weight: ``[N, H]``, ``[V, H]``, any strides.
        grad_hidden, grad_weight, grad_bias: added to (``None``: not needed), any float dtype; each touched row is
            read and written once.
        temperature, softcap, logit_scale: the transform (its chain rule); ``grad_shift``: ``Coefficients.grad_shift``.
        half_operands: ``G_U`` enters the GEMMs in the inputs' dtype (bf16/fp16 inputs on an accelerator, no stored
            row with a full-softmax part); default ``False``: in the accumulator's dtype.
    """
    if not any(c.size for c in chunks):
        return
    hidden, weight = row_contiguous(hidden), row_contiguous(weight)
    acc = chunks[0].shifted.dtype  # fp32, or fp64 for fp64 inputs
    operand = hidden.dtype if half_operands and hidden.dtype in (torch.bfloat16, torch.float16) else acc
    has_ent = g_ent is not None
    grad_scale = logit_scale / temperature / grad_shift
    coefficients = (
        targets,
        log_sum_safe,
        c_safe,
        g_lp,
        g_ent if has_ent else c_safe,  # unused without HAS_ENTROPY_GRAD
        entropy if has_ent else c_safe,
        set_max,
    )
    flags = dict(HAS_ENTROPY_GRAD=has_ent, SOFTCAP_GRAD=softcap is not None, SCALE_GRAD=grad_scale != 1.0)
    tanh_of_z = float(temperature / softcap) if softcap is not None else 1.0
    need_w, need_b = grad_weight is not None, grad_bias is not None
    call_rank = ranks[-1]
    # the call's dW / db rows, in U_call's order: every chunk adds its G_U^T h here, each row of the gradients is
    # then read and written once
    n_h = hidden.shape[1]
    acc_w = torch.zeros(call_size, n_h, device=hidden.device, dtype=acc) if need_w else None
    acc_b = torch.zeros(call_size, device=hidden.device, dtype=acc) if need_b else None
    for c, chunk in enumerate(chunks):  # c: the chunk's row of ranks
        if not chunk.size:  # no entry (an empty chunk adds nothing)
            continue
        n = chunk.counts.numel()
        offsets = torch.zeros(n + 1, device=hidden.device, dtype=torch.int64)
        torch.cumsum(chunk.counts, 0, out=offsets[1:])
        g_u = torch.zeros(n, chunk.size, device=hidden.device, dtype=operand)
        _scatter_grad_kernel[(n,)](
            chunk.start,
            offsets,
            chunk.cols,
            chunk.shifted,
            ranks[c],
            *coefficients,
            g_u,
            g_u.stride(0),
            tanh_of_z,
            float(grad_scale),
            BLOCK_E=BLOCK_ENTRIES,
            **flags,
        )
        ids = union_ids(ranks[c], chunk.size)
        if grad_hidden is not None:  # dX[rows] += G_U W_U
            _add_rows(grad_hidden, chunk.rows, g_u, weight.index_select(0, ids), grad_shift)
        if need_w or need_b:
            at = call_rank.index_select(0, ids).long() - 1  # the chunk's ids in U_call
            if need_w:  # dW[U] += G_U^T h
                product = torch.zeros(chunk.size, n_h, device=hidden.device, dtype=acc)
                addmm_fp32(product, g_u.t(), hidden[chunk.rows], alpha=grad_shift)
                acc_w.index_add_(0, at, product)  # distinct rows: each added to once
            if need_b:
                acc_b.index_add_(0, at, g_u.sum(0, dtype=acc).mul_(grad_shift))
        del g_u
    if need_w or need_b:
        ids = union_ids(call_rank, call_size)
        if need_w:
            _add_into(grad_weight, ids, acc_w)
        if need_b:
            _add_into(grad_bias, ids, acc_b)


def _add_rows(out: torch.Tensor, rows: slice, g_u: torch.Tensor, w_u: torch.Tensor, shift: float) -> None:
    """``out[rows] += shift * g_u @ w_u``, the product accumulated in fp32/fp64 (``out``'s dtype where it is one,
    else a buffer of ``g_u``'s accumulator added to ``out`` once)."""
    if out.dtype in (torch.float32, torch.float64):
        addmm_fp32(out[rows], g_u, w_u, alpha=shift)
        return
    product = torch.zeros(g_u.shape[0], w_u.shape[1], device=out.device, dtype=torch.float32)
    addmm_fp32(product, g_u, w_u, alpha=shift)
    out[rows] = (out[rows].float() + product).to(out.dtype)


def _add_into(out: torch.Tensor, ids: torch.Tensor, acc: torch.Tensor) -> None:
    """``out[ids] += acc`` (``ids`` distinct): each row read, added to in ``acc``'s precision and written once."""
    if out.dtype == acc.dtype:
        out.index_add_(0, ids, acc)
    else:
        out.index_copy_(0, ids, (out.index_select(0, ids).to(acc.dtype) + acc).to(out.dtype))
