"""The torch backend of the fused op: each chunk's statistics and logits gradient with torch passes.

Implements :class:`safevocab.fused_backend.FusedBackend`. Forward, per chunk: the transformed logits
(:class:`~safevocab.chunking.ChunkLogits`), the rule's threshold ``t`` and row maximum ``m``,
``S = {z >= t}``, then the max-shifted sums ``log sum_S exp(z - m)`` and ``log sum_V exp(z - m)`` and the
entropy ``H(pi_S) = log sum_S e - sum_S e log e / sum_S e`` with ``e = exp(z - m)``. Chunks whose safe sets
are small are returned as CSR (:class:`~safevocab.chunking.SparseChunk`) for the sparse backward.

Dense backward, per chunk: recompute the logits on the forward's own row slice (bit-identical), rebuild
``S`` from the saved threshold, check it against the saved ``|S|`` (a row whose count moved is repaired from
its ``|S|`` largest logits), and form ``grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi``
in place before the two gradient GEMMs.
"""

from __future__ import annotations

import torch

from safevocab.chunking import (
    ChunkLogits,
    Coefficients,
    RowStats,
    SparseChunk,
    Transform,
    accumulate_chunk_grads,
    chunk_slices,
    log_normalised,
)
from safevocab.rules import NoPruning, SafeVocabRule
from safevocab.support import SafeSupport

__all__ = ["TorchBackend", "chunk_rows_for", "torch_forward", "dense_backward", "full_softmax_backward"]


def chunk_rows_for(n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk's scratch fits ``max_chunk_bytes``."""
    # Live scratch per logit in the dense backward (the larger pass): fp32 z, fp32 probabilities or
    # gradient, fp32 entropy/softcap temporary, two bool masks, a cast copy for half inputs, the rule's own.
    per_logit = 3 * 4 + 2 + (in_bytes if in_bytes < 4 else 0) + rule.scratch_bytes_per_logit
    return max(1, min(n_rows, max_chunk_bytes // max(1, vocab * per_logit)))


def torch_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rule: SafeVocabRule,
    transform: Transform,
    chunk_rows: int,
    stats: RowStats,
    density: float | None,
    support: SafeSupport | None = None,
) -> list[SparseChunk]:
    """Fill ``stats`` chunk by chunk with torch passes; return the chunks whose safe sets are stored
    sparsely (at most ``density`` of a chunk's logits kept; ``None``: never). With a ``support``, ``S`` is
    its ids intersected with the rule's set (``{z >= t}``, which also drops ``-inf`` logits)."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    sparse_chunks: list[SparseChunk] = []
    if not n_rows:
        return sparse_chunks
    logits_of = ChunkLogits(hidden, weight, bias, transform, min(chunk_rows, n_rows))
    drop_buf = torch.empty(min(chunk_rows, n_rows), vocab, device=hidden.device, dtype=torch.bool)
    support_buf = None if support is None else torch.empty_like(drop_buf)
    for rows in chunk_slices(n_rows, chunk_rows):
        n = rows.stop - rows.start
        z = logits_of(hidden[rows])
        t, z_max = rule.threshold_and_max(z)  # [n, 1] each
        stats.threshold[rows] = t.squeeze(-1)
        target_col = targets[rows].unsqueeze(-1)
        z_y = z.gather(-1, target_col).squeeze(-1)
        # S = {z >= t} on the unshifted logits, as the backward decides it (z - m < t - m could round a
        # boundary token the other way).
        dropped = torch.lt(z, t, out=drop_buf[:n])
        if support is not None:
            dropped |= support.dropped_mask_(rows, support_buf[:n])
        stats.in_safe[rows] = ~dropped.gather(-1, target_col).squeeze(-1)
        kept_per_row = vocab - dropped.sum(-1)
        stats.safe_size[rows] = kept_per_row
        store_sparse = density is not None and int(kept_per_row.sum()) <= density * n * vocab
        stats.row_max[rows] = z_max.squeeze(-1)
        stats.target_shift[rows] = z_y - z_max.squeeze(-1)
        if support is not None:
            # A replayed S need not hold the argmax and may sit far below it: S gets its own shift m_S (its
            # maximum), so (z - m_S) - log sum_S exp(z - m_S) keeps full precision on S (ties give exactly
            # -log 2), while the full softmax keeps the row maximum m.
            r, c = torch.logical_not(dropped).nonzero(as_tuple=True)
            kept = z[r, c]
            m_s = torch.full((n,), -torch.inf, dtype=z.dtype, device=z.device).scatter_reduce_(0, r, kept, reduce="amax")
            shifted_kept = kept.sub_(m_s[r])
            stats.set_max[rows] = m_s
            stats.target_shift_safe[rows] = z_y - m_s
            stats.log_sum_full[rows] = z.sub_(z_max).exp_().sum(-1).log_()
            _replayed_set_stats(shifted_kept, r, n, stats, rows)
        else:  # S holds the argmax: shift by the row maximum, sum_S exp(z - m) >= 1
            z.sub_(z_max)  # z now holds z - m
            if store_sparse:
                r, c = torch.logical_not(dropped).nonzero(as_tuple=True)
                shifted_kept = z[r, c]
            e = z.exp_()  # z now holds exp(z - m)
            stats.log_sum_full[rows] = e.sum(-1).log()
            e.masked_fill_(dropped, 0.0)
            sum_safe = e.sum(-1)
            log_sum_safe = sum_safe.log()
            stats.log_sum_safe[rows] = log_sum_safe
            if stats.entropy is not None:
                # H(pi_S) = log sum_S e - sum_S e log e / sum_S e, with e = exp(z - m); xlogy(0, 0) = 0
                stats.entropy[rows] = log_sum_safe - torch.special.xlogy(e, e).sum(-1) / sum_safe
            del e
        if store_sparse:
            sparse_chunks.append(SparseChunk(rows.start, kept_per_row, c.to(torch.int32), shifted_kept))
        del z, dropped
    return sparse_chunks


def _replayed_set_stats(shifted_kept: torch.Tensor, row: torch.Tensor, n: int, stats: RowStats, rows: slice) -> None:
    """``log sum_S exp(z - m)`` and ``H(pi_S)`` from a chunk's kept entries ``x = z - m`` (CSR order, ``m`` the
    maximum over ``S``, so ``x <= 0`` and one ``x = 0`` per row). ``O(|S|)`` work."""
    e = shifted_kept.exp()
    total = torch.zeros(n, dtype=e.dtype, device=e.device).index_add_(0, row, e)
    log_total = total.log()
    stats.log_sum_safe[rows] = log_total
    if stats.entropy is not None:
        weighted = torch.zeros(n, dtype=e.dtype, device=e.device).index_add_(0, row, e * shifted_kept)
        stats.entropy[rows] = log_total - weighted / total


def _repair_safe_sets(z: torch.Tensor, dropped: torch.Tensor, saved_size: torch.Tensor) -> None:
    """Make each row of ``dropped`` drop exactly ``V - saved_size`` logits when a recomputation moved a
    boundary logit across the threshold: keep the ``|S|`` largest logits of such rows instead."""
    kept = dropped.shape[-1] - dropped.sum(-1)
    for row in (kept != saved_size).nonzero().squeeze(-1).tolist():
        size = int(saved_size[row])
        t = torch.topk(z[row], size, sorted=False).values.amin()
        torch.lt(z[row], t, out=dropped[row])


def dense_backward(
    chunks: list[slice],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    coef: Coefficients,
    transform: Transform,
    chunk_rows: int,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    support: SafeSupport | None = None,
    check_sizes: bool = True,
) -> None:
    """The whole gradient of the given forward chunks, recomputing their logits exactly as the forward did.

    ``check_sizes``: compare each rebuilt set with the saved ``|S|`` (one pass over a bool chunk); pointless when
    the threshold is the finite floor (``NoPruning``: every finite logit is kept, no boundary can move).
    """
    logits_of = ChunkLogits(hidden, weight, bias, transform, min(chunk_rows, hidden.shape[0]))
    support_buf = None
    for rows in chunks:
        h = hidden[rows]  # the forward's operand: same slice, same layout
        z = logits_of(h)
        dropped = z < coef.threshold[rows].unsqueeze(-1)
        if support is None:
            if check_sizes:
                _repair_safe_sets(z, dropped, coef.safe_size[rows])
        else:  # the replayed ids are exact; the threshold runs on bit-identical logits
            if support_buf is None:
                support_buf = torch.empty(min(chunk_rows, hidden.shape[0]), z.shape[-1], dtype=torch.bool, device=z.device)
            dropped |= support.dropped_mask_(rows, support_buf[: rows.stop - rows.start])
        m = coef.row_max[rows].unsqueeze(-1)
        m_s = coef.set_max[rows].unsqueeze(-1)
        grad = log_normalised(z, m_s, coef.log_sum_safe[rows].unsqueeze(-1), one_pass=support is None)  # log pi_S on S
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
            p_full = log_normalised(z, m, coef.log_sum_full[rows].unsqueeze(-1)).exp_()
            grad.sub_(p_full.mul_(c_full.unsqueeze(-1)))
            del p_full
        grad.scatter_add_(-1, coef.targets[rows].unsqueeze(-1), coef.g_lp[rows].unsqueeze(-1))
        grad = transform.backward_(grad, z)
        del z, dropped
        accumulate_chunk_grads(grad, h, weight, rows, grads)
        del grad


def full_softmax_backward(
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
        grad = log_normalised(z, coef.row_max[rows].unsqueeze(-1), coef.log_sum_full[rows].unsqueeze(-1)).exp_()
        grad.mul_(coef.c_full[rows].neg().unsqueeze(-1))
        grad.scatter_add_(-1, coef.targets[rows].unsqueeze(-1), coef.g_target_out[rows].unsqueeze(-1))
        grad = transform.backward_(grad, z)
        del z
        accumulate_chunk_grads(grad, h, weight, rows, grads)
        del grad


class TorchBackend:
    """torch passes for every chunk (CPU, or CUDA without Triton)."""

    name = "torch"

    def rows_per_chunk(self, n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
        return chunk_rows_for(n_rows, vocab, rule, in_bytes, max_chunk_bytes)

    supports_replay = True

    def forward(self, hidden, weight, bias, targets, rule, transform, chunk_rows, stats, sparse_max_density, support=None):
        return torch_forward(hidden, weight, bias, targets, rule, transform, chunk_rows, stats, sparse_max_density, support)

    def dense_backward(self, chunks, hidden, weight, bias, coef, transform, chunk_rows, grads, rule, support=None):
        check_sizes = not isinstance(rule, NoPruning)
        dense_backward(chunks, hidden, weight, bias, coef, transform, chunk_rows, grads, support, check_sizes)

    def full_softmax_backward(self, idx, hidden, weight, bias, coef, transform, chunk_rows, grads, rule):
        full_softmax_backward(idx, hidden, weight, bias, coef, transform, chunk_rows, grads)
