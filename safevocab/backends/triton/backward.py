"""The Triton backend's backward: dense chunks, the full-softmax part of sparse ones, and the stored sets' part.

- :func:`dense_backward`: ``safevocab.backends.torch_backend.dense_backward`` with the logits gradient formed by
  :func:`~safevocab.kernels.backward_fold.backward_fold`, each chunk recomputed on the forward's row slice through the
  call's route (:meth:`~safevocab.backends.triton.route.Route.chunk_logits`), so the saved thresholds select the same
  ``S``;
- :func:`full_softmax_backward`: ``-c_F pi + g_lp 1[a=y not in S]`` of the rows of sparse chunks that need it,
  ``pi`` normalised with the forward's statistics on the forward's logits, bit for bit;
- :func:`sparse_backward`: the safe-set part of every stored chunk (any input dtype), by the backward
  :mod:`safevocab.backends.triton.sparse_gate` chooses once per call from the kept counts and the unions ``U`` of the
  chunks' kept ids: the per-id kernels (:mod:`safevocab.kernels.sparse_backward`), two GEMMs over ``U``
  (:mod:`safevocab.kernels.union_backward`: ``dX += G_U W[U]``, ``dW[U] += G_U^T h``) or the dense backward of those
  chunks.

The logits gradient is written over the GEMM output, in the inputs' dtype, and the gradient GEMMs
(:func:`~safevocab.fused.grads.accumulate_chunk_grads`) accumulate the weight gradient in fp32 (for bf16/fp16 inputs
the per-logit gradient is rounded to the inputs' dtype first, as trl's Triton path does; the torch backend keeps it in
fp32 for that GEMM). All three run inside :class:`~safevocab.backends.triton.TritonBackend`'s device guard.
"""

from __future__ import annotations

import torch

from safevocab.backends.triton import sparse_gate
from safevocab.backends.triton.route import Route
from safevocab.fused.chunking import LEAVING_ROWS, ChunkJob
from safevocab.fused.coefficients import Coefficients
from safevocab.fused.grads import Grads, accumulate_chunk_grads
from safevocab.fused.row_stats import SparseChunk
from safevocab.kernels.backward_fold import backward_fold
from safevocab.kernels.sparse_backward import sparse_backward as kernel_sparse_backward
from safevocab.kernels.union_backward import UnionChunk, kept_ranks, union_ids
from safevocab.kernels.union_backward import union_backward as kernel_union_backward

__all__ = ["dense_backward", "full_softmax_backward", "queue_sparse_reads", "sparse_backward"]


def dense_backward(job: ChunkJob, route: Route, chunks: list[slice], coef: Coefficients, grads: Grads) -> None:
    """``safevocab.backends.torch_backend.dense_backward`` with the logits gradient formed by the Triton kernel: the
    whole gradient of the forward chunks ``chunks`` (row slices of ``job``) added to ``grads``.

    Recomputes each chunk's logits exactly as the forward did (same row slice, same GEMM into a buffer of
    the same shape, same transform path: ``route``'s), so the saved thresholds select the same ``S``.
    """
    logits_of = route.chunk_logits(job)
    has_ent = coef.g_ent is not None
    transform = job.transform
    for rows in chunks:
        h = job.hidden[rows]
        z, out = logits_of.backward(rows)  # the forward's kept buffer, or recomputed
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
            transform_in_kernel=route.transform_in_kernel,
            grad_shift=coef.grad_shift,
        )
        # out: the logits gradient, in the inputs' dtype
        accumulate_chunk_grads(out, h, job.weight, rows, grads, coef.grad_shift)
        del z, out


def full_softmax_backward(
    job: ChunkJob,
    route: Route,
    idx: torch.Tensor,
    coef: Coefficients,
    grads: Grads,
    counts: list[int],
) -> None:
    """The full-softmax part ``-c_F pi + g_lp 1[a=y not in S]`` of the rows ``idx`` (``[k]`` int64, ascending rows of
    sparse chunks; ``counts``: how many of them each forward chunk holds), added to ``grads``.

    ``pi`` is normalised with the forward's ``m`` and ``log sum_V``, so the logits must be the forward's bit for
    bit: each chunk holding such rows is recomputed whole on the forward's row slice, through the forward's logits
    path (same GEMM into a buffer of the same shape, same in-kernel or torch transform: ``route``'s); only the rows
    ``idx`` are folded and enter the gradient GEMMs. (Another GEMM layout, e.g. ``hidden.index_select`` of the rows,
    may put a logit an ulp ``delta`` off, a factor ``exp(delta / T)`` against the forward's normaliser.) It then also
    cancels exactly against the stored safe-set part where ``S`` is the whole vocabulary."""
    logits_of = route.chunk_logits(job)
    hidden, transform = job.hidden, job.transform
    # Half inputs: this part is written in fp32 and its GEMMs accumulate fp32 operands, so that it meets the stored
    # safe-set part (fp32 too) before anything is rounded; the sum is rounded once, on return. Rounded to bf16 apart,
    # -c_F pi and c_S pi_S (which cancel where S holds nearly all the mass: a log_kept_mass gradient) left an error
    # of eps_bf16 * p per logit where the exact gradient is 0 (issue 57, T1).
    half = hidden.dtype in (torch.bfloat16, torch.float16)
    for rows, at in job.chunks_of(idx, counts):
        z, out = logits_of.backward(rows)  # the forward's kept buffer, or recomputed
        if isinstance(at, slice):  # the whole chunk: its other rows have c_F = 0 and g_lp 1[y not in S] = 0
            h = hidden[rows]
        else:  # the forward's logits of the chosen rows (a row-contiguous copy)
            z, h = z.index_select(0, at - rows.start), hidden.index_select(0, at)
        out_dtype = torch.float32 if half else out.dtype
        if half or not isinstance(at, slice):  # a destination of the chosen rows' shape, in the gradient's dtype
            out = z if z.dtype == out_dtype else torch.empty(z.shape, device=z.device, dtype=out_dtype)
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
            transform_in_kernel=route.transform_in_kernel,
            grad_shift=coef.grad_shift,
        )
        accumulate_chunk_grads(out, h, job.weight, at, grads, coef.grad_shift, keep_fp32=half)
        del z, out


#: What :func:`queue_sparse_reads` queues and keeps: every stored chunk's ``|U|`` and the call's (``G_U``'s shape and
#: the gate); whether a stored row's gradient leaves ``S`` (only where the fused op did not queue those rows,
#: ``LEAVING_ROWS``: the dense backward would add that part a second time, and the union GEMMs keep ``G_U`` in fp32);
#: the union ranks (:func:`~safevocab.kernels.union_backward.kept_ranks`), in ``coef.prepared``.
UNION_SIZES = "union sizes"
STORED_LEAVING = "a stored row leaves S"
UNION_RANKS = "union ranks"


def queue_sparse_reads(job: ChunkJob, chunks: list[SparseChunk], coef: Coefficients) -> None:
    """Queue on ``coef.reads`` the device values :func:`sparse_backward` reads, computing the chunks' union ranks
    once (kept in ``coef.prepared``); no read of the device. The fused op calls it before its own read, so that the
    backward reads the device once."""
    if not chunks or UNION_RANKS in coef.prepared:
        return
    ranks = kept_ranks([c.cols for c in chunks], job.vocab)
    coef.prepared[UNION_RANKS] = ranks
    coef.reads.add(UNION_SIZES, ranks[:, -1])
    if LEAVING_ROWS not in coef.reads:
        slices = [slice(c.start, c.start + c.counts.numel()) for c in chunks]
        coef.reads.add(
            STORED_LEAVING, torch.cat([(coef.c_full[r] != 0) | (coef.g_target_out[r] != 0) for r in slices]).any()
        )


def sparse_backward(job: ChunkJob, route: Route, chunks: list[SparseChunk], coef: Coefficients, grads: Grads) -> None:
    """The safe-set part of the gradient of every stored chunk, added to ``grads``, by the backward
    :func:`safevocab.backends.triton.sparse_gate.choose` picks for the call: the per-id kernels
    (:func:`safevocab.kernels.sparse_backward.sparse_backward`, all chunks at once), the union GEMMs
    (:func:`safevocab.kernels.union_backward.union_backward`, chunk by chunk) or the dense backward of those chunks
    (:func:`dense_backward`). Each touched row of the gradients is written once per call by the first two (no fp32
    ``[V, H]`` buffer needed); the dense one accumulates in fp32 buffers and adds them once.

    It reads what :func:`queue_sparse_reads` queued on ``coef.reads``, with whatever else the fused op queued there:
    one read of the device per backward call (the per-id kernels then read nothing either: they get ``U``'s ids)."""
    if not chunks:
        return
    hidden, weight, transform = job.hidden, job.weight, job.transform
    slices = [slice(c.start, c.start + c.counts.numel()) for c in chunks]
    queue_sparse_reads(job, chunks, coef)  # nothing new if the op had it queue them before its read
    ranks = coef.prepared[UNION_RANKS]
    values = coef.reads.read()  # no second read when the op read them with its own
    *sizes, call_size = values[UNION_SIZES]
    leaving = any(values[LEAVING_ROWS]) if LEAVING_ROWS in values else bool(values[STORED_LEAVING][0])
    backward = sparse_gate.choose(
        sum(c.cols.numel() for c in chunks),
        sum(c.counts.numel() * size for c, size in zip(chunks, sizes)),
        max(sizes),
        job.vocab,
        dense_allowed=job.support is None and not leaving,
    )
    sparse_gate.TAKEN[backward] += 1
    if backward == sparse_gate.DENSE:
        _dense_stored_chunks(job, route, slices, coef, grads)
        return
    has_ent = coef.g_ent is not None
    coefficients = (
        coef.targets.contiguous(),
        coef.log_sum_safe,
        coef.c_safe,
        coef.g_lp,
        coef.g_ent if has_ent else None,
        coef.entropy if has_ent else None,
        coef.set_max.contiguous(),
    )
    scalars = dict(
        temperature=transform.temperature,
        softcap=transform.softcap,
        logit_scale=transform.logit_scale,
        grad_shift=coef.grad_shift,
    )
    if backward == sparse_gate.UNION:
        on_cpu = hidden.device.type == "cpu"
        kernel_union_backward(
            [UnionChunk(c.start, c.counts, c.cols, c.shifted, size) for c, size in zip(chunks, sizes)],
            ranks,
            call_size,
            *coefficients,
            hidden,
            weight,
            *grads,
            **scalars,
            half_operands=not leaving and (not on_cpu or _HALF_OPERANDS_ON_CPU),
        )
        return
    device = hidden.device
    kernel_sparse_backward(
        torch.cat([torch.arange(r.start, r.stop, device=device) for r in slices]),
        torch.cat([c.counts for c in chunks]).to(torch.int64),
        torch.cat([c.cols for c in chunks]),
        torch.cat([c.shifted for c in chunks]),
        *coefficients,
        hidden,
        weight,
        *grads,
        **scalars,
        kept_ids=union_ids(ranks[-1], call_size),
    )


#: Whether the union GEMMs take ``G_U`` in the inputs' half dtype on a CPU too (where no stored row's gradient leaves
#: ``S``), as they do on an accelerator (tensor cores). Off: a CPU has no tensor cores to gain, and its GEMMs then keep
#: fp32 operands; tests switch it on to run the accelerator's rounding under the interpreter.
_HALF_OPERANDS_ON_CPU = False


def _dense_stored_chunks(job: ChunkJob, route: Route, slices: list[slice], coef: Coefficients, grads: Grads) -> None:
    """The dense backward of stored chunks (none of whose rows has a full-softmax part, so it forms exactly their
    safe-set part), into fp32 accumulators where ``grads`` has none (the fused op hands the weight's own dtype to a
    sparse-only backward), added once at the end."""
    stat = coef.log_sum_safe.dtype
    accs = tuple(
        g if g is None or g.dtype == stat else torch.zeros(g.shape, device=g.device, dtype=stat) for g in grads
    )
    dense_backward(job, route, slices, coef, accs)
    for grad, acc in zip(grads, accs):
        if acc is not grad:
            grad.add_(acc)  # computed in fp32, rounded once
