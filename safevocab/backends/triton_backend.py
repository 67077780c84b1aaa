"""Triton backend of :class:`safevocab.fused_op.FusedSafeLogProbs`: per-chunk GEMM in torch, fold in Triton.

:class:`TritonBackend` implements :class:`safevocab.backends.protocol.FusedBackend`: :func:`triton_forward` and
:func:`triton_dense_backward` replace the torch backend's passes (:mod:`safevocab.backends.torch_backend`) with the
kernels of :mod:`safevocab.kernels` (one op a file); the autograd bookkeeping and the sparse backward stay in
:mod:`safevocab.fused_op`. The backward (dense chunks and the full-softmax part of sparse ones,
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
    chunk_slices,
    forward_chunks_of,
)
from safevocab.kernels import MODE_GIVEN, kernel_threshold
from safevocab.kernels.backward_fold import backward_fold
from safevocab.kernels.forward_fold import forward_fold
from safevocab.kernels.threshold_select import KCAP, SelectionPlan, select_thresholds, selection_plan
from safevocab.rules import SafeVocabRule

__all__ = ["TritonBackend", "triton_chunk_rows", "triton_forward", "triton_dense_backward"]

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
    return max(1, min(n_rows, max_chunk_bytes // max(1, vocab * per_logit + extra_per_row)))


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
    with _device_guard(hidden.device):
        for rows in chunk_slices(n_rows, chunk_rows):
            n = rows.stop - rows.start
            out = stats.rows(rows)
            if plan is not None:
                # thresholds from the raw chunk (threshold_select: no sort of V, no fp32 copy), then the fold
                # with the same in-kernel transform
                z = gemm(hidden[rows])
                kw = dict(scale=transform.logit_scale, softcap=transform.softcap, temperature=transform.temperature)
                select_thresholds(z, plan, out["threshold"], out["row_max"], **kw)
                forward_fold(z, targets[rows], mode=MODE_GIVEN, store_z=store_sparse_ok and not identity, **kw, **out)
            elif in_kernel is None:
                z = logits_of(hidden[rows])  # transformed, fp32 (fp64 for fp64 inputs)
                t, z_max = rule.threshold_and_max(z)
                out["threshold"].copy_(t.squeeze(-1))
                out["row_max"].copy_(z_max.squeeze(-1))
                forward_fold(z, targets[rows], mode=MODE_GIVEN, **out)
            else:
                mode, log_param = in_kernel
                z = gemm(hidden[rows])
                forward_fold(
                    z,
                    targets[rows],
                    mode=mode,
                    log_param=log_param,
                    scale=transform.logit_scale,
                    softcap=transform.softcap,
                    temperature=transform.temperature,
                    # the sparse path reads the kept logits back: transformed ones, written by the kernel
                    store_z=store_sparse_ok and not identity,
                    **out,
                )
            if store_sparse_ok and int(out["safe_size"].sum()) <= sparse_max_density * n * vocab:
                # z holds the transformed logits the kernel compared with t: the same S, bit for bit
                keep = z >= out["threshold"].unsqueeze(-1)
                r, c = keep.nonzero(as_tuple=True)
                shifted = z[r, c] - out["row_max"][r]
                sparse_chunks.append(SparseChunk(rows.start, keep.sum(-1), c.to(torch.int32), shifted))
                del keep, r, c
            del z
    return sparse_chunks


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


class TritonBackend:
    """The Triton kernels fold every chunk (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""

    name = "triton"
    #: Replayed supports are not threshold sets: ``fused_safe_logprobs`` uses the torch backend for them.
    supports_replay = False

    def rows_per_chunk(self, n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
        return triton_chunk_rows(n_rows, vocab, rule, in_bytes, max_chunk_bytes)  # the kernels need less scratch

    def forward(self, hidden, weight, bias, targets, rule, transform, chunk_rows, stats, sparse_max_density):
        return triton_forward(hidden, weight, bias, targets, rule, transform, chunk_rows, stats, sparse_max_density)

    def dense_backward(self, chunks, hidden, weight, bias, coef, transform, chunk_rows, grads, rule):
        triton_dense_backward(chunks, hidden, weight, bias, coef, transform, chunk_rows, grads, rule)

    def full_softmax_backward(self, idx, hidden, weight, bias, coef, transform, chunk_rows, grads, rule):
        triton_full_softmax_backward(idx, hidden, weight, bias, coef, transform, chunk_rows, grads, rule)
