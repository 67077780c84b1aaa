"""The fused LM head + safe log-softmax as one autograd function over chunks of rows, never ``[N, V]``.

:class:`FusedSafeLogProbs` computes, per row with target ``y``, transformed logits ``z`` (maximum ``m``)
and safe set ``S = {z >= t}``::

    log pi_S(y) = (z_y - m) - log sum_S exp(z - m)      (max-shifted: huge logits lose no precision)

(the full log-softmax for ``y`` outside ``S``), ``log_kept_mass = log sum_S exp(z - m) - log sum_V exp(z - m)``
and the entropy of ``pi_S``. A *backend* object (:class:`safevocab.fused.protocol.FusedBackend`: the
torch passes of :mod:`safevocab.backends.torch_backend` or the Triton kernels of
:mod:`safevocab.backends.triton`) folds each chunk of a :class:`~safevocab.fused.chunking.ChunkJob`; this module
owns the bookkeeping around it.

Backward forms ``grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi`` (see
:class:`~safevocab.fused.coefficients.Coefficients`) in two parts:

- the **safe-set part** ``-pi_S (...) + g_lp 1[a=y in S]`` depends on ``S``. It must use exactly the
  forward's ``S``, whatever the layout, dtype, chunking or backend:

  - **sparse** (the common case in RL): when a chunk's safe sets are small (at most
    ``SPARSE_MAX_DENSITY`` of its logits; ``KERNEL_SPARSE_MAX_DENSITY`` on the Triton backend), forward stores
    ``S`` itself as CSR (int32 column, fp32 ``z - m``: 8 bytes per kept logit), and backward runs two sparse
    GEMMs whose cost scales with ``|S|``: no recomputation at all
    (:func:`safevocab.fused.sparse_backward.sparse_backward`), or the backend's own
    ``sparse_backward`` when it has one (the Triton backend, any input dtype: per kept id,
    :mod:`safevocab.kernels.sparse_backward`, or two GEMMs over the union of a chunk's kept ids,
    :mod:`safevocab.kernels.union_backward`, or the dense backward over the stored chunks, chosen once per call by
    :mod:`safevocab.backends.triton.sparse_gate`; :func:`sparse_density`).
  - **dense** (chunks with large safe sets; half-precision inputs on the torch backend): the backend recomputes the
    chunk's logits with the *same call on the same operands* as the forward (the same row slice of ``hidden``, the
    same buffer shape: BLAS results depend on layout and alignment, and a boundary token one ulp off would
    leave ``S``), rebuilds ``S = {z >= t}`` and checks it against the saved ``|S|``.
- the **full-softmax part** ``-c_F pi + g_lp 1[a=y not in S]`` (targets outside ``S`` with a gradient,
  or a gradient on ``log_kept_mass``) does not depend on ``S``, but
  ``pi = exp((z - m) - log sum_V exp(z - m))`` is normalised with the forward's ``m`` and ``log sum_V``, so
  ``z`` must be the forward's bit for bit. Dense chunks form it with the rest; a sparse chunk holding rows
  that need it is recomputed whole, with the same call on the same operands as its forward, and only those
  rows are folded and enter the gradient GEMMs (the backend's ``full_softmax_backward``: one GEMM per such
  chunk). Recomputing only those rows (``hidden.index_select``) changes the GEMM's layout: a logit one ulp
  ``delta`` off becomes a factor ``exp(delta / T)`` against the forward's normaliser, unbounded at small
  ``T``. It also makes the part cancel exactly against the stored safe-set part where ``S = V``.

Kept logits (``keep_logits_bytes > 0``, opt-in): the forward keeps its first chunks' logits buffers, in forward order
until the next would pass the cap, each in a tensor of its own (:class:`~safevocab.fused.chunking.KeptLogits`, carried
by the :class:`~safevocab.fused.chunking.ChunkJob`): the exact buffer its fold read (the GEMM output in the inputs'
dtype, 2 bytes a logit for bf16; the torch-transformed fp32 copy on the Triton backend's torch-threshold route; the
GEMM output, transformed again, on the torch backend, whose forward overwrites its logits). Where the backward would
recompute a kept chunk (dense chunks, the full-softmax part, the Triton backend's dense choice for stored chunks) it
folds that buffer instead: the same ``S`` and gradients bit for bit, one GEMM fewer a chunk (3 GEMMs instead of 4 for a
call whose chunks are all kept). The cost is ``rows x V x itemsize`` a kept chunk, held from the forward to the
backward (``N = 8192``, ``V = 151936``, bf16: 2.49 GB for the whole call). The backward writes the gradient over the
buffers it reads, so they serve one backward: it drops them all when it ends, and a second one (``retain_graph=True``)
recomputes. A forward where no input needs a gradient keeps nothing.

fp16 inputs: each row's logits gradient is at most ``(|g_lp| + |c_S| + |c_F| + |g_H| (1/e + H)) s``
(``s = logit_scale / T``; :meth:`~safevocab.fused.coefficients.Coefficients.logits_grad_bound`), which leaves fp16's
range once ``1/T`` nears 65504 while the gradients of ``hidden`` and ``weight`` may still fit. The backends
then write it divided by a power of two ``2^k`` that brings the bound under ``2^14``
(:func:`~safevocab.fused.coefficients.fp16_grad_shift`, ``Coefficients.grad_shift``) and multiply the GEMM products
by ``2^k`` (exact): finite gradients wherever the true ones fit fp16. ``k = 0`` otherwise.

Non-finite input is detected from the row statistics (a non-finite ``m`` or ``log sum_V``) and raised as a
one-line ``ValueError`` naming the argument (:func:`safevocab.fused.checks.raise_on_non_finite_rows`).

Host synchronisation: the forward reads the device once, at its end (:class:`~safevocab.fused.row_stats.CallReads`):
the caller's input checks, the non-finite flags and, on the Triton backend, which chunks are stored, together
(the selection route decides its mass fallback's rows in a bounded batch, and reads again only for a chunk that
overflowed it; docs/performance.md, "Host synchronisation"). The
backward reads it once when the forward stored chunks (``Coefficients.reads``: their rows whose gradient leaves
``S``, per chunk, with the values a backend's sparse backward queued), else never.
"""

from __future__ import annotations

import contextlib

import torch

from safevocab.fused.checks import EMPTY_SUPPORT, non_finite_flags, raise_on_empty_support, raise_on_non_finite_rows
from safevocab.fused.chunking import LEAVING_ROWS, ChunkJob, KeptLogits, rows_per_chunk
from safevocab.fused.coefficients import Coefficients, fp16_grad_shift
from safevocab.fused.protocol import FusedBackend
from safevocab.fused.row_stats import CallReads, RowStats
from safevocab.fused.sparse_backward import sparse_backward
from safevocab.fused.transform import Transform
from safevocab.rules import SafeVocabRule
from safevocab.support import SafeSupport

__all__ = ["FusedSafeLogProbs", "KERNEL_SPARSE_MAX_DENSITY", "SPARSE_MAX_DENSITY", "sparse_density"]

#: Largest fraction of a chunk's logits kept in ``S`` for which the torch sparse GEMMs (MKL, cuSPARSE) replace the
#: dense backward.
SPARSE_MAX_DENSITY = 1.0 / 16
#: The same for a backend's own sparse backward (the Triton kernels), which gathers ``H`` values per kept logit
#: without tensor cores: on an H100 (docs/performance.md, third GPU run; H = 4096, V = 151936, N = 8192, bf16) it
#: took ~12 ms plus ~14 ns per kept logit against ~39 ms for the dense backward's recomputation and two GEMMs, so by
#: that estimate it wins below ~230 kept logits per row (V / 660); at 2430 (``min_p=0.001`` on flat logits) the op
#: took 5.3x trl's kernel. Both costs grow with ``H``, the dense one with ``V``: a fraction of ``V`` is the gate, set
#: below the estimated crossover.
KERNEL_SPARSE_MAX_DENSITY = 1.0 / 1024


class FusedSafeLogProbs(torch.autograd.Function):
    """``[N, H] x [V, H] -> [N]`` safe log-probabilities; see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        rule: SafeVocabRule,
        transform: Transform,
        compute_entropy: bool,
        chunk_rows: int,
        backend: FusedBackend,  # the per-chunk implementation (safevocab.backends.registry.get_backend)
        weight_gather=None,  # sharded-weight hook: zero-arg factory of a context manager, or None
        support: SafeSupport | None = None,  # replayed kept ids per row (backends with supports_replay)
        reads: CallReads | None = None,  # the caller's checks, read with the op's (fused_safe_logprobs' input checks)
        keep_logits_bytes: int = 0,  # cap on the chunk buffers kept for the backward (KeptLogits); 0: recompute all
    ):
        ctx.set_materialize_grads(False)
        ctx.weight_gather = weight_gather
        n_rows = hidden.shape[0]
        stat_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        stats = RowStats.empty(
            n_rows, hidden.device, stat_dtype, compute_entropy, replay=support is not None, reads=reads
        )
        density = sparse_density(hidden.dtype, backend)
        # A -inf weight entry times positive hidden values gives a -inf logit, which reads as a banned token and
        # leaves every row statistic finite: the weight's extremes (one read in its own dtype, no [V, H] temporary,
        # checked with the statistics; NaN propagates through them) show it
        weight_range = torch.stack(torch.aminmax(weight))
        # the call's checks, formed once the kernels have written the statistics and read with the caller's and the
        # backend's values: one host read per call (a backend that stores chunks reads them in its forward)
        stats.reads.add(
            "non-finite",
            lambda: non_finite_flags(stats, weight_range),
            lambda flags: raise_on_non_finite_rows(stats, hidden, weight, bias, transform, flags=flags),
        )
        if support is not None:
            stats.reads.add(
                EMPTY_SUPPORT,
                lambda: (stats.safe_size == 0).any(),
                lambda flag: raise_on_empty_support(stats.safe_size, rule, bool(flag[0])),
            )
        # Kept logits only where a backward may run: an input needs a gradient (the caller passes 0 under no_grad, which
        # needs_input_grad does not show)
        kept = KeptLogits(keep_logits_bytes) if keep_logits_bytes > 0 and any(ctx.needs_input_grad[:3]) else None
        job = ChunkJob(hidden, weight, bias, targets, rule, transform, chunk_rows, support, kept)
        sparse_chunks = backend.forward(job, stats, density)
        stats.reads.check()  # in order: the caller's input checks, non-finite input, an empty replayed row
        if support is None:
            set_max, target_shift_safe, log_kept = (
                stats.row_max,
                stats.target_shift,
                stats.log_sum_safe - stats.log_sum_full,
            )
        else:  # S has its own shift: log(kept mass) = (m_S - m) + log sum_S exp(z - m_S) - log sum_V exp(z - m)
            set_max, target_shift_safe = stats.set_max, stats.target_shift_safe
            log_kept = (set_max - stats.row_max) + stats.log_sum_safe - stats.log_sum_full
        logprobs = torch.where(
            stats.in_safe, target_shift_safe - stats.log_sum_safe, stats.target_shift - stats.log_sum_full
        )

        ctx.save_for_backward(
            hidden,
            weight,
            bias,
            targets,
            stats.threshold,
            stats.row_max,
            stats.log_sum_safe,
            stats.log_sum_full,
            stats.in_safe,
            stats.safe_size,
            stats.entropy,
            set_max,
        )
        ctx.sparse_chunks = sparse_chunks
        ctx.kept_logits = kept if kept is not None and len(kept) else None
        ctx.weight_shape = tuple(weight.shape)
        ctx.transform = transform
        ctx.chunk_rows = chunk_rows
        ctx.backend, ctx.rule, ctx.support = backend, rule, support
        ctx.mark_non_differentiable(stats.in_safe, stats.safe_size)
        return logprobs, log_kept, stats.entropy, stats.in_safe, stats.safe_size

    @staticmethod
    def backward(ctx, grad_logprobs, grad_log_kept, grad_entropy, _grad_in_safe, _grad_safe_size):  # type: ignore[override]
        try:
            if grad_logprobs is None and grad_log_kept is None and grad_entropy is None:
                return (None,) * 13
            # ---- sharded-weight hook: the backward re-reads the weight (sparse GEMMs and the dense
            # recomputation), so a weight gathered only for the forward (DeepSpeed ZeRO-3) is gathered again here.
            gather = contextlib.nullcontext() if ctx.weight_gather is None else ctx.weight_gather()
            with gather:
                return FusedSafeLogProbs._backward(ctx, grad_logprobs, grad_log_kept, grad_entropy)
        finally:
            # the kept buffers serve one backward (it writes the gradient over those it reads): drop them all, so that
            # a second one (retain_graph=True) recomputes and none outlives the backward while the graph is held
            if ctx.kept_logits is not None:
                ctx.kept_logits.clear()
                ctx.kept_logits = None

    @staticmethod
    def _backward(ctx, grad_logprobs, grad_log_kept, grad_entropy):
        (
            hidden,
            weight,
            bias,
            targets,
            threshold,
            row_max,
            log_sum_safe,
            log_sum_full,
            in_safe,
            safe_size,
            entropy,
            set_max,
        ) = ctx.saved_tensors
        if tuple(weight.shape) != ctx.weight_shape:  # e.g. a ZeRO-3 weight partitioned again after the forward
            raise RuntimeError(
                f"weight has shape {tuple(weight.shape)} in backward but {ctx.weight_shape} in forward: a sharded weight "
                "gathered only around the forward needs weight_gather= (see fused_safe_logprobs)"
            )
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n_rows, stat = hidden.shape[0], log_sum_safe.dtype
        # the forward's job on the saved tensors (a sharded weight is gathered again around this backward)
        job = ChunkJob(
            hidden, weight, bias, targets, ctx.rule, ctx.transform, ctx.chunk_rows, ctx.support, ctx.kept_logits
        )

        # contiguous: autograd may hand over expanded (stride-0) gradients, and the kernels index rows directly
        zeros = torch.zeros(n_rows, device=hidden.device, dtype=stat)
        g_lp = grad_logprobs.to(stat).contiguous() if grad_logprobs is not None else zeros
        g_k = grad_log_kept.to(stat).contiguous() if grad_log_kept is not None else zeros
        g_ent = grad_entropy.to(stat).contiguous() if grad_entropy is not None else None
        coef = Coefficients(
            g_lp=g_lp,
            g_ent=g_ent,
            c_safe=torch.where(in_safe, g_lp, 0.0) - g_k,
            c_full=torch.where(in_safe, 0.0, g_lp) + g_k,
            g_target_out=torch.where(in_safe, 0.0, g_lp),
            row_max=row_max,
            set_max=set_max,
            log_sum_safe=log_sum_safe,
            log_sum_full=log_sum_full,
            entropy=entropy,
            threshold=threshold,
            safe_size=safe_size,
            targets=targets,
        )
        if hidden.dtype == torch.float16:  # a logits gradient beyond 65504 is stored scaled down (Coefficients)
            coef.grad_shift = fp16_grad_shift(coef, ctx.transform.logit_scale / ctx.transform.temperature)

        sparse_starts = set()
        in_sparse = torch.zeros(n_rows, device=hidden.device, dtype=torch.bool)
        for chunk in ctx.sparse_chunks:
            sparse_starts.add(chunk.start)
            in_sparse[chunk.start : chunk.start + chunk.counts.shape[0]] = True
        dense_chunks = [rows for rows in job.slices() if rows.start not in sparse_starts]
        # Full-softmax part of sparse-chunk rows whose gradient leaves S (the dense chunks include it).
        leaves = in_sparse & ((coef.c_full != 0) | (coef.g_target_out != 0))
        backend_sparse = getattr(ctx.backend, "sparse_backward", None)  # the backend's own sparse backward, if any
        if ctx.sparse_chunks:  # the backward's one read: those rows per forward chunk, with the backend's values
            coef.reads.add(LEAVING_ROWS, rows_per_chunk(leaves, ctx.chunk_rows))
            queue = getattr(ctx.backend, "queue_sparse_reads", None)
            if queue is not None:
                queue(job, ctx.sparse_chunks, coef)
            full_counts = coef.reads.read()[LEAVING_ROWS]
            full_idx = torch.nonzero_static(leaves, size=sum(full_counts)).squeeze(-1)  # sized: no second read
        else:  # no stored chunk, no such row: the dense chunks include that part (no read)
            full_idx, full_counts = leaves.new_empty(0, dtype=torch.long), []

        # fp32 for half inputs: every chunk's dX product is accumulated in fp32 and rounded once, on return
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=stat) if need_h else None
        # fp32 accumulators, except where only the backend's sparse backward writes (each row once, no GEMM sums)
        sparse_only = backend_sparse is not None and not dense_chunks and not sum(full_counts)
        w_acc = weight.dtype if sparse_only else stat
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=w_acc) if need_w else None
        b_acc = bias.dtype if sparse_only and need_b else stat
        grad_bias = torch.zeros(weight.shape[0], device=weight.device, dtype=b_acc) if need_b else None
        grads = (grad_hidden, grad_weight, grad_bias)

        # Safe-set part: the stored S of sparse chunks, or an exact recomputation of the other chunks.
        if backend_sparse is not None:
            backend_sparse(job, ctx.sparse_chunks, coef, grads)
        else:
            for chunk in ctx.sparse_chunks:
                sparse_backward(job, chunk, coef, grads)
        if dense_chunks:
            ctx.backend.dense_backward(job, dense_chunks, coef, grads)
        if sum(full_counts):
            ctx.backend.full_softmax_backward(job, full_idx, coef, grads, full_counts)

        return (
            grad_hidden.to(hidden.dtype) if need_h else None,
            grad_weight.to(weight.dtype) if need_w else None,
            grad_bias.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
            None,  # backend
            None,  # weight_gather
            None,  # support
            None,  # reads
            None,  # keep_logits_bytes
        )


def sparse_density(dtype: torch.dtype, backend: FusedBackend) -> float | None:
    """The densest chunk (fraction of its logits in ``S``) the forward stores for the sparse backward; ``None``:
    never. The torch sparse GEMMs (MKL/cuSPARSE, :func:`~safevocab.fused.sparse_backward.sparse_backward`) take
    fp32/fp64 only, so half inputs use the dense backward there; a backend with its own ``sparse_backward`` (the
    Triton one) takes every dtype, at its own crossover (``KERNEL_SPARSE_MAX_DENSITY``)."""
    if hasattr(backend, "sparse_backward"):
        return KERNEL_SPARSE_MAX_DENSITY
    if dtype in (torch.float32, torch.float64):
        return SPARSE_MAX_DENSITY
    return None
