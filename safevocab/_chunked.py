"""Torch implementation of :func:`safevocab.fused_safe_logprobs`: chunked over rows, never ``[N, V]``.

Forward walks chunks of rows. For each it computes the chunk's logits (one GEMM in the inputs'
dtype, into a reused buffer), the rule's threshold ``t`` and fp32 row statistics, and keeps ``O(N)``
numbers, all **max-shifted** so that huge logits (tiny temperatures) lose no precision: the row
maximum ``m``, ``z_y - m``, ``log sum_S exp(z - m)``, ``log sum_V exp(z - m)``, ``t``, ``|S|`` and the
entropy. Then ``log pi_S(y) = (z_y - m) - log sum_S exp(z - m)``.

Backward forms ``grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi`` (see
:class:`Coefficients`) in two parts:

- the **safe-set part** ``-pi_S (...) + g_lp 1[a=y in S]`` depends on ``S``. It must use exactly the
  forward's ``S``, whatever the layout, dtype, chunking or backend:

  - **sparse** (the common case in RL): when a chunk's safe sets are small (at most
    ``SPARSE_MAX_DENSITY`` of its logits), forward stores ``S`` itself as CSR (int32 column, fp32
    ``z - m``: 8 bytes per kept logit), and backward runs two sparse GEMMs whose cost scales with
    ``|S|``: no recomputation at all.
  - **dense** (chunks with large safe sets, half-precision inputs): recompute the chunk's logits with
    the *same call on the same operands* as the forward (the same row slice of ``hidden``, the same
    buffer shape: BLAS results depend on layout and alignment, and a boundary token one ulp off would
    leave ``S``), rebuild ``S = {z >= t}``, and check it against the saved ``|S|``; a row whose count
    differs (it cannot on a deterministic BLAS) gets the ``|S|`` largest logits instead.
- the **full-softmax part** ``-c_F pi + g_lp 1[a=y not in S]`` (targets outside ``S`` with a gradient,
  or a gradient on ``log_kept_mass``) does not depend on ``S``: rows of sparse chunks that need it
  recompute only their own logits.

``backend="triton"`` keeps this structure and replaces the per-chunk torch passes (forward statistics,
dense logits gradient) with the Triton kernels of :mod:`safevocab.kernels`; the sparse backward and the
full-softmax part stay here.
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
    """The sampler's logit transform: ``logit_scale``, then softcap, then ``/ temperature``.

    ``-inf`` logits stay ``-inf`` through the softcap (``c * tanh(-inf / c)`` would be the finite
    ``-c``): a token of probability 0 never enters ``S``.
    """

    temperature: float
    softcap: float | None
    logit_scale: float

    def apply_(self, z: torch.Tensor, neg_inf_cols: torch.Tensor | None = None) -> torch.Tensor:
        """In-place transform of a scratch chunk ``[n, V]``; ``neg_inf_cols``: columns whose raw logit is
        ``-inf`` in every row (a ``-inf`` bias entry), restored to ``-inf`` after a softcap."""
        if self.logit_scale != 1.0:
            z.mul_(self.logit_scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
            if neg_inf_cols is not None and neg_inf_cols.numel():
                z.index_fill_(-1, neg_inf_cols, -torch.inf)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z

    def backward_(self, grad_z: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """In-place chain rule from transformed ``z`` back to raw logits.

        The softcap derivative ``1 - tanh^2`` is recovered from ``z`` itself
        (``tanh = z * temperature / softcap``), so no extra buffer of raw logits is kept. ``tanh^2`` is
        clamped to 1 (its true range), which makes the derivative 0, not ``-inf``, at ``-inf`` logits.
        """
        if self.softcap is not None:
            tanh_sq = (z * (self.temperature / self.softcap)).square_().clamp_(max=1.0)
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


def chunk_slices(n_rows: int, chunk_rows: int) -> list[slice]:
    """The row slices of the chunks, identical in forward and backward."""
    return [slice(start, min(start + chunk_rows, n_rows)) for start in range(0, n_rows, chunk_rows)]


class ChunkLogits:
    """Computes transformed logits of a chunk of rows into one reused buffer (no page faults per chunk).

    Forward and backward build one each with the same ``rows`` and call it on the same row slices of
    ``hidden``, so a recomputed chunk is bit-identical to the forward's.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: Transform, rows: int):
        self.weight_t, self.bias, self.transform = weight.t(), bias, transform
        stat = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        vocab = weight.shape[0]
        self.buf = torch.empty(rows, vocab, device=hidden.device, dtype=stat)
        self.raw = None if hidden.dtype == stat else torch.empty(rows, vocab, device=hidden.device, dtype=hidden.dtype)
        self.neg_inf_cols = None
        if bias is not None and transform.softcap is not None:
            self.neg_inf_cols = (bias == -torch.inf).nonzero().squeeze(-1)

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
        return self.transform.apply_(z, self.neg_inf_cols)


@dataclass
class SparseChunk:
    """The safe sets of one chunk of rows, as CSR: the shifted logits ``z - m`` at the kept columns.

    ``log pi_S = (z - m) - log sum_S exp(z - m)`` and, for the softcap derivative, ``z = (z - m) + m``
    are both recovered to ``z``'s own precision (storing ``log pi_S`` instead would lose ``z - m`` to
    the rounding of ``log sum_S``, which dominates when the logits are tiny, e.g. at large temperatures).
    """

    start: int
    counts: torch.Tensor  # [n] int64, |S| per row
    cols: torch.Tensor  # [nnz] int32
    shifted: torch.Tensor  # [nnz] stats dtype, z - m


@dataclass
class RowStats:
    """Per-row outputs of the forward (each ``[N]``), written chunk by chunk by a backend.

    Max-shifted: with ``m`` the row maximum of the transformed logits ``z``,
    ``lse_S = m + log_sum_safe`` and ``lse_V = m + log_sum_full``, but the sums are never formed, so
    ``z_y - lse_S`` keeps full precision when ``|m|`` is huge.
    """

    target_shift: torch.Tensor  # z_y - m
    log_sum_safe: torch.Tensor  # log sum_S exp(z - m)
    log_sum_full: torch.Tensor  # log sum_V exp(z - m)
    row_max: torch.Tensor  # m
    threshold: torch.Tensor  # t: S = {z >= t}
    entropy: torch.Tensor | None  # H(pi_S)
    in_safe: torch.Tensor  # bool, z_y >= t
    safe_size: torch.Tensor  # int64, |S|

    @staticmethod
    def empty(n_rows: int, device: torch.device, dtype: torch.dtype, compute_entropy: bool) -> RowStats:
        def new() -> torch.Tensor:
            return torch.empty(n_rows, device=device, dtype=dtype)

        return RowStats(
            target_shift=new(),
            log_sum_safe=new(),
            log_sum_full=new(),
            row_max=new(),
            threshold=new(),
            entropy=new() if compute_entropy else None,
            in_safe=torch.empty(n_rows, device=device, dtype=torch.bool),
            safe_size=torch.empty(n_rows, device=device, dtype=torch.int64),
        )

    def rows(self, rows: slice) -> dict[str, torch.Tensor | None]:
        """Views of every field on a row slice (keyword arguments of the forward kernel)."""
        return {name: (None if t is None else t[rows]) for name, t in vars(self).items()}


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
        n_rows = hidden.shape[0]
        stat_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        stats = RowStats.empty(n_rows, hidden.device, stat_dtype, compute_entropy)
        # MKL/cuSPARSE sparse GEMMs take fp32/fp64 only; half inputs use the dense backward.
        density = SPARSE_MAX_DENSITY if hidden.dtype in (torch.float32, torch.float64) else None
        if backend == "triton":  # the Triton kernels fold every chunk (safevocab/kernels)
            from safevocab.kernels.fused import triton_forward

            sparse_chunks = triton_forward(hidden, weight, bias, targets, rule, transform, chunk_rows, stats, density)
        else:
            sparse_chunks = _torch_forward(hidden, weight, bias, targets, rule, transform, chunk_rows, stats, density)
        _raise_on_non_finite_rows(stats, hidden, weight, bias, transform)
        logprobs = torch.where(
            stats.in_safe, stats.target_shift - stats.log_sum_safe, stats.target_shift - stats.log_sum_full
        )
        log_kept = stats.log_sum_safe - stats.log_sum_full

        ctx.save_for_backward(
            hidden, weight, bias, targets, stats.threshold, stats.row_max, stats.log_sum_safe, stats.log_sum_full,
            stats.in_safe, stats.safe_size, stats.entropy,
        )
        ctx.sparse_chunks = sparse_chunks
        ctx.transform = transform
        ctx.chunk_rows = chunk_rows
        ctx.backend, ctx.rule = backend, rule
        ctx.mark_non_differentiable(stats.in_safe, stats.safe_size)
        return logprobs, log_kept, stats.entropy, stats.in_safe, stats.safe_size

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
        (hidden, weight, bias, targets, threshold, row_max, log_sum_safe, log_sum_full, in_safe, safe_size,
         entropy) = ctx.saved_tensors
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
            log_sum_safe=log_sum_safe,
            log_sum_full=log_sum_full,
            entropy=entropy,
            threshold=threshold,
            safe_size=safe_size,
            targets=targets,
        )

        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=stat) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], device=weight.device, dtype=stat) if need_b else None
        grads = (grad_hidden, grad_weight, grad_bias)

        # Safe-set part: the stored S of sparse chunks, or an exact recomputation of the other chunks.
        sparse_starts = set()
        in_sparse = torch.zeros(n_rows, device=hidden.device, dtype=torch.bool)
        for chunk in ctx.sparse_chunks:
            _sparse_backward(chunk, hidden, weight, coef, ctx.transform, grads)
            sparse_starts.add(chunk.start)
            in_sparse[chunk.start : chunk.start + chunk.counts.shape[0]] = True
        dense_chunks = [rows for rows in chunk_slices(n_rows, ctx.chunk_rows) if rows.start not in sparse_starts]
        if dense_chunks:
            if ctx.backend == "triton":  # backend hook: the logits gradient from a Triton kernel
                from safevocab.kernels.fused import triton_dense_backward

                triton_dense_backward(dense_chunks, hidden, weight, bias, coef, ctx.transform, ctx.chunk_rows, grads, ctx.rule)
            else:
                _dense_backward(dense_chunks, hidden, weight, bias, coef, ctx.transform, ctx.chunk_rows, grads)
        # Full-softmax part of sparse-chunk rows whose gradient leaves S (the dense chunks include it).
        leaves = in_sparse & ((coef.c_full != 0) | (coef.g_target_out != 0))
        full_idx = leaves.nonzero().squeeze(-1)
        if full_idx.numel():
            _full_softmax_backward(full_idx, hidden, weight, bias, coef, ctx.transform, ctx.chunk_rows, grads)

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


def _raise_on_non_finite_rows(
    stats: RowStats, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: Transform
) -> None:
    """Raise a one-line ``ValueError`` naming the argument when a row's statistics are not finite.

    A NaN or ``+inf`` logit, an all ``-inf`` row or an overflowing GEMM or transform make the row maximum
    or ``log sum_V exp(z - m)`` non-finite; checking those ``[N]`` statistics costs nothing next to a pass
    over ``[N, V]``. Finding *which* argument caused it runs only here, on the error path.
    """
    bad = ~(torch.isfinite(stats.row_max) & torch.isfinite(stats.log_sum_full))
    if not bool(bad.any()):
        return
    row = int(bad.nonzero()[0])
    h = hidden[row]
    where = f"(row {row} of {hidden.shape[0]})"
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"hidden has a non-finite value (NaN or inf) {where}: accepted finite hidden states")
    finite_weight = torch.isfinite(weight).all(dim=-1)
    if not bool(finite_weight.all()):
        token = int((~finite_weight).nonzero()[0])
        raise ValueError(f"weight has a non-finite value (NaN or inf) in row {token} (token id): accepted finite weights")
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


def _torch_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rule: SafeVocabRule,
    transform: Transform,
    chunk_rows: int,
    stats: RowStats,
    density: float | None,
) -> list[SparseChunk]:
    """Fill ``stats`` chunk by chunk with torch passes; return the chunks whose safe sets are stored
    sparsely (at most ``density`` of a chunk's logits kept; ``None``: never)."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    sparse_chunks: list[SparseChunk] = []
    if not n_rows:
        return sparse_chunks
    logits_of = ChunkLogits(hidden, weight, bias, transform, min(chunk_rows, n_rows))
    drop_buf = torch.empty(min(chunk_rows, n_rows), vocab, device=hidden.device, dtype=torch.bool)
    for rows in chunk_slices(n_rows, chunk_rows):
        n = rows.stop - rows.start
        z = logits_of(hidden[rows])
        t, z_max = rule.threshold_and_max(z)  # [n, 1] each
        z_y = z.gather(-1, targets[rows].unsqueeze(-1))
        stats.in_safe[rows] = (z_y >= t).squeeze(-1)
        stats.threshold[rows] = t.squeeze(-1)
        stats.row_max[rows] = z_max.squeeze(-1)
        stats.target_shift[rows] = (z_y - z_max).squeeze(-1)
        # S = {z >= t} on the unshifted logits, as the backward and in_safe decide it (z - m < t - m
        # could round a boundary token the other way).
        dropped = torch.lt(z, t, out=drop_buf[:n])
        kept_per_row = vocab - dropped.sum(-1)
        stats.safe_size[rows] = kept_per_row
        z.sub_(z_max)  # z now holds z - m
        store_sparse = density is not None and int(kept_per_row.sum()) <= density * n * vocab
        if store_sparse:
            r, c = torch.logical_not(dropped).nonzero(as_tuple=True)
            shifted_kept = z[r, c]
        e = z.exp_()  # z now holds exp(z - m)
        sum_full = e.sum(-1)
        e.masked_fill_(dropped, 0.0)
        sum_safe = e.sum(-1)
        log_sum_safe = sum_safe.log()
        stats.log_sum_safe[rows] = log_sum_safe
        stats.log_sum_full[rows] = sum_full.log()
        if stats.entropy is not None:
            # H(pi_S) = log sum_S e - sum_S e log e / sum_S e, with e = exp(z - m); xlogy(0, 0) = 0
            stats.entropy[rows] = log_sum_safe - torch.special.xlogy(e, e).sum(-1) / sum_safe
        if store_sparse:
            sparse_chunks.append(SparseChunk(rows.start, kept_per_row, c.to(torch.int32), shifted_kept))
        del z, e, dropped
    return sparse_chunks


@dataclass
class Coefficients:
    """Per-row backward coefficients (each ``[N]``, stats dtype) and the forward statistics they need.

    ``grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi`` with
    ``c_S = g_lp 1[y in S] - g_k`` and ``c_F = g_lp 1[y not in S] + g_k`` (``g_k``: the
    ``log_kept_mass`` gradient); ``g_target_out = g_lp 1[y not in S]`` is the target term of the
    full-softmax part.
    """

    g_lp: torch.Tensor
    g_ent: torch.Tensor | None
    c_safe: torch.Tensor
    c_full: torch.Tensor
    g_target_out: torch.Tensor
    row_max: torch.Tensor
    log_sum_safe: torch.Tensor
    log_sum_full: torch.Tensor
    entropy: torch.Tensor | None
    threshold: torch.Tensor
    safe_size: torch.Tensor
    targets: torch.Tensor


def _sparse_backward(
    chunk: SparseChunk,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    coef: Coefficients,
    transform: Transform,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """Safe-set part of the gradient of a chunk whose ``S`` was stored: two sparse GEMMs."""
    grad_hidden, grad_weight, grad_bias = grads
    n = chunk.counts.shape[0]
    rows = slice(chunk.start, chunk.start + n)
    vocab = weight.shape[0]
    row_of = torch.repeat_interleave(torch.arange(n, device=hidden.device), chunk.counts)
    log_p = chunk.shifted - coef.log_sum_safe[rows][row_of]  # log pi_S
    # -pi_S (c_S + g_H (log pi_S + H)) on S, then + g_lp at the target when it is in S
    per_entry = coef.c_safe[rows][row_of]
    if coef.g_ent is not None:
        per_entry = per_entry + coef.g_ent[rows][row_of] * (log_p + coef.entropy[rows][row_of])
    vals = log_p.exp_().mul_(per_entry).neg_()
    is_target = chunk.cols == coef.targets[rows][row_of]
    vals += torch.where(is_target, coef.g_lp[rows][row_of], 0.0)
    # The softcap derivative needs the transformed logits at the kept entries: (z - m) + m.
    z = chunk.shifted + coef.row_max[rows][row_of] if transform.softcap is not None else vals
    vals = transform.backward_(vals, z)

    crow = torch.zeros(n + 1, device=hidden.device, dtype=torch.int32)
    torch.cumsum(chunk.counts, 0, out=crow[1:])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        if grad_hidden is not None:
            g = torch.sparse_csr_tensor(crow, chunk.cols, vals, size=(n, vocab), check_invariants=False)
            grad_hidden[rows] += torch.sparse.mm(g, weight)
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


def accumulate_chunk_grads(
    grad: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    rows: slice | torch.Tensor,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """Add a chunk's logits gradient ``grad`` ``[n, V]`` to the input gradients: ``grad @ weight`` into
    ``grad_hidden[rows]``, ``grad.T @ h`` into the fp32 ``grad_weight`` (rounding each chunk's product to
    bf16 would bias training), column sums into ``grad_bias``."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_bias is not None:
        grad_bias += grad.sum(0, dtype=grad_bias.dtype)
    if grad_hidden is not None:
        product = grad.to(grad_hidden.dtype) @ weight
        if isinstance(rows, slice):
            grad_hidden[rows] += product
        else:
            grad_hidden.index_add_(0, rows, product)
    if grad_weight is not None:
        if grad.dtype == grad_weight.dtype:
            grad_weight.addmm_(grad.t(), h.to(grad.dtype))
        else:
            from safevocab.kernels.fused import addmm_fp32

            addmm_fp32(grad_weight, grad.t(), h)


def _repair_safe_sets(z: torch.Tensor, dropped: torch.Tensor, saved_size: torch.Tensor) -> None:
    """Make each row of ``dropped`` drop exactly ``V - saved_size`` logits when a recomputation moved a
    boundary logit across the threshold: keep the ``|S|`` largest logits of such rows instead."""
    kept = dropped.shape[-1] - dropped.sum(-1)
    for row in (kept != saved_size).nonzero().squeeze(-1).tolist():
        size = int(saved_size[row])
        t = torch.topk(z[row], size, sorted=False).values.amin()
        torch.lt(z[row], t, out=dropped[row])


def _dense_backward(
    chunks: list[slice],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    coef: Coefficients,
    transform: Transform,
    chunk_rows: int,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """The whole gradient of the given forward chunks, recomputing their logits exactly as the forward did."""
    logits_of = ChunkLogits(hidden, weight, bias, transform, min(chunk_rows, hidden.shape[0]))
    for rows in chunks:
        h = hidden[rows]  # the forward's operand: same slice, same layout
        z = logits_of(h)
        dropped = z < coef.threshold[rows].unsqueeze(-1)
        _repair_safe_sets(z, dropped, coef.safe_size[rows])
        m = coef.row_max[rows].unsqueeze(-1)
        grad = (z - m).sub_(coef.log_sum_safe[rows].unsqueeze(-1))  # log pi_S on S
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
            p_full = (z - m).sub_(coef.log_sum_full[rows].unsqueeze(-1)).exp_()
            grad.sub_(p_full.mul_(c_full.unsqueeze(-1)))
            del p_full
        grad.scatter_add_(-1, coef.targets[rows].unsqueeze(-1), coef.g_lp[rows].unsqueeze(-1))
        grad = transform.backward_(grad, z)
        del z, dropped
        accumulate_chunk_grads(grad, h, weight, rows, grads)
        del grad


def _full_softmax_backward(
    idx: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    coef: Coefficients,
    transform: Transform,
    chunk_rows: int,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """``-c_F pi + g_lp 1[a=y not in S]`` for the rows ``idx`` (their safe-set part comes from the sparse
    path). Independent of ``S``, so the recomputed logits need not be bit-identical to the forward's."""
    logits_of = ChunkLogits(hidden, weight, bias, transform, min(chunk_rows, idx.numel()))
    for start in range(0, idx.numel(), chunk_rows):
        rows = idx[start : start + chunk_rows]
        h = hidden.index_select(0, rows)
        z = logits_of(h)
        grad = (z - coef.row_max[rows].unsqueeze(-1)).sub_(coef.log_sum_full[rows].unsqueeze(-1)).exp_()
        grad.mul_(coef.c_full[rows].neg().unsqueeze(-1))
        grad.scatter_add_(-1, coef.targets[rows].unsqueeze(-1), coef.g_target_out[rows].unsqueeze(-1))
        grad = transform.backward_(grad, z)
        del z
        accumulate_chunk_grads(grad, h, weight, rows, grads)
        del grad
