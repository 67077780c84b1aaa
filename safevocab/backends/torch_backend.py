"""The torch backend of the fused op: each chunk's statistics and logits gradient with torch passes.

Implements :class:`safevocab.fused.protocol.FusedBackend`. A chunk is one LM-head GEMM (``rows x H`` by
``H x V``: large, so the GEMM runs near its peak); its element-wise work then runs on *row blocks* of the GEMM output
small enough to stay in cache between passes (:func:`row_blocks`), in a few fused passes on reused buffers (a fresh
``[rows, V]`` tensor costs page faults on every chunk).

Forward, per row block: the row maximum ``m``, ``e = exp(z - m)`` and ``log sum_V e`` (shared with the rule's
threshold ``t``, :class:`~safevocab.rules.ShiftedLogits`), then ``S = {z >= t}``: a row block whose ``S`` is the whole
finite vocabulary (``none``) needs nothing more; otherwise ``|S|``, ``in_safe`` and ``log sum_S e`` come from the kept
entries (``nonzero``, ``O(|S|)`` work, also the CSR of a sparse chunk,
:class:`~safevocab.fused.row_stats.SparseChunk`) or, for a dense chunk, a masked sum. The entropy is
``H(pi_S) = log sum_S e - sum_S e (z - m) / sum_S e``.

Dense backward, per chunk: recompute the logits on the forward's own row slice (bit-identical; or, for a chunk the
forward kept under ``keep_logits_bytes``, transform the GEMM output it kept: the forward's passes overwrite their
transformed copy, so the GEMM output is what is kept, ``rows x V`` in the inputs' dtype), then per row block
rebuild ``S = {z >= t}`` (skipped where ``t`` is at or below the block's minimum: every finite logit is kept), check it
against the saved ``|S|`` (a row whose count moved is repaired from its ``|S|`` largest logits) and write
``grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi`` over the logits in place, with
``pi_S = e exp(-log_sum_S)`` and ``pi = e exp(-log_sum_V)`` from one ``e = exp(z - m)``; then the two gradient GEMMs.
A replayed support (``S`` with its own shift ``m_S``) forms ``pi_S`` from ``z - m_S`` instead.

Full-softmax part of sparse chunks (:func:`full_softmax_backward`): ``-c_F pi + g_lp 1[a=y not in S]`` of the rows
that need it, ``pi`` from the forward's ``m`` and ``log sum_V`` on the logits of their whole chunk recomputed as the
forward computed them.
"""

from __future__ import annotations

import torch

from safevocab.fused.chunking import ChunkJob, ChunkLogits
from safevocab.fused.coefficients import Coefficients
from safevocab.fused.grads import Grads, accumulate_chunk_grads
from safevocab.fused.row_stats import RowStats, SparseChunk
from safevocab.fused.transform import Transform
from safevocab.rules import SafeVocabRule, ShiftedLogits, finite_floor
from safevocab.support import SafeSupport
from safevocab.threads import single_threaded

__all__ = [
    "TorchBackend",
    "chunk_rows_for",
    "dense_backward",
    "full_softmax_backward",
    "log_normalised",
    "row_blocks",
    "torch_forward",
]

#: Bytes of one fp32 row block on a CPU: the element-wise passes of a block stay in L2/L3 between them.
ROW_BLOCK_BYTES = 4 * 2**20
#: Bytes of one fp32 row block on an accelerator: there every pass is a kernel launch (and a few are host syncs), so
#: small blocks cost launches, not cache misses. At V = 151936 the CPU size is 6 rows: an H200 spent 0.82 s on 8192
#: rows (14x trl's kernel) launching ~1400 blocks; 64 MiB is ~110 rows, and 10 bytes a logit of scratch (160 MiB).
ROW_BLOCK_BYTES_ACCELERATOR = 64 * 2**20
#: ``x = z - m`` is clamped to this before products with ``exp(x)``: the exponential is already 0 far above it (fp32
#: below -104, fp64 below -745), so the clamp changes no product, only keeps ``0 * -inf`` from making a NaN.
_X_FLOOR = -2.0e4


def chunk_rows_for(n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk's scratch fits ``max_chunk_bytes``."""
    # The chunk's fp32 logits (overwritten by the logits gradient in backward) and the GEMM output of half inputs;
    # the row-block buffers are a few MiB whatever the chunk.
    per_logit = 4 + (in_bytes if in_bytes < 4 else 0)
    return max(1, min(n_rows, max_chunk_bytes // max(1, vocab * per_logit)))


def row_blocks(n_rows: int, vocab: int, elem_bytes: int = 4, device: torch.device | None = None) -> list[slice]:
    """Row slices of a chunk for its element-wise passes: about ``ROW_BLOCK_BYTES`` each on a CPU (``device`` None
    or ``cpu``), ``ROW_BLOCK_BYTES_ACCELERATOR`` elsewhere."""
    block_bytes = (
        ROW_BLOCK_BYTES if device is None or torch.device(device).type == "cpu" else ROW_BLOCK_BYTES_ACCELERATOR
    )
    step = max(1, block_bytes // max(1, vocab * elem_bytes))
    return [slice(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]


class _Scratch:
    """Row-block buffers reused across blocks and chunks: ``e`` (stat dtype), a float 0/1 mask, two bool masks, and
    the softcap derivative (allocated when needed)."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.exp = torch.empty(rows, vocab, dtype=dtype, device=device)
        self.keep_f = torch.empty(rows, vocab, dtype=dtype, device=device)
        self.keep = torch.empty(rows, vocab, dtype=torch.bool, device=device)
        self.replayed = torch.empty(rows, vocab, dtype=torch.bool, device=device)
        self._cap: torch.Tensor | None = None

    def cap(self, n: int) -> torch.Tensor:
        if self._cap is None:
            self._cap = torch.empty_like(self.exp)
        return self._cap[:n]


def _support_keep(support: SafeSupport, rows: slice, out: torch.Tensor) -> torch.Tensor:
    """Bool ``[n, V]``: the replayed ids of ``rows``."""
    out.zero_()
    row, ids = support.rows(rows)
    out[row, ids] = True
    return out


def torch_forward(job: ChunkJob, stats: RowStats, density: float | None) -> list[SparseChunk]:
    """Fill ``stats`` (each ``[N]``) chunk by chunk with torch passes; return the chunks whose safe sets are stored
    sparsely (at most ``density`` of a chunk's logits kept; ``None``: never). With a ``job.support``, ``S`` is
    its ids intersected with the rule's set (``{z >= t}``, which also drops ``-inf`` logits)."""
    vocab = job.vocab
    sparse_chunks: list[SparseChunk] = []
    if not job.n_rows:
        return sparse_chunks
    logits_of = ChunkLogits(job.hidden, job.weight, job.bias, job.transform, job.buffer_rows)
    blocks = row_blocks(job.buffer_rows, vocab, device=job.hidden.device)
    scratch = _Scratch(blocks[0].stop, vocab, logits_of.stat, job.hidden.device)
    for rows in job.slices():
        z = _forward_logits(job, logits_of, rows)
        with single_threaded(z.device):  # the GEMM above keeps the caller's threads (safevocab.threads)
            _forward_chunk(z, rows, job.targets, job.rule, stats, scratch, job.support, density, sparse_chunks)
        if job.kept_logits is not None and sparse_chunks and sparse_chunks[-1].start == rows.start:
            _release_if_unneeded(job, rows, stats)
    return sparse_chunks


def _release_if_unneeded(job: ChunkJob, rows: slice, stats: RowStats) -> None:
    """A stored chunk whose targets are all in ``S`` needs no logits in its backward (the sparse one), unless a
    gradient reaches ``log_kept_mass``: give its kept buffer back and keep no further chunk (the call's sets are
    small; each kept chunk would cost a fresh buffer and a copy for nothing). A later backward that does need the
    logits recomputes them, bit for bit as before."""
    if bool(stats.in_safe[rows].all()):  # host read: this backend reads every chunk's statistics anyway
        job.kept_logits.release(rows.start)


def _forward_logits(job: ChunkJob, logits_of: ChunkLogits, rows: slice) -> torch.Tensor:
    """The transformed logits of the forward chunk ``rows`` in the reused buffer (the forward's passes overwrite them).
    While the job's cap has room (:meth:`~safevocab.fused.chunking.ChunkJob.keeps`), the GEMM writes into a buffer of
    the chunk's own (``rows x V`` in the inputs' dtype, laid out as the reused one), kept for the backward, and the
    logits are its copy, transformed."""
    h = job.hidden[rows]
    n, vocab = h.shape[0], job.vocab
    if not job.keeps(rows, n * vocab * h.element_size()):
        return logits_of(h)
    raw = logits_of.gemm(h, out=torch.empty(n, vocab, device=h.device, dtype=h.dtype))
    job.kept_logits.put(rows.start, raw)
    return logits_of.transformed(raw, out=logits_of.buffer(n))


def _backward_logits(job: ChunkJob, logits_of: ChunkLogits, rows: slice) -> torch.Tensor:
    """The transformed logits of the chunk ``rows`` for a backward, as the forward had them: from the GEMM output the
    forward kept (taken: transformed over itself for fp32/fp64 inputs, copied first for half ones), else recomputed."""
    raw = job.take_kept(rows)
    return logits_of(job.hidden[rows]) if raw is None else logits_of.transformed(raw)


def _forward_chunk(z, rows: slice, targets, rule, stats: RowStats, scratch, support, density, sparse_chunks) -> None:
    """The statistics of one chunk's logits ``z``, row block by row block; appends its CSR when sparse."""
    n, vocab = z.shape
    target_col = targets[rows].unsqueeze(-1)
    z_y = z.gather(-1, target_col).squeeze(-1)
    budget = None if density is None else density * n * vocab  # kept logits a sparse chunk may hold
    kept: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (block start, row, col, z - m_S)
    for block in row_blocks(n, vocab, device=z.device):
        at = slice(rows.start + block.start, rows.start + block.stop)
        kept_here = _forward_block(z[block], targets[at], rule, stats, at, scratch, support, budget)
        if budget is not None:
            if kept_here is None:
                budget = None  # a dense chunk: its blocks no longer collect entries
            else:
                budget -= kept_here[0].numel()
                kept.append((block.start, *kept_here))
    stats.target_shift[rows] = z_y - stats.row_max[rows]
    if support is not None:
        stats.target_shift_safe[rows] = z_y - stats.set_max[rows]
    if budget is not None:
        row = torch.cat([r + start for start, r, _, _ in kept])
        col = torch.cat([c for _, _, c, _ in kept])
        shifted = torch.cat([s for _, _, _, s in kept])
        counts = torch.bincount(row, minlength=n)
        sparse_chunks.append(SparseChunk(rows.start, counts, col.to(torch.int32), shifted))


def _forward_block(
    z: torch.Tensor,
    targets: torch.Tensor,
    rule: SafeVocabRule,
    stats: RowStats,
    at: slice,
    scratch: _Scratch,
    support: SafeSupport | None,
    budget: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Statistics of the rows ``at`` (a row block ``z`` of a chunk). Returns the kept entries ``(row, col, z - m_S)``
    when they fit the chunk's remaining sparse ``budget``, else ``None``."""
    n, vocab = z.shape
    z_max = torch.amax(z, -1, keepdim=True)
    logits = ShiftedLogits(z, z_max, out=scratch.exp[:n])
    t = rule.threshold_of(logits)
    stats.threshold[at] = t.squeeze(-1)
    stats.row_max[at] = z_max.squeeze(-1)
    if support is None and bool((t <= z.amin(-1, keepdim=True)).all()):
        # every finite logit is kept (``none``, or a rule that keeps all): S = V, nothing to mask
        stats.in_safe[at] = True
        stats.safe_size[at] = vocab
        entries = None if budget is None or budget < n * vocab else _all_entries(z, z_max, n, vocab)
        # z is not needed any more (the backward recomputes it): exp(z - m) in place unless the rule made it already
        if stats.entropy is None:
            e = logits.exp if logits.computed else z.sub_(z_max).exp_()
            stats.log_sum_full[at] = stats.log_sum_safe[at] = e.sum(-1).log()
        else:
            e, total = logits.exp, logits.total.squeeze(-1)
            x = z.sub_(z_max)
            stats.log_sum_full[at] = stats.log_sum_safe[at] = total.log()
            stats.entropy[at] = total.log() - torch.linalg.vecdot(e, x) / total
        return entries
    e = logits.exp
    stats.log_sum_full[at] = logits.total.squeeze(-1).log()
    cover = logits.cover if support is None else None
    if cover is not None and bool((t.squeeze(-1) >= cover[2]).all()):
        # the rule's candidates hold every entry with z >= t (top_p): S's entries without a pass over the vocabulary
        row, col, _ = cover
        at_flat = row * vocab + col
        inside = (z.reshape(-1).index_select(0, at_flat) >= t.squeeze(-1).index_select(0, row)).nonzero().squeeze(-1)
        row, col = row.index_select(0, inside), col.index_select(0, inside)
        stats.safe_size[at] = torch.bincount(row, minlength=n)
        stats.in_safe[at] = (z.gather(-1, targets.unsqueeze(-1)) >= t).squeeze(-1)
        entries = _kept_sums(z, z_max, e, row, col, stats, at)
        return entries if budget is not None and row.numel() <= budget else None
    keep = torch.ge(z, t, out=scratch.keep[:n])
    if support is not None:
        keep &= _support_keep(support, at, scratch.replayed[:n])
    counts = keep.sum(-1, dtype=torch.int32)
    stats.safe_size[at] = counts
    stats.in_safe[at] = keep.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    total_kept = int(counts.sum())
    if support is None and budget is not None and total_kept <= budget:
        return _kept_sums(z, z_max, e, *keep.nonzero(as_tuple=True), stats, at)
    if support is not None:
        return _replayed_block(z, z_max, keep, stats, at, budget, total_kept)
    keep_f = scratch.keep_f[:n].copy_(keep)
    masked = e.mul_(keep_f)
    sum_safe = masked.sum(-1)
    stats.log_sum_safe[at] = sum_safe.log()
    if stats.entropy is not None:
        x = z.sub_(z_max).clamp_min_(_X_FLOOR)  # e = 0 below the floor: the clamp only keeps 0 * x finite
        stats.entropy[at] = sum_safe.log() - torch.linalg.vecdot(masked, x) / sum_safe
    return None


def _kept_sums(z, z_max, e, row, col, stats: RowStats, at: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``log sum_S e`` (and the entropy) of a row block from the entries ``(row, col)`` of ``S``, in float64:
    ``O(|S|)`` work. Returns the entries ``(row, col, z - m)``."""
    n, vocab = z.shape
    flat = row * vocab + col  # flat positions: index_select is several times faster than z[row, col]
    shifted = z.reshape(-1).index_select(0, flat) - z_max.squeeze(-1).index_select(0, row)  # fl(z - m), as in e
    kept_e = e.reshape(-1).index_select(0, flat).to(torch.float64)
    sum_safe = torch.zeros(n, dtype=torch.float64, device=z.device).index_add_(0, row, kept_e)
    stats.log_sum_safe[at] = sum_safe.log()
    if stats.entropy is not None:
        weighted = torch.zeros_like(sum_safe).index_add_(0, row, kept_e * shifted.to(torch.float64))
        stats.entropy[at] = (sum_safe.log() - weighted / sum_safe).to(stats.entropy.dtype)
    return row, col, shifted


def _all_entries(z: torch.Tensor, z_max: torch.Tensor, n: int, vocab: int):
    """Every entry of a block whose ``S`` is the whole vocabulary, for a sparse chunk (tiny vocabularies only)."""
    row = torch.arange(n, device=z.device).repeat_interleave(vocab)
    col = torch.arange(vocab, device=z.device).repeat(n)
    return row, col, (z - z_max).reshape(-1)


def _replayed_block(z, z_max, keep, stats, at, budget, total_kept):
    """A replayed ``S`` need not hold the argmax and may sit far below it: ``S`` gets its own shift ``m_S`` (its
    maximum), so ``(z - m_S) - log sum_S exp(z - m_S)`` keeps full precision on ``S`` (ties give exactly ``-log 2``),
    while the full softmax keeps the row maximum ``m``. ``O(|S|)`` work."""
    n = z.shape[0]
    row, col = keep.nonzero(as_tuple=True)
    kept = z[row, col]
    m_s = torch.full((n,), -torch.inf, dtype=z.dtype, device=z.device).scatter_reduce_(0, row, kept, reduce="amax")
    shifted = kept - m_s[row]
    stats.set_max[at] = m_s
    e = shifted.exp().to(torch.float64)
    total = torch.zeros(n, dtype=torch.float64, device=z.device).index_add_(0, row, e)
    stats.log_sum_safe[at] = total.log()
    if stats.entropy is not None:
        weighted = torch.zeros_like(total).index_add_(0, row, e * shifted.to(torch.float64))
        stats.entropy[at] = (total.log() - weighted / total).to(stats.entropy.dtype)
    if budget is None or total_kept > budget:
        return None
    return row, col, shifted


def _repair_safe_sets(z: torch.Tensor, keep_f: torch.Tensor, kept: torch.Tensor, saved_size: torch.Tensor) -> None:
    """Make each row of the 0/1 mask ``keep_f`` keep exactly ``saved_size`` logits when a recomputation moved a
    boundary logit across the threshold: keep the ``|S|`` largest logits of such rows instead."""
    for row in (kept != saved_size).nonzero().squeeze(-1).tolist():
        size = int(saved_size[row])
        t = torch.topk(z[row], size, sorted=False).values.amin()
        torch.ge(z[row], t, out=keep_f[row])


def dense_backward(
    job: ChunkJob, chunks: list[slice], coef: Coefficients, grads: Grads, check_sizes: bool = True
) -> None:
    """Add the whole gradient of the forward chunks ``chunks`` (row slices of ``job``) to ``grads``, recomputing
    their logits exactly as the forward did (with a ``job.support``: ``S`` is its ids on the rule's set).

    ``check_sizes``: compare each rebuilt set with the saved ``|S|`` (one sum over a row block's mask); default on.
    """
    vocab = job.vocab
    logits_of = ChunkLogits(job.hidden, job.weight, job.bias, job.transform, job.buffer_rows)
    blocks = row_blocks(job.buffer_rows, vocab, device=job.hidden.device)
    scratch = _Scratch(blocks[0].stop, vocab, logits_of.stat, job.hidden.device)
    for rows in chunks:
        h = job.hidden[rows]  # the forward's operand: same slice, same layout
        z = _backward_logits(job, logits_of, rows)  # kept by the forward, or recomputed; |S| is checked either way
        with single_threaded(z.device):  # the GEMMs keep the caller's threads (safevocab.threads)
            for block in row_blocks(rows.stop - rows.start, vocab, device=z.device):
                at = slice(rows.start + block.start, rows.start + block.stop)
                _backward_block(z[block], coef, at, job.transform, scratch, job.support, check_sizes)
        accumulate_chunk_grads(z, h, job.weight, rows, grads, coef.grad_shift)  # z now holds the logits gradient


def _backward_block(z, coef: Coefficients, at: slice, transform: Transform, scratch: _Scratch, support, check_sizes):
    """Overwrite the row block ``z`` (logits of the rows ``at``) with their logits gradient."""
    n, vocab = z.shape
    cap_factor = None
    if transform.softcap is not None:  # its derivative needs z: taken before z is overwritten
        cap_factor = transform.softcap_derivative(z, out=scratch.cap(n))
    m = coef.row_max[at].unsqueeze(-1)
    t = coef.threshold[at].unsqueeze(-1)
    c_safe, c_full = coef.c_safe[at].unsqueeze(-1), coef.c_full[at].unsqueeze(-1)
    g_ent = None if coef.g_ent is None else coef.g_ent[at].unsqueeze(-1)
    # S = V where the threshold is at or below every logit and the forward kept all V (a recomputation that moved a
    # logit takes the checked path below)
    all_kept = support is None and bool((coef.safe_size[at] == vocab).all())
    if all_kept and not bool((t == finite_floor(z.dtype)).all()):  # ``none`` keeps every finite logit: no -inf here
        all_kept = bool((t <= z.amin(-1, keepdim=True)).all())
    if all_kept:
        # S = V: pi_S = pi, grad = g_lp 1[a=y] - pi ((c_S + c_F) + g_H (log pi + H))
        log_sum = coef.log_sum_full[at].unsqueeze(-1)
        if g_ent is None:
            grad = log_normalised_(z, m, log_sum).exp_().mul_((c_safe + c_full).neg_())
        else:
            x = z.sub_(m).clamp_min_(_X_FLOOR)  # e = 0 below the floor: the clamp only keeps products finite
            p = torch.sub(x, log_sum, out=scratch.exp[:n]).exp_()
            # (c + g_H (x - L + H)) = g_H x + (c + g_H (H - L))
            offset = c_safe + c_full + g_ent * (coef.entropy[at].unsqueeze(-1) - log_sum)
            grad = x.mul_(g_ent).add_(offset).mul_(p).neg_()
    else:
        keep_f = torch.ge(z, t, out=scratch.keep_f[:n])
        if support is not None:  # the replayed ids are exact; the threshold runs on bit-identical logits
            keep_f.mul_(_support_keep(support, at, scratch.replayed[:n]))
        elif check_sizes:
            kept = keep_f.sum(-1).to(torch.int64)
            if not torch.equal(kept, coef.safe_size[at]):
                _repair_safe_sets(z, keep_f, kept, coef.safe_size[at])
        grad = _set_gradient(z, m, keep_f, coef, at, c_safe, c_full, g_ent, scratch, support is not None)
    grad.scatter_add_(-1, coef.targets[at].unsqueeze(-1), coef.g_lp[at].unsqueeze(-1))
    if cap_factor is not None:
        grad.mul_(cap_factor)
    scale = transform.logit_scale / transform.temperature / coef.grad_shift  # the shift: see Coefficients
    if scale != 1.0:
        grad.mul_(scale)


def _set_gradient(z, m, keep_f, coef: Coefficients, at, c_safe, c_full, g_ent, scratch: _Scratch, replay: bool):
    """``-pi_S (c_S + g_H (log pi_S + H)) - c_F pi`` over a row block, written into ``z``; ``keep_f`` the 0/1 mask of S."""
    n = z.shape[0]
    log_sum_s = coef.log_sum_safe[at].unsqueeze(-1)
    log_sum_v = coef.log_sum_full[at].unsqueeze(-1)
    full_coef = c_full * torch.exp(-log_sum_v)  # c_F / sum_V e
    if replay:
        # S has its own shift m_S and may sit far below m: pi_S from z - m_S, pi from z - m (two exponentials)
        m_s = coef.set_max[at].unsqueeze(-1)
        # x_s <= 0 on S; outside S (masked below) it may be large: clamped so that exp stays finite there
        x_s = torch.sub(z, m_s, out=scratch.exp[:n]).clamp_(_X_FLOOR, 0.0)
        p_s = torch.sub(x_s, log_sum_s).exp_().mul_(keep_f)
        if g_ent is None:
            safe_part = p_s.mul_(c_safe)
        else:
            offset = c_safe + g_ent * (coef.entropy[at].unsqueeze(-1) - log_sum_s)
            safe_part = x_s.mul_(g_ent).add_(offset).mul_(p_s)
        grad = z.sub_(m).exp_().mul_(full_coef).add_(safe_part).neg_()
        return grad
    e = torch.sub(z, m, out=scratch.exp[:n]).exp_()  # exp(z - m), the forward's own rounding of z - m
    safe_scale = torch.exp(-log_sum_s)  # 1 / sum_S e
    if g_ent is None:
        # grad = -e (keep c_S / sum_S + c_F / sum_V)
        coef_f = keep_f.mul_(c_safe * safe_scale).add_(full_coef)
        return torch.mul(e, coef_f, out=z).neg_()
    # grad = -e (keep (c_S + g_H (x - L_S + H)) / sum_S + c_F / sum_V), x = z - m
    x = z.sub_(m).clamp_min_(_X_FLOOR)
    offset = c_safe + g_ent * (coef.entropy[at].unsqueeze(-1) - log_sum_s)
    per_logit = x.mul_(g_ent * safe_scale).add_(offset * safe_scale).mul_(keep_f).add_(full_coef)
    return per_logit.mul_(e).neg_()


def log_normalised(
    z: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor, one_pass: bool = True
) -> torch.Tensor:
    """``(z - m) - log_sum`` as a new ``[n, V]`` tensor (``row_max``, ``log_sum``: ``[n, 1]``), max-shifted.

    The forward forms ``log_sum`` from ``fl(z - m)``; two passes reproduce that rounding exactly. With
    ``one_pass`` (sets that hold the argmax, so ``0 <= log_sum <= log V``), ``z - fl(m + log_sum)`` is used
    instead when forming ``m + log_sum`` rounds away less than an ulp of ``log_sum`` (ordinary temperatures):
    one pass over ``[n, V]`` instead of two, equal to fp32 rounding. At ``|m| ~ 1e7`` (tiny temperatures)
    ``m + log 3`` would lose the ``log 3`` that separates three tied logits, and a replayed set far below the
    maximum (``log_sum`` very negative) needs the forward's own rounding of ``z - m``: two passes then.
    """
    if one_pass:
        offset = row_max + log_sum
        exact = ((offset - row_max) - log_sum).abs() <= torch.finfo(log_sum.dtype).eps * (1 + log_sum.abs())
        if bool(exact.all()):
            return z - offset
    return (z - row_max).sub_(log_sum)


def log_normalised_(z: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor) -> torch.Tensor:
    """``(z - m) - log_sum`` in place (one pass where ``m + log_sum`` rounds away less than an ulp of ``log_sum``;
    :func:`log_normalised`)."""
    offset = row_max + log_sum
    exact = ((offset - row_max) - log_sum).abs() <= torch.finfo(log_sum.dtype).eps * (1 + log_sum.abs())
    if bool(exact.all()):
        return z.sub_(offset)
    return z.sub_(row_max).sub_(log_sum)


def full_softmax_backward(
    job: ChunkJob, idx: torch.Tensor, coef: Coefficients, grads: Grads, counts: list[int]
) -> None:
    """Add ``-c_F pi + g_lp 1[a=y not in S]`` for the rows ``idx`` (``[k]`` int64, ascending) to ``grads`` (their
    safe-set part comes from the sparse path; ``counts``: how many of them each forward chunk holds).

    ``pi = exp((z - m) - log sum_V exp(z - m))`` uses the forward's ``m`` and ``log sum_V``, so ``z`` must be the
    forward's logits bit for bit: each chunk holding such rows is recomputed whole, on the forward's own row slice
    (:meth:`~safevocab.fused.chunking.ChunkJob.chunks_of`). Logits of another GEMM layout (e.g.
    ``hidden.index_select`` of the rows) may be an ulp ``delta`` off, and ``exp(delta / T)`` against the forward's
    normaliser is unbounded at small ``T``. Only the rows ``idx`` go through the element-wise pass and the gradient
    GEMMs."""
    hidden = job.hidden
    logits_of = ChunkLogits(hidden, job.weight, job.bias, job.transform, job.buffer_rows)  # the forward's buffer
    for rows, at in job.chunks_of(idx, counts):
        z = _backward_logits(job, logits_of, rows)  # kept by the forward, or recomputed
        if isinstance(at, slice):  # the whole chunk: its other rows have c_F = 0 and g_lp 1[y not in S] = 0
            h = hidden[rows]
        else:  # the forward's logits of the chosen rows
            z, h = z.index_select(0, at - rows.start), hidden.index_select(0, at)
        grad = log_normalised(z, coef.row_max[at].unsqueeze(-1), coef.log_sum_full[at].unsqueeze(-1)).exp_()
        grad.mul_(coef.c_full[at].neg().unsqueeze(-1))
        grad.scatter_add_(-1, coef.targets[at].unsqueeze(-1), coef.g_target_out[at].unsqueeze(-1))
        grad = job.transform.backward_(grad, z)
        if coef.grad_shift != 1.0:
            grad.mul_(1.0 / coef.grad_shift)
        del z
        accumulate_chunk_grads(grad, h, job.weight, at, grads, coef.grad_shift)
        del grad


class TorchBackend:
    """torch passes for every chunk (CPU, or CUDA without Triton)."""

    name = "torch"

    def rows_per_chunk(self, n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
        return chunk_rows_for(n_rows, vocab, rule, in_bytes, max_chunk_bytes)

    supports_replay = True

    def forward(self, job: ChunkJob, stats: RowStats, sparse_max_density: float | None) -> list[SparseChunk]:
        return torch_forward(job, stats, sparse_max_density)

    def dense_backward(self, job: ChunkJob, chunks: list[slice], coef: Coefficients, grads: Grads) -> None:
        dense_backward(job, chunks, coef, grads)

    def full_softmax_backward(
        self, job: ChunkJob, idx: torch.Tensor, coef: Coefficients, grads: Grads, counts: list[int]
    ) -> None:
        full_softmax_backward(job, idx, coef, grads, counts)
