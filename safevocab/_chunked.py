"""Torch implementation of :func:`safevocab.fused_safe_logprobs`: chunked over rows, never ``[N, V]``.

Forward walks chunks of rows. For each it computes the chunk's logits (one GEMM in the inputs'
dtype, into a reused buffer), the rule's threshold and fp32 row statistics, and keeps ``O(N)``
numbers: the threshold, ``logsumexp`` over ``S`` and over the vocabulary, and the entropy.

Backward has two paths, chosen per row:

- **sparse** (the common case in RL): the logits gradient of ``log pi_S(y)`` and of the entropy of
  ``pi_S`` is zero outside ``S``. When a chunk's safe sets are small (at most
  ``SPARSE_MAX_DENSITY`` of the chunk's logits), forward also stores ``S`` as CSR (int32 column,
  fp32 ``log pi_S``: 8 bytes per kept logit), and backward runs two sparse GEMMs whose cost scales
  with ``|S|`` instead of ``V``: no recomputation of the logits, no dense gradient GEMMs.
- **dense**: rows whose gradient is not confined to ``S`` (a target outside ``S`` with a nonzero
  gradient, or a gradient on ``log_kept_mass``), or chunks whose safe sets are large, or half
  precision inputs: recompute the chunk's logits, rebuild ``S = {z >= t}`` from the saved
  threshold (no re-sort for top-p), form the logits gradient in place, and run the two gradient
  GEMMs with the weight gradient accumulated in fp32.

``backend="triton"`` keeps this structure and replaces the per-chunk torch passes (forward statistics,
dense logits gradient) with the Triton kernels of :mod:`safevocab.kernels`; the sparse backward stays here.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from safevocab.rules import SafeVocabRule

#: Largest fraction of a chunk's logits kept in ``S`` for which the sparse backward is used.
SPARSE_MAX_DENSITY = 1.0 / 16


@dataclass(frozen=True)
class Transform:
    """The sampler's logit transform: ``logit_scale``, then softcap, then ``/ temperature``."""

    temperature: float
    softcap: float | None
    logit_scale: float

    def apply_(self, z: torch.Tensor) -> torch.Tensor:
        """In-place transform of a scratch chunk."""
        if self.logit_scale != 1.0:
            z.mul_(self.logit_scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z

    def backward_(self, grad_z: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """In-place chain rule from transformed ``z`` back to raw logits.

        The softcap derivative ``1 - tanh^2`` is recovered from ``z`` itself
        (``tanh = z * temperature / softcap``), so no extra buffer of raw logits is kept.
        """
        if self.softcap is not None:
            tanh_sq = (z * (self.temperature / self.softcap)).square_()
            grad_z.mul_(tanh_sq.neg_().add_(1.0))
        scale = self.logit_scale / self.temperature
        if scale != 1.0:
            grad_z.mul_(scale)
        return grad_z


def chunk_rows_for(n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk's scratch fits ``max_chunk_bytes``."""
    # Live scratch per logit in the dense backward (the larger pass): fp32 z, fp32 probabilities or
    # gradient, fp32 entropy/softcap temporary, two bool masks, a cast copy for half inputs, the rule's own.
    per_logit = 3 * 4 + 2 + (in_bytes if in_bytes < 4 else 0) + rule.scratch_bytes_per_logit
    return max(1, min(n_rows, max_chunk_bytes // max(1, vocab * per_logit)))


class _ChunkLogits:
    """Computes transformed logits of a chunk of rows into one reused buffer (no page faults per chunk)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: Transform, rows: int):
        self.weight_t, self.bias, self.transform = weight.t(), bias, transform
        stat = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        vocab = weight.shape[0]
        self.buf = torch.empty(rows, vocab, device=hidden.device, dtype=stat)
        self.raw = None if hidden.dtype == stat else torch.empty(rows, vocab, device=hidden.device, dtype=hidden.dtype)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        out = self.buf[:n] if self.raw is None else self.raw[:n]
        if self.bias is None:
            torch.mm(h, self.weight_t, out=out)
        else:
            torch.addmm(self.bias, h, self.weight_t, out=out)
        z = self.buf[:n]
        if self.raw is not None:
            z.copy_(out)  # the GEMM rounds to the inputs' dtype, exactly as materialised logits would be
        return self.transform.apply_(z)


@dataclass
class _SparseChunk:
    """The safe sets of one chunk of rows, as CSR: ``log pi_S`` at the kept columns."""

    start: int
    counts: torch.Tensor  # [n] int64, |S| per row
    cols: torch.Tensor  # [nnz] int32
    log_p: torch.Tensor  # [nnz] stats dtype, log pi_S(col)


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
        backend: str = "torch",  # "torch" or "triton" (resolved by fused_safe_logprobs)
        weight_gather=None,  # sharded-weight hook: zero-arg factory of a context manager, or None
    ):
        ctx.set_materialize_grads(False)
        ctx.weight_gather = weight_gather
        n_rows, device = hidden.shape[0], hidden.device
        stat = dict(device=device, dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        target_logit = torch.empty(n_rows, **stat)
        lse_safe = torch.empty(n_rows, **stat)
        lse_full = torch.empty(n_rows, **stat)
        threshold = torch.empty(n_rows, **stat)
        entropy = torch.empty(n_rows, **stat) if compute_entropy else None
        in_safe = torch.empty(n_rows, device=device, dtype=torch.bool)
        safe_size = torch.empty(n_rows, device=device, dtype=torch.int64)
        # MKL/cuSPARSE sparse GEMMs take fp32/fp64 only; half inputs use the dense backward.
        sparse_ok = hidden.dtype in (torch.float32, torch.float64)

        stats = (target_logit, lse_safe, lse_full, threshold, entropy, in_safe, safe_size)
        density = SPARSE_MAX_DENSITY if sparse_ok else None
        if backend == "triton":  # the Triton kernels fold every chunk (safevocab/kernels)
            from safevocab.kernels.fused import triton_forward

            sparse_chunks = triton_forward(hidden, weight, bias, targets, rule, transform, chunk_rows, stats, density)
        else:
            sparse_chunks = _torch_forward(hidden, weight, bias, targets, rule, transform, chunk_rows, stats, density)
        logprobs = torch.where(in_safe, target_logit - lse_safe, target_logit - lse_full)
        log_kept = lse_safe - lse_full

        ctx.save_for_backward(hidden, weight, bias, targets, threshold, lse_safe, lse_full, in_safe, entropy)
        ctx.sparse_chunks = sparse_chunks
        ctx.transform = transform
        ctx.chunk_rows = chunk_rows
        ctx.backend, ctx.rule = backend, rule
        ctx.mark_non_differentiable(in_safe, safe_size)
        return logprobs, log_kept, entropy, in_safe, safe_size

    @staticmethod
    def backward(ctx, grad_logprobs, grad_log_kept, grad_entropy, _grad_in_safe, _grad_safe_size):  # type: ignore[override]
        if grad_logprobs is None and grad_log_kept is None and grad_entropy is None:
            return (None,) * 10
        # ---- sharded-weight hook: the backward re-reads the weight (sparse GEMMs and the dense
        # recomputation), so a weight gathered only for the forward (DeepSpeed ZeRO-3) is gathered again here.
        gather = contextlib.nullcontext() if ctx.weight_gather is None else ctx.weight_gather()
        with gather:
            return FusedSafeLogProbs._backward(ctx, grad_logprobs, grad_log_kept, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logprobs, grad_log_kept, grad_entropy):
        hidden, weight, bias, targets, threshold, lse_safe, lse_full, in_safe, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n_rows, stat = hidden.shape[0], lse_safe.dtype

        # Per-row coefficients of the logits gradient
        #   grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi,
        # with c_S = g_lp 1[y in S] - g_k and c_F = g_lp 1[y not in S] + g_k (g_k: log_kept_mass grad).
        zeros = torch.zeros(n_rows, device=hidden.device, dtype=stat)
        g_lp = grad_logprobs.to(stat) if grad_logprobs is not None else zeros
        g_k = grad_log_kept.to(stat) if grad_log_kept is not None else zeros
        g_ent = grad_entropy.to(stat) if grad_entropy is not None else None
        coef = _Coefficients(
            g_lp=g_lp,
            g_ent=g_ent,
            c_safe=torch.where(in_safe, g_lp, 0.0) - g_k,
            c_full=torch.where(in_safe, 0.0, g_lp) + g_k,
            lse_safe=lse_safe,
            lse_full=lse_full,
            entropy=entropy,
            threshold=threshold,
            targets=targets,
        )

        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=stat) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], device=weight.device, dtype=stat) if need_b else None
        grads = (grad_hidden, grad_weight, grad_bias)

        dense_rows = torch.ones(n_rows, device=hidden.device, dtype=torch.bool)
        for chunk in ctx.sparse_chunks:
            dense_rows[chunk.start : chunk.start + chunk.counts.shape[0]] = False
        # Rows whose gradient reaches outside S (c_F != 0) go dense even when S was stored.
        dense_rows |= coef.c_full != 0
        for chunk in ctx.sparse_chunks:
            _sparse_backward(chunk, hidden, weight, coef, dense_rows, ctx.transform, grads)
        dense_idx = dense_rows.nonzero().squeeze(-1)
        if dense_idx.numel():
            if ctx.backend == "triton":  # backend hook: the logits gradient from a Triton kernel
                from safevocab.kernels.fused import triton_dense_backward

                args = (dense_idx, hidden, weight, bias, coef, ctx.transform, ctx.chunk_rows, grads)
                triton_dense_backward(*args, ctx.rule)
            else:
                _dense_backward(dense_idx, hidden, weight, bias, coef, ctx.transform, ctx.chunk_rows, grads)

        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if need_w else None,
            grad_bias.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
            None,  # backend
            None,  # weight_gather
        )


def _torch_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rule: SafeVocabRule,
    transform: Transform,
    chunk_rows: int,
    stats: tuple,
    density: float | None,
) -> list[_SparseChunk]:
    """Fill the per-row ``stats`` chunk by chunk with torch passes; return the chunks whose safe sets are
    stored sparsely (at most ``density`` of a chunk's logits kept; ``None``: never)."""
    target_logit, lse_safe, lse_full, threshold, entropy, in_safe, safe_size = stats
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    sparse_chunks: list[_SparseChunk] = []
    if not n_rows:
        return sparse_chunks
    logits_of = _ChunkLogits(hidden, weight, bias, transform, min(chunk_rows, n_rows))
    drop_buf = torch.empty(min(chunk_rows, n_rows), vocab, device=hidden.device, dtype=torch.bool)
    for start in range(0, n_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n_rows))
        n = rows.stop - start
        z = logits_of(hidden[rows])
        t, z_max = rule.threshold_and_max(z)  # [n, 1] each
        target_logit[rows] = z.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
        in_safe[rows] = target_logit[rows] >= t.squeeze(-1)
        threshold[rows] = t.squeeze(-1)
        dropped = torch.lt(z.sub_(z_max), t - z_max, out=drop_buf[:n])  # z now holds z - z_max
        kept_per_row = vocab - dropped.sum(-1)
        safe_size[rows] = kept_per_row
        store_sparse = density is not None and int(kept_per_row.sum()) <= density * n * vocab
        if store_sparse:
            r, c = torch.logical_not(dropped).nonzero(as_tuple=True)
            shifted_kept = z[r, c]
        e = z.exp_()  # z now holds exp(z - z_max)
        sum_full = e.sum(-1)
        e.masked_fill_(dropped, 0.0)
        sum_safe = e.sum(-1)
        log_sum_safe = sum_safe.log()
        lse_safe[rows] = z_max.squeeze(-1) + log_sum_safe
        lse_full[rows] = z_max.squeeze(-1) + sum_full.log()
        if entropy is not None:
            # H(pi_S) = log sum_S e - sum_S e log e / sum_S e, with e = exp(z - z_max); xlogy(0, 0) = 0
            entropy[rows] = log_sum_safe - torch.special.xlogy(e, e).sum(-1) / sum_safe
        if store_sparse:
            sparse_chunks.append(
                _SparseChunk(start, kept_per_row, c.to(torch.int32), shifted_kept.sub_(log_sum_safe[r]))
            )
        del z, e, dropped
    return sparse_chunks


@dataclass
class _Coefficients:
    g_lp: torch.Tensor
    g_ent: torch.Tensor | None
    c_safe: torch.Tensor
    c_full: torch.Tensor
    lse_safe: torch.Tensor
    lse_full: torch.Tensor
    entropy: torch.Tensor | None
    threshold: torch.Tensor
    targets: torch.Tensor


def _sparse_backward(
    chunk: _SparseChunk,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    coef: _Coefficients,
    dense_rows: torch.Tensor,
    transform: Transform,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    grad_hidden, grad_weight, grad_bias = grads
    n = chunk.counts.shape[0]
    rows = slice(chunk.start, chunk.start + n)
    vocab = weight.shape[0]
    row_of = torch.repeat_interleave(torch.arange(n, device=hidden.device), chunk.counts)
    keep_row = ~dense_rows[rows]  # dense rows get their gradient from the dense path
    # -pi_S (c_S + g_H (log pi_S + H)) on S, then + g_lp at the target (which is in S for these rows)
    c_safe = torch.where(keep_row, coef.c_safe[rows], 0.0)
    per_entry = c_safe[row_of]
    if coef.g_ent is not None:
        g_ent = torch.where(keep_row, coef.g_ent[rows], 0.0)
        per_entry = per_entry + g_ent[row_of] * (chunk.log_p + coef.entropy[rows][row_of])
    vals = chunk.log_p.exp().mul_(per_entry).neg_()
    g_lp = torch.where(keep_row, coef.g_lp[rows], 0.0)
    is_target = chunk.cols == coef.targets[rows][row_of]
    vals += torch.where(is_target, g_lp[row_of], 0.0)
    # The softcap derivative needs the transformed logits at the kept entries: log pi_S + lse_S.
    z = chunk.log_p + coef.lse_safe[rows][row_of] if transform.softcap is not None else vals
    vals = transform.backward_(vals, z)

    crow = torch.zeros(n + 1, device=hidden.device, dtype=torch.int32)
    torch.cumsum(chunk.counts, 0, out=crow[1:])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        if grad_hidden is not None:
            g = torch.sparse_csr_tensor(crow, chunk.cols, vals, size=(n, vocab), check_invariants=False)
            grad_hidden[rows] = torch.sparse.mm(g, weight)
        if grad_weight is not None:
            # G^T as CSR: entries sorted by column (a stable sort keeps rows ascending within a column)
            order = torch.argsort(chunk.cols, stable=True)
            crow_t = torch.zeros(vocab + 1, device=hidden.device, dtype=torch.int32)
            torch.cumsum(torch.bincount(chunk.cols, minlength=vocab), 0, out=crow_t[1:])
            g_t = torch.sparse_csr_tensor(
                crow_t, row_of[order].to(torch.int32), vals[order], size=(vocab, n), check_invariants=False
            )
            grad_weight.addmm_(g_t, hidden[rows])
    if grad_bias is not None:
        grad_bias.index_add_(0, chunk.cols.long(), vals)


def _dense_backward(
    idx: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    coef: _Coefficients,
    transform: Transform,
    chunk_rows: int,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    grad_hidden, grad_weight, grad_bias = grads
    logits_of = _ChunkLogits(hidden, weight, bias, transform, min(chunk_rows, idx.numel()))
    for start in range(0, idx.numel(), chunk_rows):
        rows = idx[start : start + chunk_rows]
        h = hidden.index_select(0, rows)
        z = logits_of(h)
        dropped = z < coef.threshold[rows].unsqueeze(-1)
        grad = z - coef.lse_safe[rows].unsqueeze(-1)  # log pi_S on S
        c_safe = coef.c_safe[rows].unsqueeze(-1)
        if coef.g_ent is not None:
            per_logit = (grad + coef.entropy[rows].unsqueeze(-1)).mul_(coef.g_ent[rows].unsqueeze(-1))
            per_logit.add_(c_safe).masked_fill_(dropped, 0.0)  # no 0 * -inf below
            grad.exp_().masked_fill_(dropped, 0.0).mul_(per_logit).neg_()
            del per_logit
        else:
            grad.exp_().masked_fill_(dropped, 0.0).mul_(c_safe.neg())
        c_full = coef.c_full[rows]
        if bool((c_full != 0).any()):
            p_full = (z - coef.lse_full[rows].unsqueeze(-1)).exp_()
            grad.sub_(p_full.mul_(c_full.unsqueeze(-1)))
            del p_full
        grad.scatter_add_(-1, coef.targets[rows].unsqueeze(-1), coef.g_lp[rows].unsqueeze(-1))
        grad = transform.backward_(grad, z)
        del z, dropped
        if grad_bias is not None:
            grad_bias += grad.sum(0)
        g_in = grad.to(hidden.dtype)
        if grad_hidden is not None:
            grad_hidden.index_copy_(0, rows, g_in @ weight)
        if grad_weight is not None:
            # fp32 accumulation across chunks (rounding each chunk's product to bf16 biases training)
            grad_weight.addmm_(grad.t(), h.to(grad.dtype))
        del grad, g_in

