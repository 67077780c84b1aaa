"""The Triton backend's forward: every chunk's row statistics from the kernels, and the safe sets stored for the
sparse backward; and the forward of a replayed support.

:func:`forward_chunks` computes each chunk's logits on the call's route
(:class:`~safevocab.backends.triton.route.Route`: the raw GEMM output, or the torch-transformed copy), its thresholds
and the fold of
:func:`~safevocab.kernels.forward_fold.forward_fold`, and stores a chunk's ``S`` as CSR when it is small enough
(:func:`~safevocab.kernels.kept_entries.compact_kept`, from the very logits the kernel compared with ``t``).

:func:`replay_forward` is the forward of a replayed ``support``: the rule's fold on the same logits path, then ``S``'s
own statistics from the given ids' logits, gathered and transformed as the kernel transforms them
(:func:`~safevocab.kernels.kept_entries.gather_logits`); every chunk is stored, so the backward is the sparse one.

Both run inside :class:`~safevocab.backends.triton.TritonBackend`'s device guard (Triton launches on the current CUDA
device).
"""

from __future__ import annotations

import logging

import torch

from safevocab.backends.triton.route import TORCH, Route
from safevocab.fused.chunking import ChunkJob
from safevocab.fused.row_stats import RowStats, SparseChunk
from safevocab.fused.transform import Transform
from safevocab.kernels.kept_entries import compact_kept, gather_logits
from safevocab.rules import SafeVocabRule
from safevocab.support import SafeSupport

__all__ = ["DENSE_FALLBACKS", "forward_chunks", "replay_forward"]

logger = logging.getLogger("safevocab")

#: Chunks (in this process) whose safe set the forward meant to store for the sparse backward but that took the dense
#: backward instead, because a row's kept-entry count differed from the fold's ``|S|`` (same gradient, dense cost:
#: 30-40 ms a chunk on a GPU). The first one is a warning, later ones debug records; never silent.
DENSE_FALLBACKS = {"chunks": 0}


def forward_chunks(job: ChunkJob, route: Route, stats: RowStats, sparse_max_density: float | None) -> list[SparseChunk]:
    """Fill the per-row statistics of every chunk of ``job`` on ``route``; return the safe sets stored for the sparse
    backward.

    Args:
        job: the call (``job.support`` is ``None``: the rule's sets).
        route: ``job``'s route (:meth:`Route.of <safevocab.backends.triton.route.Route.of>`).
        stats: the preallocated ``[N]`` outputs, written here.
        sparse_max_density: store a chunk's ``S`` as CSR when at most this fraction of its logits is kept;
            ``None`` never stores (bf16/fp16 inputs).
    """
    sparse_chunks: list[SparseChunk] = []
    if job.n_rows == 0:
        return sparse_chunks
    targets = job.targets.contiguous()
    if route.kind == TORCH:
        _log_torch_threshold(job.rule)
    logits_of = route.chunk_logits(job)
    transform = job.transform
    identity = transform.logit_scale == 1.0 and transform.softcap is None and transform.temperature == 1.0
    store_sparse_ok = sparse_max_density is not None and sparse_max_density > 0
    for rows in job.slices():
        n = rows.stop - rows.start
        out = stats.rows(rows)
        z, _ = logits_of(job.hidden[rows])  # the GEMM output; on the torch route transformed, fp32 (fp64 for fp64)
        # the sparse path reads the kept logits back: transformed ones, written by the kernel (fp32/fp64)
        store_z = route.transform_in_kernel and store_sparse_ok and not identity and not _is_half(z)
        route.fold(z, targets[rows], out, transform, store_z=store_z)
        if store_sparse_ok and int(out["safe_size"].sum()) <= sparse_max_density * n * job.vocab:
            raw = route.transform_in_kernel and _is_half(z)  # the GEMM output, untransformed
            chunk = _sparse_chunk(z, rows.start, out, transform, raw=raw)
            if chunk is not None:
                sparse_chunks.append(chunk)
            else:
                _count_dense_fallback(rows)
        del z
    return sparse_chunks


def _log_torch_threshold(rule: SafeVocabRule) -> None:
    logger.debug(
        "fused_safe_logprobs(backend='triton'): rule %r has no in-kernel threshold; its threshold is "
        "computed in torch per chunk (on torch-transformed fp32 logits) and the Triton kernels fold the rest",
        str(rule),
    )


def _count_dense_fallback(rows: slice) -> None:
    DENSE_FALLBACKS["chunks"] += 1
    log = logger.warning if DENSE_FALLBACKS["chunks"] == 1 else logger.debug
    log(
        "fused_safe_logprobs(backend='triton'): rows %d-%d take the dense backward, not the sparse one: a row's kept "
        "entries, compacted from the chunk's logits, do not count the fold's |S| (same gradient, a dense chunk's cost; "
        "%d such chunk(s) so far, safevocab.backends.triton.forward.DENSE_FALLBACKS)",
        rows.start,
        rows.stop - 1,
        DENSE_FALLBACKS["chunks"],
    )


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


def replay_forward(job: ChunkJob, route: Route, stats: RowStats) -> list[SparseChunk]:
    """The forward of a replayed ``job.support`` (``S`` = its ids of each row with ``z >= t``, ``t`` the rule's
    threshold), as the torch backend computes it (:mod:`safevocab.backends.torch_backend`), every chunk stored sparsely.

    Per chunk: the rule's fold (:meth:`~safevocab.backends.triton.route.Route.fold` on the logits path the
    backward's full-softmax part recomputes, :meth:`~safevocab.backends.triton.route.Route.chunk_logits`) gives
    ``m``, ``t``, ``log sum_V`` and ``z_y - m``; the given ids' logits and the targets' are gathered and transformed
    as the kernel transforms them (:func:`~safevocab.kernels.kept_entries.gather_logits`), and ``S``'s own statistics
    formed from them in ``O(|S|)`` work: its shift ``m_S`` (maximum; ``-inf`` for a row that keeps nothing, which
    ``FusedSafeLogProbs`` then refuses), ``log sum_S exp(z - m_S)`` and the entropy summed in float64, ``|S|``,
    ``in_safe`` and ``z_y - m_S``. Ids may come in any order. Every chunk's ``S`` is stored (8 bytes an entry, no more
    than the support itself takes), so the backward is the sparse one."""
    sparse_chunks: list[SparseChunk] = []
    if job.n_rows == 0:
        return sparse_chunks
    targets = job.targets.contiguous()
    logits_of = route.chunk_logits(job)
    for rows in job.slices():
        z, _ = logits_of(job.hidden[rows])
        out = stats.rows(rows)
        # z: the GEMM output (the rule's thresholds from it, as forward_chunks computes them), or the torch copy
        route.fold(z, targets[rows], out, job.transform)
        raw = route.transform_in_kernel  # z is the GEMM output, which the gather transforms
        sparse_chunks.append(_replayed_chunk(z, rows, targets, job.support, stats, job.transform, raw))
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
