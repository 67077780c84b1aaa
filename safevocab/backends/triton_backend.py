"""Triton backend of :class:`safevocab.fused_op.FusedSafeLogProbs`: per-chunk GEMM in torch, fold in Triton.

:class:`TritonBackend` implements :class:`safevocab.backends.protocol.FusedBackend`: :func:`triton_forward` and
:func:`triton_dense_backward` replace the torch backend's passes (:mod:`safevocab.backends.torch_backend`) with the
kernels of :mod:`safevocab.kernels` (one op a file); the autograd bookkeeping stays in :mod:`safevocab.fused_op`,
which calls :meth:`TritonBackend.sparse_backward` (:func:`triton_sparse_backward`) for the chunks whose ``S`` the
forward stored (every input dtype) and :func:`triton_replay_forward` for replayed supports. The backward (dense chunks and the full-softmax part of sparse ones,
:func:`triton_full_softmax_backward`) recomputes each chunk on the forward's row slice with the same calls, so
``S = {z >= t}`` is rebuilt, and ``pi`` normalised, from bit-identical logits.

Three ways to get a chunk's threshold, fixed per rule (:func:`safevocab.kernels.kernel_threshold`) so
that forward and backward rebuild ``S = {z >= t}`` from bit-identical logits:

- **in-kernel** (``NoPruning``, ``MinP``, ``MinProb``): the GEMM output (inputs' dtype) goes straight to
  the kernels, which apply the logit transform and compute the threshold themselves;
- **selection kernel** (``TopK``, ``TopP``, compositions; bf16/fp16/fp32 inputs): the raw GEMM output goes to
  :func:`safevocab.kernels.threshold_select.select_thresholds` (thresholds computed from it with the kernels'
  transform), then to the fold kernels as for in-kernel thresholds;
- **torch threshold** (other rules, and fp64 inputs): the chunk is transformed in torch into an fp32
  copy (``ChunkLogits``, as the torch backend does), the rule's ``threshold_and_max`` runs in torch,
  and the kernels fold the rest. Logged once per call at DEBUG level.

The logits gradient is written over the GEMM output, in the inputs' dtype, and the gradient GEMMs
accumulate the weight gradient in fp32 (for bf16/fp16 inputs the per-logit gradient is rounded to the
inputs' dtype first, as trl's Triton path does; the torch backend keeps it in fp32 for that GEMM).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from safevocab.chunking import (
    ChunkLogits,
    Coefficients,
    RowStats,
    SparseChunk,
    Transform,
    accumulate_chunk_grads,
    balanced_chunk_rows,
    chunk_slices,
    forward_chunks_of,
)
from safevocab.kernels import MODE_GIVEN, kernel_threshold
from safevocab.kernels.backward_fold import backward_fold
from safevocab.kernels.forward_fold import forward_fold
from safevocab.kernels.kept_entries import compact_kept, gather_logits
from safevocab.kernels.sparse_backward import sparse_backward as kernel_sparse_backward
from safevocab.kernels.threshold_select import KCAP, SelectionPlan, select_thresholds, selection_plan
from safevocab.rules import SafeVocabRule
from safevocab.support import SafeSupport

__all__ = ["TritonBackend", "triton_chunk_rows", "triton_forward", "triton_dense_backward", "triton_replay_forward"]
__all__ += ["triton_sparse_backward"]

logger = logging.getLogger("safevocab")

#: Whether ``TopK``/``TopP``/compositions get their thresholds from :mod:`safevocab.kernels.threshold_select`
#: (``False``: the torch threshold on an fp32 copy, as before; for A/B comparisons and tests).
_KERNEL_SELECTION = True


def _kernel_selection(rule: SafeVocabRule, in_bytes: int) -> SelectionPlan | None:
    """The selection kernel's plan for ``rule`` (``None``: in-kernel threshold, or the torch threshold path). fp64
    inputs keep the torch path (fp64 statistics)."""
    if not _KERNEL_SELECTION or in_bytes >= 8 or kernel_threshold(rule) is not None:
        return None
    return selection_plan(rule)


def triton_chunk_rows(n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
    """Rows per chunk for the Triton backend so that one chunk's scratch fits ``max_chunk_bytes``.

    The kernels read the GEMM output in the inputs' dtype and write the gradient over it, so a rule
    with an in-kernel threshold needs only that buffer (plus a bool mask for the sparse backward of
    fp32/fp64 inputs). A torch-computed threshold also needs the fp32 transformed copy and the rule's
    own scratch.
    """
    stat_bytes = 8 if in_bytes >= 8 else 4
    mask = 1 if in_bytes >= 4 else 0  # keep-mask of the sparse backward (fp32/fp64 inputs only)
    extra_per_row = 0
    if kernel_threshold(rule) is not None:
        per_logit = in_bytes + mask
    elif _kernel_selection(rule, in_bytes) is not None:  # the raw chunk, plus the candidate buffer and row scalars
        per_logit, extra_per_row = in_bytes + mask, 4 * min(KCAP, vocab) + 32
    else:
        per_logit = stat_bytes + (in_bytes if in_bytes < 4 else 0) + mask + rule.scratch_bytes_per_logit
    # balanced chunks in multiples of 128 rows (no short tail chunk), as many as the budget's own row count gives
    return balanced_chunk_rows(n_rows, max_chunk_bytes // max(1, vocab * per_logit + extra_per_row))


class _ChunkGemm:
    """GEMM of a chunk of rows into one reused buffer in the inputs' dtype (raw, untransformed logits)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
        self.weight_t, self.bias = weight.t(), bias
        self.buf = torch.empty(rows, weight.shape[0], device=hidden.device, dtype=hidden.dtype)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        out = self.buf[: h.shape[0]]
        if self.bias is None:
            torch.mm(h, self.weight_t, out=out)
        else:
            torch.addmm(self.bias, h, self.weight_t, out=out)
        return out


def _device_guard(device: torch.device):
    # Triton launches on the current CUDA device: make it the tensors' one.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _log_torch_threshold(rule: SafeVocabRule) -> None:
    logger.debug(
        "fused_safe_logprobs(backend='triton'): rule %r has no in-kernel threshold; its threshold is "
        "computed in torch per chunk (on torch-transformed fp32 logits) and the Triton kernels fold the rest",
        str(rule),
    )


def triton_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rule: SafeVocabRule,
    transform: Transform,
    chunk_rows: int,
    stats: RowStats,
    sparse_max_density: float | None,
) -> list[SparseChunk]:
    """Fill the per-row statistics of every chunk; return the safe sets stored for the sparse backward.

    Args:
        hidden, weight, bias, targets, rule, transform, chunk_rows: as ``FusedSafeLogProbs.forward``.
        stats: the preallocated ``[N]`` outputs, written here.
        sparse_max_density: store a chunk's ``S`` as CSR when at most this fraction of its logits is kept;
            ``None`` never stores (bf16/fp16 inputs).
    """
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    sparse_chunks: list[SparseChunk] = []
    if n_rows == 0:
        return sparse_chunks
    targets = targets.contiguous()
    in_kernel = kernel_threshold(rule)
    plan = _kernel_selection(rule, hidden.element_size())
    rows_buf = min(chunk_rows, n_rows)
    if in_kernel is None and plan is None:
        _log_torch_threshold(rule)
        logits_of = ChunkLogits(hidden, weight, bias, transform, rows_buf)
    else:
        gemm = _ChunkGemm(hidden, weight, bias, rows_buf)
    identity = transform.logit_scale == 1.0 and transform.softcap is None and transform.temperature == 1.0
    store_sparse_ok = sparse_max_density is not None and sparse_max_density > 0
    kw = _kernel_transform(transform)
    with _device_guard(hidden.device):
        for rows in chunk_slices(n_rows, chunk_rows):
            n = rows.stop - rows.start
            out = stats.rows(rows)
            if plan is not None:
                # thresholds from the raw chunk (no sort of V, no fp32 copy), then the fold, the same transform
                z = gemm(hidden[rows])
                select_thresholds(z, plan, out["threshold"], out["row_max"], **kw)
                store_z = store_sparse_ok and not identity and not _is_half(z)
                forward_fold(z, targets[rows], mode=MODE_GIVEN, store_z=store_z, **kw, **out)
            elif in_kernel is None:
                z = logits_of(hidden[rows])  # transformed, fp32 (fp64 for fp64 inputs)
                t, z_max = rule.threshold_and_max(z)
                out["threshold"].copy_(t.squeeze(-1))
                out["row_max"].copy_(z_max.squeeze(-1))
                forward_fold(z, targets[rows], mode=MODE_GIVEN, **out)
            else:
                mode, log_param = in_kernel
                z = gemm(hidden[rows])
                # the sparse path reads the kept logits back: transformed ones, written by the kernel (fp32/fp64)
                store_z = store_sparse_ok and not identity and not _is_half(z)
                forward_fold(z, targets[rows], mode=mode, log_param=log_param, store_z=store_z, **kw, **out)
            if store_sparse_ok and int(out["safe_size"].sum()) <= sparse_max_density * n * vocab:
                raw = (in_kernel is not None or plan is not None) and _is_half(z)  # the GEMM output, untransformed
                chunk = _sparse_chunk(z, rows.start, out, transform, raw=raw)
                if chunk is not None:
                    sparse_chunks.append(chunk)
            del z
    return sparse_chunks


def _kernel_transform(transform: Transform) -> dict[str, float | None]:
    """The transform as the kernels take it (keyword arguments of ``forward_fold`` and ``select_thresholds``)."""
    return dict(scale=transform.logit_scale, softcap=transform.softcap, temperature=transform.temperature)


def _is_half(z: torch.Tensor) -> bool:
    return z.dtype not in (torch.float32, torch.float64)


def _sparse_chunk(
    z: torch.Tensor, start: int, out: dict[str, torch.Tensor], transform: Transform, raw: bool
) -> SparseChunk | None:
    """A forward chunk's ``S`` as CSR, from the logits the forward kernel compared with ``t`` (the same ``S``, bit for
    bit), compacted by :func:`~safevocab.kernels.kept_entries.compact_kept` (no ``[rows, V]`` mask). ``raw``: ``z`` is
    the half-precision GEMM output the kernel transformed itself, transformed again there with the same code;
    otherwise ``z`` holds the transformed fp32/fp64 logits (written back by the kernel, or the torch copy). ``None``
    when a row's count differs from the forward's ``|S|``: the chunk then takes the dense backward."""
    entries = compact_kept(
        z,
        out["threshold"],
        out["row_max"],
        out["safe_size"],
        transform.logit_scale,
        transform.softcap,
        transform.temperature,
        apply_transform=raw,
    )
    return None if entries is None else SparseChunk(start, out["safe_size"].clone(), *entries)


class _BackwardLogits:
    """A backward chunk's logits exactly as the forward made them: the raw GEMM output for rules whose threshold
    the kernel computes (the kernel transforms it), else the torch-transformed fp32 copy. Returns ``(z, out)``:
    what the backward kernel reads, and the inputs'-dtype buffer it writes the logits gradient into."""

    def __init__(self, hidden, weight, bias, transform: Transform, rows: int, rule: SafeVocabRule):
        self.in_kernel = (
            kernel_threshold(rule) is not None or _kernel_selection(rule, hidden.element_size()) is not None
        )
        self.gemm = _ChunkGemm(hidden, weight, bias, rows) if self.in_kernel else None
        self.logits = None if self.in_kernel else ChunkLogits(hidden, weight, bias, transform, rows)

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.in_kernel:
            out = self.gemm(h)
            return out, out
        z = self.logits(h)
        return z, (self.logits.raw[: h.shape[0]] if self.logits.raw is not None else z)


def triton_dense_backward(
    chunks: list[slice],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    coef: Coefficients,
    transform: Transform,
    chunk_rows: int,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    rule: SafeVocabRule,
) -> None:
    """``safevocab.backends.torch_backend.dense_backward`` with the logits gradient formed by the Triton kernel.

    Recomputes each chunk's logits exactly as the forward did (same row slice, same GEMM into a buffer of
    the same shape, same transform path), so the saved thresholds select the same ``S``.
    """
    logits_of = _BackwardLogits(hidden, weight, bias, transform, min(chunk_rows, hidden.shape[0]), rule)
    has_ent = coef.g_ent is not None
    with _device_guard(hidden.device):
        for rows in chunks:
            h = hidden[rows]
            z, out = logits_of(h)
            backward_fold(
                z,
                out,
                coef.targets[rows].contiguous(),
                coef.threshold[rows],
                coef.row_max[rows],
                coef.log_sum_safe[rows],
                coef.log_sum_full[rows],
                coef.c_safe[rows],
                coef.c_full[rows],
                coef.g_lp[rows],
                coef.g_ent[rows] if has_ent else None,
                coef.entropy[rows] if has_ent else None,
                temperature=transform.temperature,
                softcap=transform.softcap,
                logit_scale=transform.logit_scale,
                transform_in_kernel=logits_of.in_kernel,
                grad_shift=coef.grad_shift,
            )
            accumulate_chunk_grads(
                out, h, weight, rows, grads, coef.grad_shift
            )  # out: the logits gradient, inputs' dtype
            del z, out


def triton_full_softmax_backward(
    idx: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    coef: Coefficients,
    transform: Transform,
    chunk_rows: int,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    rule: SafeVocabRule,
) -> None:
    """The full-softmax part ``-c_F pi + g_lp 1[a=y not in S]`` of the rows ``idx`` (of sparse chunks).

    ``pi`` is normalised with the forward's ``m`` and ``log sum_V``, so the logits must be the forward's bit for
    bit: each chunk holding such rows is recomputed whole on the forward's row slice, through the forward's logits
    path (same GEMM into a buffer of the same shape, same in-kernel or torch transform); only the rows ``idx`` are
    folded and enter the gradient GEMMs. (Another GEMM layout, e.g. ``hidden.index_select`` of the rows, may put a
    logit an ulp ``delta`` off, a factor ``exp(delta / T)`` against the forward's normaliser.) It then also
    cancels exactly against the stored safe-set part where ``S`` is the whole vocabulary."""
    logits_of = _BackwardLogits(hidden, weight, bias, transform, min(chunk_rows, hidden.shape[0]), rule)
    with _device_guard(hidden.device):
        for rows, at in forward_chunks_of(idx, hidden.shape[0], chunk_rows):
            z, out = logits_of(hidden[rows])
            if isinstance(at, slice):  # the whole chunk: its other rows have c_F = 0 and g_lp 1[y not in S] = 0
                h = hidden[rows]
            else:  # the forward's logits of the chosen rows (a row-contiguous copy)
                z, h = z.index_select(0, at - rows.start), hidden.index_select(0, at)
                out = z if out.dtype == z.dtype else torch.empty(z.shape, device=z.device, dtype=out.dtype)
            pick = lambda t, at=at: t[at]  # noqa: E731
            backward_fold(
                z,
                out,
                pick(coef.targets).contiguous(),
                pick(coef.threshold),
                pick(coef.row_max),
                pick(coef.log_sum_safe),
                pick(coef.log_sum_full),
                torch.zeros(z.shape[0], device=z.device, dtype=coef.c_full.dtype),
                pick(coef.c_full),
                pick(coef.g_target_out),
                None,
                None,
                temperature=transform.temperature,
                softcap=transform.softcap,
                logit_scale=transform.logit_scale,
                transform_in_kernel=logits_of.in_kernel,
                grad_shift=coef.grad_shift,
            )
            accumulate_chunk_grads(out, h, weight, at, grads, coef.grad_shift)
            del z, out


def triton_replay_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rule: SafeVocabRule,
    transform: Transform,
    chunk_rows: int,
    stats: RowStats,
    support: SafeSupport,
) -> list[SparseChunk]:
    """The forward of a replayed ``support`` (``S`` = its ids of each row with ``z >= t``, ``t`` the rule's threshold),
    as the torch backend computes it (``safevocab.backends.torch_backend``), every chunk stored sparsely.

    Per chunk: the rule's fold (:func:`~safevocab.kernels.forward_fold.forward_fold` on the logits path the backward's
    full-softmax part recomputes, :class:`_BackwardLogits`) gives ``m``, ``t``, ``log sum_V`` and ``z_y - m``; the
    given ids' logits and the targets' are gathered and transformed as the kernel transforms them
    (:func:`~safevocab.kernels.kept_entries.gather_logits`), and ``S``'s own statistics formed from them in ``O(|S|)``
    work: its shift ``m_S`` (maximum; ``-inf`` for a row that keeps nothing, which ``FusedSafeLogProbs`` then refuses),
    ``log sum_S exp(z - m_S)`` and the entropy summed in float64, ``|S|``, ``in_safe`` and ``z_y - m_S``. Ids may come
    in any order. Every chunk's ``S`` is stored (8 bytes an entry, no more than the support itself takes), so the
    backward is the sparse one."""
    n_rows = hidden.shape[0]
    sparse_chunks: list[SparseChunk] = []
    if n_rows == 0:
        return sparse_chunks
    targets = targets.contiguous()
    in_kernel = kernel_threshold(rule)
    plan = _kernel_selection(rule, hidden.element_size())
    logits_of = _BackwardLogits(hidden, weight, bias, transform, min(chunk_rows, n_rows), rule)
    with _device_guard(hidden.device):
        for rows in chunk_slices(n_rows, chunk_rows):
            z, _ = logits_of(hidden[rows])
            out = stats.rows(rows)
            if plan is not None:  # z: the GEMM output; the rule's thresholds from it, as triton_forward computes them
                kw = _kernel_transform(transform)
                select_thresholds(z, plan, out["threshold"], out["row_max"], **kw)
                forward_fold(z, targets[rows], mode=MODE_GIVEN, **kw, **out)
            elif in_kernel is None:  # z: the torch-transformed copy
                t, z_max = rule.threshold_and_max(z)
                out["threshold"].copy_(t.squeeze(-1))
                out["row_max"].copy_(z_max.squeeze(-1))
                forward_fold(z, targets[rows], mode=MODE_GIVEN, **out)
            else:  # z: the GEMM output, transformed in the kernel
                mode, log_param = in_kernel
                forward_fold(z, targets[rows], mode=mode, log_param=log_param, **_kernel_transform(transform), **out)
            raw = in_kernel is not None or plan is not None  # z is the GEMM output, which the gather transforms
            sparse_chunks.append(_replayed_chunk(z, rows, targets, support, stats, transform, raw))
            del z
    return sparse_chunks


def _replayed_chunk(
    z: torch.Tensor,
    rows: slice,
    targets: torch.Tensor,
    support: SafeSupport,
    stats: RowStats,
    transform: Transform,
    apply_transform: bool,
) -> SparseChunk:
    """``S``'s statistics of the rows ``rows`` (overwriting the rule fold's) and its entries ``(column, z - m_S)``."""
    n = rows.stop - rows.start
    local_row, ids = support.rows(rows)
    stat = stats.row_max.dtype
    local = torch.arange(n, device=z.device)
    values = gather_logits(
        z,
        torch.cat([local_row, local]),
        torch.cat([ids, targets[rows]]),
        stat,
        transform.logit_scale,
        transform.softcap,
        transform.temperature,
        apply_transform,
    )
    z_ids, z_y = values[: ids.numel()], values[ids.numel() :]
    keep = z_ids >= stats.threshold[rows].index_select(0, local_row)  # the rule's set; drops -inf logits
    row, col, kept = local_row[keep], ids[keep], z_ids[keep]
    m_s = torch.full((n,), -torch.inf, dtype=stat, device=z.device).scatter_reduce_(0, row, kept, reduce="amax")
    shifted = kept - m_s.index_select(0, row)
    e = shifted.exp().to(torch.float64)
    total = torch.zeros(n, dtype=torch.float64, device=z.device).index_add_(0, row, e)
    stats.set_max[rows] = m_s
    stats.log_sum_safe[rows] = total.log()
    if stats.entropy is not None:
        weighted = torch.zeros_like(total).index_add_(0, row, e * shifted.to(torch.float64))
        stats.entropy[rows] = (total.log() - weighted / total).to(stat)
    counts = torch.bincount(row, minlength=n)
    stats.safe_size[rows] = counts
    in_safe = torch.zeros(n, dtype=torch.bool, device=z.device)
    in_safe[row[col == targets[rows].index_select(0, row)]] = True
    stats.in_safe[rows] = in_safe
    stats.target_shift_safe[rows] = z_y - m_s
    return SparseChunk(rows.start, counts, col.to(torch.int32), shifted)


def triton_sparse_backward(
    chunks: list[SparseChunk],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    coef: Coefficients,
    transform: Transform,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """The safe-set part of the gradient of every stored chunk at once, by
    :func:`safevocab.kernels.sparse_backward.sparse_backward`: ``dX`` row by row, ``dW``/``db`` per distinct kept id
    over all chunks (each touched row of the gradients written once; no fp32 ``[V, H]`` buffer needed)."""
    if not chunks:
        return
    device = hidden.device
    rows = torch.cat([torch.arange(c.start, c.start + c.counts.numel(), device=device) for c in chunks])
    has_ent = coef.g_ent is not None
    with _device_guard(device):
        kernel_sparse_backward(
            rows,
            torch.cat([c.counts for c in chunks]).to(torch.int64),
            torch.cat([c.cols for c in chunks]),
            torch.cat([c.shifted for c in chunks]),
            coef.targets.contiguous(),
            coef.log_sum_safe,
            coef.c_safe,
            coef.g_lp,
            coef.g_ent if has_ent else None,
            coef.entropy if has_ent else None,
            coef.set_max.contiguous(),
            hidden if hidden.stride(1) == 1 else hidden.contiguous(),
            weight if weight.stride(1) == 1 else weight.contiguous(),
            *grads,
            temperature=transform.temperature,
            softcap=transform.softcap,
            logit_scale=transform.logit_scale,
            grad_shift=coef.grad_shift,
        )


class TritonBackend:
    """The Triton kernels fold every chunk (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""

    name = "triton"
    #: Replayed supports: the rule's fold plus a gather of the given ids (:func:`triton_replay_forward`).
    supports_replay = True

    def rows_per_chunk(self, n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
        return triton_chunk_rows(n_rows, vocab, rule, in_bytes, max_chunk_bytes)  # the kernels need less scratch

    def forward(
        self, hidden, weight, bias, targets, rule, transform, chunk_rows, stats, sparse_max_density, support=None
    ):
        if support is not None:  # every chunk stored sparsely, whatever the density
            return triton_replay_forward(hidden, weight, bias, targets, rule, transform, chunk_rows, stats, support)
        return triton_forward(hidden, weight, bias, targets, rule, transform, chunk_rows, stats, sparse_max_density)

    def dense_backward(self, chunks, hidden, weight, bias, coef, transform, chunk_rows, grads, rule):
        triton_dense_backward(chunks, hidden, weight, bias, coef, transform, chunk_rows, grads, rule)

    def full_softmax_backward(self, idx, hidden, weight, bias, coef, transform, chunk_rows, grads, rule):
        triton_full_softmax_backward(idx, hidden, weight, bias, coef, transform, chunk_rows, grads, rule)

    def sparse_backward(self, chunks, hidden, weight, coef, transform, grads):
        """The safe-set part of the stored chunks' gradient in Triton (any input dtype), used by ``FusedSafeLogProbs``
        instead of its torch sparse GEMMs; with it the forward stores ``S`` for bf16/fp16 inputs too."""
        triton_sparse_backward(chunks, hidden, weight, coef, transform, grads)
