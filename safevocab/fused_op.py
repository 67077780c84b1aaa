"""The fused LM head + safe log-softmax as one autograd function over chunks of rows, never ``[N, V]``.

:class:`FusedSafeLogProbs` computes, per row with target ``y``, transformed logits ``z`` (maximum ``m``)
and safe set ``S = {z >= t}``::

    log pi_S(y) = (z_y - m) - log sum_S exp(z - m)      (max-shifted: huge logits lose no precision)

(the full log-softmax for ``y`` outside ``S``), ``log_kept_mass = log sum_S exp(z - m) - log sum_V exp(z - m)``
and the entropy of ``pi_S``. A *backend* object (:class:`safevocab.backends.protocol.FusedBackend`: the
torch passes of :mod:`safevocab.backends.torch_backend` or the Triton kernels of
:mod:`safevocab.backends.triton_backend`) folds each chunk; this module owns the bookkeeping around it.

Backward forms ``grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi`` (see
:class:`~safevocab.chunking.Coefficients`) in two parts:

- the **safe-set part** ``-pi_S (...) + g_lp 1[a=y in S]`` depends on ``S``. It must use exactly the
  forward's ``S``, whatever the layout, dtype, chunking or backend:

  - **sparse** (the common case in RL): when a chunk's safe sets are small (at most
    ``SPARSE_MAX_DENSITY`` of its logits; ``KERNEL_SPARSE_MAX_DENSITY`` on the Triton backend), forward stores
    ``S`` itself as CSR (int32 column, fp32 ``z - m``: 8 bytes per kept logit), and backward runs two sparse
    GEMMs whose cost scales with ``|S|``: no recomputation at all (:func:`sparse_backward`), or the backend's own
    ``sparse_backward`` when it has one (the Triton backend: :mod:`safevocab.kernels.sparse_backward`, any input
    dtype; :func:`sparse_density`).
  - **dense** (chunks with large safe sets; half-precision inputs on the torch backend): the backend recomputes the chunk's
    logits with the *same call on the same operands* as the forward (the same row slice of ``hidden``, the
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

fp16 inputs: each row's logits gradient is at most ``(|g_lp| + |c_S| + |c_F| + |g_H| (1/e + H)) s``
(``s = logit_scale / T``; :meth:`~safevocab.chunking.Coefficients.logits_grad_bound`), which leaves fp16's
range once ``1/T`` nears 65504 while the gradients of ``hidden`` and ``weight`` may still fit. The backends
then write it divided by a power of two ``2^k`` that brings the bound under ``2^14``
(:func:`~safevocab.chunking.fp16_grad_shift`, ``Coefficients.grad_shift``) and multiply the GEMM products
by ``2^k`` (exact): finite gradients wherever the true ones fit fp16. ``k = 0`` otherwise.

Non-finite input is detected from the row statistics (a non-finite ``m`` or ``log sum_V``) and raised as a
one-line ``ValueError`` naming the argument (:func:`raise_on_non_finite_rows`).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from safevocab.backends.protocol import FusedBackend
from safevocab.chunking import (
    Coefficients,
    RowStats,
    SparseChunk,
    Transform,
    chunk_slices,
    fp16_grad_shift,
)
from safevocab.rules import SafeVocabRule
from safevocab.support import SafeSupport
from safevocab.threads import single_threaded

__all__ = [
    "FusedSafeLogProbs",
    "KERNEL_SPARSE_MAX_DENSITY",
    "SPARSE_MAX_DENSITY",
    "sparse_backward",
    "sparse_density",
    "raise_on_empty_support",
    "raise_on_non_finite_rows",
]

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
    ):
        ctx.set_materialize_grads(False)
        ctx.weight_gather = weight_gather
        n_rows = hidden.shape[0]
        stat_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        stats = RowStats.empty(n_rows, hidden.device, stat_dtype, compute_entropy, replay=support is not None)
        density = sparse_density(hidden.dtype, backend)
        # A -inf weight entry times positive hidden values gives a -inf logit, which reads as a banned token and
        # leaves every row statistic finite: the weight's extremes (one read in its own dtype, no [V, H] temporary,
        # checked at the statistics' sync; NaN propagates through them) show it
        weight_range = torch.stack(torch.aminmax(weight))
        if support is None:
            sparse_chunks = backend.forward(hidden, weight, bias, targets, rule, transform, chunk_rows, stats, density)
        else:
            sparse_chunks = backend.forward(
                hidden, weight, bias, targets, rule, transform, chunk_rows, stats, density, support
            )
        raise_on_non_finite_rows(stats, hidden, weight, bias, transform, weight_range)
        if support is not None:
            raise_on_empty_support(stats.safe_size, rule)
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
        ctx.weight_shape = tuple(weight.shape)
        ctx.transform = transform
        ctx.chunk_rows = chunk_rows
        ctx.backend, ctx.rule, ctx.support = backend, rule, support
        ctx.mark_non_differentiable(stats.in_safe, stats.safe_size)
        return logprobs, log_kept, stats.entropy, stats.in_safe, stats.safe_size

    @staticmethod
    def backward(ctx, grad_logprobs, grad_log_kept, grad_entropy, _grad_in_safe, _grad_safe_size):  # type: ignore[override]
        if grad_logprobs is None and grad_log_kept is None and grad_entropy is None:
            return (None,) * 11
        # ---- sharded-weight hook: the backward re-reads the weight (sparse GEMMs and the dense
        # recomputation), so a weight gathered only for the forward (DeepSpeed ZeRO-3) is gathered again here.
        gather = contextlib.nullcontext() if ctx.weight_gather is None else ctx.weight_gather()
        with gather:
            return FusedSafeLogProbs._backward(ctx, grad_logprobs, grad_log_kept, grad_entropy)

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
        dense_chunks = [rows for rows in chunk_slices(n_rows, ctx.chunk_rows) if rows.start not in sparse_starts]
        # Full-softmax part of sparse-chunk rows whose gradient leaves S (the dense chunks include it).
        leaves = in_sparse & ((coef.c_full != 0) | (coef.g_target_out != 0))
        full_idx = leaves.nonzero().squeeze(-1)
        backend_sparse = getattr(ctx.backend, "sparse_backward", None)  # the backend's own sparse backward, if any

        # fp32 for half inputs: every chunk's dX product is accumulated in fp32 and rounded once, on return
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=stat) if need_h else None
        # fp32 accumulators, except where only the backend's sparse backward writes (each row once, no GEMM sums)
        sparse_only = backend_sparse is not None and not dense_chunks and not full_idx.numel()
        w_acc = weight.dtype if sparse_only else stat
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=w_acc) if need_w else None
        b_acc = bias.dtype if sparse_only and need_b else stat
        grad_bias = torch.zeros(weight.shape[0], device=weight.device, dtype=b_acc) if need_b else None
        grads = (grad_hidden, grad_weight, grad_bias)

        # Safe-set part: the stored S of sparse chunks, or an exact recomputation of the other chunks.
        if backend_sparse is not None:
            backend_sparse(ctx.sparse_chunks, hidden, weight, coef, ctx.transform, grads)
        else:
            for chunk in ctx.sparse_chunks:
                sparse_backward(chunk, hidden, weight, coef, ctx.transform, grads)
        if dense_chunks:
            args = (dense_chunks, hidden, weight, bias, coef, ctx.transform, ctx.chunk_rows, grads, ctx.rule)
            if ctx.support is None:
                ctx.backend.dense_backward(*args)
            else:
                ctx.backend.dense_backward(*args, ctx.support)
        if full_idx.numel():
            ctx.backend.full_softmax_backward(
                full_idx, hidden, weight, bias, coef, ctx.transform, ctx.chunk_rows, grads, ctx.rule
            )

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
        )


def sparse_density(dtype: torch.dtype, backend: FusedBackend) -> float | None:
    """The densest chunk (fraction of its logits in ``S``) the forward stores for the sparse backward; ``None``:
    never. The torch sparse GEMMs (MKL/cuSPARSE, :func:`sparse_backward`) take fp32/fp64 only, so half inputs use
    the dense backward there; a backend with its own ``sparse_backward`` (the Triton one) takes every dtype, at its
    own crossover (``KERNEL_SPARSE_MAX_DENSITY``)."""
    if hasattr(backend, "sparse_backward"):
        return KERNEL_SPARSE_MAX_DENSITY
    if dtype in (torch.float32, torch.float64):
        return SPARSE_MAX_DENSITY
    return None


def raise_on_empty_support(safe_size: torch.Tensor, rule: SafeVocabRule) -> None:
    """One-line ``ValueError`` naming the first row whose replayed support keeps nothing (after the rule and
    the tokens of probability 0)."""
    empty = safe_size == 0
    if bool(empty.any()):
        raise ValueError(
            f"support row {int(empty.nonzero()[0])} keeps no token of nonzero probability under rule {str(rule)!r}: "
            "accepted a support that meets the rule's set"
        )


def raise_on_non_finite_rows(
    stats: RowStats,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: Transform,
    weight_range: torch.Tensor | None = None,
) -> None:
    """Raise a one-line ``ValueError`` naming the argument when a row's statistics are not finite.

    A NaN or ``+inf`` logit, an all ``-inf`` row or an overflowing GEMM or transform make the row maximum
    or ``log sum_V exp(z - m)`` non-finite; checking those ``[N]`` statistics costs nothing next to a pass
    over ``[N, V]``. Finding *which* argument caused it runs only here, on the error path.

    ``weight_range`` (the weight's minimum and maximum, read once per call): a ``-inf`` weight entry times positive
    hidden values gives a ``-inf`` logit, a banned token to the statistics, which stay finite; a non-finite extreme
    shows it (issue 37).
    """
    bad = ~(torch.isfinite(stats.row_max) & torch.isfinite(stats.log_sum_full))
    weight_bad = False if weight_range is None else ~torch.isfinite(weight_range).all()
    if not bool(bad.any() | weight_bad):  # one sync for both
        return
    if not bool(bad.any()):  # finite statistics: a -inf weight entry that made only -inf logits
        _raise_on_non_finite_weight(weight)
    row = int(bad.nonzero()[0])
    h = hidden[row]
    where = f"(row {row} of {hidden.shape[0]})"
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"hidden has a non-finite value (NaN or inf) {where}: accepted finite hidden states")
    _raise_on_non_finite_weight(weight)
    raw = h.double() @ weight.double().t()
    if bias is not None:
        raw = raw + bias.double()
        if not bool((bias != -torch.inf).any()):
            raise ValueError("bias is -inf for every token: no token has a probability > 0")
    limit = torch.finfo(hidden.dtype).max
    peak = float(raw[torch.isfinite(raw)].abs().max()) if bool(torch.isfinite(raw).any()) else 0.0
    if peak > limit:
        raise ValueError(
            f"hidden @ weight.T overflows {hidden.dtype} {where}: |logit| up to {peak:.4g} > {limit:.4g}; "
            "use bfloat16/float32 inputs (an fp32 LM head) for this model"
        )
    raise ValueError(
        f"temperature={transform.temperature!r} with logit_scale={transform.logit_scale!r} makes the logits overflow "
        f"{stats.row_max.dtype} {where}: |logit| up to {peak:.4g} gives |logit| * logit_scale / temperature > "
        f"{torch.finfo(stats.row_max.dtype).max:.4g}; accepted a larger temperature"
    )


def _raise_on_non_finite_weight(weight: torch.Tensor) -> None:
    finite_weight = torch.isfinite(weight).all(dim=-1)
    if not bool(finite_weight.all()):
        token = int((~finite_weight).nonzero()[0])
        raise ValueError(
            f"weight has a non-finite value (NaN or inf) in row {token} (token id): accepted finite weights"
        )


def sparse_backward(
    chunk: SparseChunk,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    coef: Coefficients,
    transform: Transform,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """Safe-set part of the gradient of a chunk whose ``S`` was stored: two sparse GEMMs.

    The ``O(|S|)`` element-wise work runs on one thread (:mod:`safevocab.threads`); the two products keep the
    caller's threads."""
    grad_hidden, grad_weight, grad_bias = grads
    n = chunk.counts.shape[0]
    rows = slice(chunk.start, chunk.start + n)
    vocab = weight.shape[0]
    with single_threaded(hidden.device):
        row_of = torch.repeat_interleave(torch.arange(n, device=hidden.device), chunk.counts)

        def per_row(x: torch.Tensor) -> torch.Tensor:
            return x[rows].index_select(0, row_of)

        log_p = chunk.shifted - per_row(coef.log_sum_safe)  # log pi_S
        # -pi_S (c_S + g_H (log pi_S + H)) on S, then + g_lp at the target when it is in S
        per_entry = per_row(coef.c_safe)
        if coef.g_ent is not None:
            per_entry = per_entry + per_row(coef.g_ent) * (log_p + per_row(coef.entropy))
        vals = log_p.exp_().mul_(per_entry).neg_()
        is_target = chunk.cols == per_row(coef.targets)
        vals += torch.where(is_target, per_row(coef.g_lp), 0.0)
        # The softcap derivative needs the transformed logits at the kept entries: (z - m) + m.
        z = chunk.shifted + per_row(coef.set_max) if transform.softcap is not None else vals
        vals = transform.backward_(vals, z)
        crow = torch.zeros(n + 1, device=hidden.device, dtype=torch.int32)
        torch.cumsum(chunk.counts, 0, out=crow[1:])
        if grad_weight is not None:
            # G^T as CSR: entries sorted by column (a stable sort keeps rows ascending within a column)
            order = torch.argsort(chunk.cols, stable=True)
            crow_t = torch.zeros(vocab + 1, device=hidden.device, dtype=torch.int32)
            torch.cumsum(torch.bincount(chunk.cols, minlength=vocab), 0, out=crow_t[1:])
            rows_t, vals_t = row_of.index_select(0, order).to(torch.int32), vals.index_select(0, order)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        if grad_hidden is not None:
            if hidden.device.type == "cpu":
                # sum_j vals_j W[col_j] per row: embedding_bag's gather-and-sum runs ~1.7x faster than MKL's CSR @ dense
                # here (|S| ~ 4% of 32k), which costs as much as the dense GEMM
                grad_hidden[rows] += F.embedding_bag(chunk.cols, weight, crow[:-1], per_sample_weights=vals, mode="sum")
            else:
                g = torch.sparse_csr_tensor(crow, chunk.cols, vals, size=(n, vocab), check_invariants=False)
                grad_hidden[rows] += torch.sparse.mm(g, weight)
        if grad_weight is not None:
            g_t = torch.sparse_csr_tensor(crow_t, rows_t, vals_t, size=(vocab, n), check_invariants=False)
            grad_weight.addmm_(g_t, hidden[rows])
    if grad_bias is not None:
        grad_bias.index_add_(0, chunk.cols.long(), vals)
