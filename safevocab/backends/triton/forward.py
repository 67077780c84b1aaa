"""The Triton backend's forward: every chunk's row statistics from the kernels, and the safe sets stored for the
sparse backward; and the forward of a replayed support.

:func:`forward_chunks` computes each chunk's logits on the call's route
(:class:`~safevocab.backends.triton.route.Route`: the raw GEMM output, or the torch-transformed copy), its thresholds
and the fold of :func:`~safevocab.kernels.forward_fold.forward_fold`, and stores a chunk's ``S`` as CSR when it is
small enough. The fold's last pass writes ``S``'s entries itself, into a bounded pool
(:class:`~safevocab.kernels.kept_entries.KeptPool`, sized by the gate), and
:func:`~safevocab.kernels.kept_entries.pack_kept` puts them in CSR order: no second pass over the chunk, on every
route (``TopK``/``TopP`` too: their fold is the single pass that compares each logit with ``t``). One read of the
device per call decides which chunks are stored (their kept counts against the gate), the fused op's checks with it
(:class:`~safevocab.fused.row_stats.CallReads`): a pool sized by the gate cannot overflow. Only where a pool is smaller
than its gate (the gate raised above ``kept_entries.POOL_MAX_DENSITY``) is the chunk decided at once, and if its pool
overflowed, compacted again from its logits (:func:`~safevocab.kernels.kept_entries.compact_kept`), counted in
:data:`REREAD_FALLBACKS` and logged.

Where the rule decides on masses (``top_p``, ``min_prob``, on the selection route), the rows whose thresholds take the
rule's torch code are decided in a bounded batch a chunk, with no read
(:func:`~safevocab.kernels.threshold_select.select_thresholds`' ``undecided``); whether a chunk left rows past its
batch comes back with the call's one read, and such a chunk is folded again with those rows read (its logits from its
kept buffer, else its GEMM again), counted in :data:`MASS_BATCH_REDOS` and logged; the later calls of that rule,
vocabulary and dtype read from the start (flat fp32 rows near ``q = 1`` leave most rows to the rule's code).

:func:`replay_forward` is the forward of a replayed ``support``: the rule's fold on the same logits path, then ``S``'s
own statistics from the given ids' logits, gathered and transformed as the kernel transforms them
(:func:`~safevocab.kernels.kept_entries.gather_logits`); every chunk is stored, so the backward is the sparse one. It
reads the device twice a call (where each chunk's entries start; each chunk's kept count, with the op's checks); a
call with chunks folded again after their bounded batch overflowed reads their fallback rows (one read each) and,
once more, their kept counts with the op's check of a row that keeps nothing.

Both run inside :class:`~safevocab.backends.triton.TritonBackend`'s device guard (Triton launches on the current CUDA
device).
"""

from __future__ import annotations

import logging
import math

import torch

from safevocab.backends.triton.route import SELECTION, TORCH, Route
from safevocab.fused.checks import EMPTY_SUPPORT
from safevocab.fused.chunking import ChunkJob
from safevocab.fused.row_stats import RowStats, SparseChunk
from safevocab.fused.transform import Transform
from safevocab.kernels import kept_entries
from safevocab.kernels.candidate_thresholds import MASS_DEPENDENT
from safevocab.kernels.kept_entries import KeptPool, compact_kept, gather_logits, pack_kept
from safevocab.rules import SafeVocabRule

__all__ = ["DENSE_FALLBACKS", "MASS_BATCH", "MASS_BATCH_REDOS", "REREAD_FALLBACKS", "forward_chunks", "replay_forward"]

logger = logging.getLogger("safevocab")

#: Chunks (in this process) whose safe set the forward meant to store for the sparse backward but that took the dense
#: backward instead, because a row's kept-entry count differed from the fold's ``|S|`` (same gradient, dense cost:
#: 30-40 ms a chunk on a GPU). The first one is a warning, later ones debug records; never silent.
DENSE_FALLBACKS = {"chunks": 0}
#: Chunks (in this process) whose kept entries the fold's pool did not hold (more than its capacity: only where the
#: gate is raised above ``kept_entries.POOL_MAX_DENSITY``) or that disagreed with ``|S|`` (never seen: the pool holds
#: the fold's own comparisons), so that the separate compaction read the chunk's logits again
#: (:func:`~safevocab.kernels.kept_entries.compact_kept`: the same entries, one more pass). Logged as
#: ``DENSE_FALLBACKS``.
REREAD_FALLBACKS = {"chunks": 0}
#: Entries a row of a kept-entry pool may take at least (``_pool_limit``: small vocabularies).
POOL_ROW_ENTRIES = 1024
#: Whether the selection route decides the rows its mass stages (``top_p``, ``min_prob``) leave to the rule's torch code
#: in a bounded batch, with no read of the device a chunk (``select_thresholds``' ``undecided``); ``False``: one read a
#: chunk, as before (A/B measurements, tests).
MASS_BATCH = True
#: Chunks (in this process) that a bounded batch could not decide (more rows left to the rule's code than it holds:
#: flat fp32 rows near ``q = 1``), folded again with those rows read; and the (rule, engine, vocabulary, dtype) of
#: their calls, which read from the start from then on. Logged as :data:`DENSE_FALLBACKS` is.
MASS_BATCH_REDOS: dict = {"chunks": 0, "read_from_now_on": set()}


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
    store_sparse_ok = sparse_max_density is not None and sparse_max_density > 0
    batch = _mass_batch(route, job)
    undecided = torch.zeros(job.n_rows, dtype=torch.bool, device=job.hidden.device) if batch else None
    pending: list[tuple[slice, KeptPool, int]] = []  # chunks whose pool holds whatever the gate lets through
    again: list[tuple[slice, int | None, int]] = []  # chunks the bounded batch may leave undecided
    for rows in job.slices():
        n = rows.stop - rows.start
        out = stats.rows(rows)
        # the GEMM output; on the torch route transformed, fp32 (fp64 for fp64); in a kept buffer while the cap allows
        z = logits_of.forward(rows)
        # the gate: at most this many kept logits in the chunk; every row keeps at least one, so below n it never
        # passes and the fold writes no entries
        gate = math.floor(sparse_max_density * n * job.vocab) if store_sparse_ok else -1
        capacity = min(gate, _pool_limit(n, job.vocab)) if gate >= n else None
        # the pool may overflow below the gate: decided now, while the chunk's logits are at hand for the fallback,
        # with a read of the device (so its thresholds read it too, rather than leave rows undecided)
        at_once = capacity is not None and capacity < gate
        rows_undecided = undecided[rows] if undecided is not None and not at_once else None
        pool = route.fold(z, targets[rows], out, transform, kept_capacity=capacity, undecided=rows_undecided)
        if rows_undecided is not None:
            stats.reads.add(_undecided_key(rows), rows_undecided.any())
            again.append((rows, capacity, gate))
        if at_once:
            # z: the GEMM output where the kernels transform it; the fallback's compaction transforms it again
            chunk = _stored_chunk(z, rows, out, pool, gate, transform, raw=route.transform_in_kernel)
            if chunk is not None:
                sparse_chunks.append(chunk)
        elif pool is not None:
            pending.append((rows, pool, gate))
            _queue_pending(rows, pool, stats)
        del z
    values = stats.reads.read() if pending or again else {}  # the call's one read, the fused op's checks with it
    for rows, capacity, gate in again:
        if values[_undecided_key(rows)][0]:
            pending = [chunk for chunk in pending if chunk[0] != rows]  # its pool holds the undecided rows' sets
            sparse_chunks += _fold_again(job, route, logits_of, rows, stats, capacity, gate)
    sparse_chunks += _store_pending(pending, stats, values)
    return sorted(sparse_chunks, key=lambda chunk: chunk.start)  # the chunks' order: the sparse backward's sums


def _mass_batch(route: Route, job: ChunkJob) -> bool:
    """Whether ``job``'s chunks decide their mass fallback's rows in a bounded batch (no read a chunk): on the
    selection route where a stage decides on masses, unless :data:`MASS_BATCH` is off or a call of the same rule,
    vocabulary and dtype had to fold a chunk again (:data:`MASS_BATCH_REDOS`: its rows overflow the batch, so read)."""
    if not MASS_BATCH or route.kind != SELECTION:
        return False
    if not any(part.key in MASS_DEPENDENT for stage in route.plan.stages for part in stage):
        return False
    return _batch_key(job) not in MASS_BATCH_REDOS["read_from_now_on"]


def _batch_key(job: ChunkJob) -> tuple[str, str, int, torch.dtype]:
    return str(job.rule), job.rule.engine, job.vocab, job.hidden.dtype


def _fold_again(
    job: ChunkJob, route: Route, logits_of, rows: slice, stats: RowStats, capacity: int | None, gate: int
) -> list[SparseChunk]:
    """Fold the chunk ``rows`` again, its fallback's rows read (more than the bounded batch held), and decide its
    stored set at once (:func:`_stored_chunk`, a read): the logits from its kept buffer or a GEMM again. Counted in
    :data:`MASS_BATCH_REDOS` and logged; later calls of the same rule, vocabulary and dtype read from the start."""
    _count_mass_redo(job, rows)
    z = logits_of.again(rows)
    out = stats.rows(rows)
    pool = route.fold(z, job.targets[rows].contiguous(), out, job.transform, kept_capacity=capacity)
    if pool is None:
        return []
    chunk = _stored_chunk(z, rows, out, pool, gate, job.transform, raw=route.transform_in_kernel)
    return [] if chunk is None else [chunk]


def _count_mass_redo(job: ChunkJob, rows: slice) -> None:
    """Count and log a chunk folded again (:data:`MASS_BATCH_REDOS`); later calls of its rule, vocabulary and dtype
    read their fallback's rows from the start."""
    _count_fallback(
        MASS_BATCH_REDOS,
        "MASS_BATCH_REDOS",
        rows,
        "leave more rows to the rule's torch code than the bounded batch holds, so the chunk is folded again with "
        "those rows read (its GEMM again unless kept; same values); later calls of this rule, vocabulary and dtype "
        "read them from the start",
    )
    MASS_BATCH_REDOS["read_from_now_on"].add(_batch_key(job))


def _queue_pending(rows: slice, pool: KeptPool, stats: RowStats) -> None:
    """Queue the checks that decide whether the pending chunk ``rows`` is stored, for the call's one read."""
    safe_size, finite = stats.safe_size[rows], torch.isfinite(stats.row_max[rows])
    disagree = ((pool.row_counts() != safe_size) & finite).sum() + (pool.counter[0] != safe_size.sum())
    stats.reads.add(_chunk_key(rows), torch.stack([safe_size.sum(), (~finite).sum(), disagree]))


def _store_pending(
    pending: list[tuple[slice, KeptPool, int]], stats: RowStats, values: dict[str, list[int]]
) -> list[SparseChunk]:
    """The chunks of ``pending`` (``(rows, pool, gate)``, pools as large as their gate) that keep at most ``gate``
    logits, packed from their pools, decided by ``values``: the call's one read of the device (:func:`_queue_pending`).

    Such a pool cannot overflow below the gate, and its row counts are sums of the same comparisons as ``|S|``: the
    checks read (kept logits, non-finite row maxima, the pool's count against ``|S|``'s) can only send a chunk to
    the dense backward for being too dense, or because the fused op will raise on a non-finite row; a disagreement
    (never seen: it would take a kernel that counts one comparison two ways) also goes dense, counted and logged (the
    chunk's logits are gone, so it cannot be compacted again)."""
    stored = []
    for rows, pool, gate in pending:
        kept, n_non_finite, n_disagree = values[_chunk_key(rows)]
        if kept > gate or n_non_finite:
            continue
        if n_disagree:
            _count_dense_fallback(rows)
            continue
        stored.append(SparseChunk(rows.start, *pack_kept(pool, stats.row_max[rows], kept)))
    return stored


def _chunk_key(rows: slice) -> str:
    """A chunk's name among the call's reads (:class:`~safevocab.fused.row_stats.CallReads`)."""
    return f"triton chunk {rows.start}"


def _undecided_key(rows: slice) -> str:
    """The name of a chunk's undecided rows among the call's reads."""
    return f"triton chunk {rows.start} undecided"


def _pool_limit(n: int, vocab: int) -> int:
    """Entries of a chunk's kept-entry pool at most: ``POOL_MAX_DENSITY`` of its logits, or 1024 a row if that is more
    (small vocabularies)."""
    return max(math.floor(kept_entries.POOL_MAX_DENSITY * n * vocab), min(vocab, POOL_ROW_ENTRIES) * n)


def _log_torch_threshold(rule: SafeVocabRule) -> None:
    logger.debug(
        "fused_safe_logprobs(backend='triton'): rule %r has no in-kernel threshold; its threshold is "
        "computed in torch per chunk (on torch-transformed fp32 logits) and the Triton kernels fold the rest",
        str(rule),
    )


def _count_fallback(counter: dict[str, int], name: str, rows: slice, what: str) -> None:
    """Count a chunk that left the fast path in ``counter`` and log it: a warning the first time, debug after."""
    counter["chunks"] += 1
    log = logger.warning if counter["chunks"] == 1 else logger.debug
    log(
        "fused_safe_logprobs(backend='triton'): rows %d-%d %s (%d such chunk(s) so far, "
        "safevocab.backends.triton.forward.%s)",
        rows.start,
        rows.stop - 1,
        what,
        counter["chunks"],
        name,
    )


def _count_dense_fallback(rows: slice) -> None:
    _count_fallback(
        DENSE_FALLBACKS,
        "DENSE_FALLBACKS",
        rows,
        "take the dense backward, not the sparse one: a row's kept entries do not count the fold's |S| (same gradient, "
        "a dense chunk's cost)",
    )


def _count_reread(rows: slice, why: str) -> None:
    _count_fallback(
        REREAD_FALLBACKS,
        "REREAD_FALLBACKS",
        rows,
        f"the fold's kept entries {why}, so the chunk's logits are read again to compact them (the same entries, one "
        "more pass over the chunk)",
    )


def _stored_chunk(
    z: torch.Tensor,
    rows: slice,
    out: dict[str, torch.Tensor],
    pool: KeptPool,
    gate: int,
    transform: Transform,
    raw: bool,
) -> SparseChunk | None:
    """A forward chunk's ``S`` as CSR when it keeps at most ``gate`` logits (else ``None``: the dense backward), from
    the entries the fold's last pass wrote into ``pool`` (:func:`~safevocab.kernels.kept_entries.pack_kept`: the very
    ``z`` the fold compared with ``t``, so the same ``S``, bit for bit, with no second read of the chunk).

    One read of the device for the chunk decides: its kept count against the gate, the pool's count against its
    capacity, and rows whose pool count differs from ``|S|``. Where the pool overflowed or disagreed, the chunk's
    logits are compacted again (:func:`~safevocab.kernels.kept_entries.compact_kept`; ``raw``: ``z`` is the GEMM
    output the fold transformed itself, transformed again there with the same code) and, should that count disagree
    too, the chunk takes the dense backward; both fallbacks are counted and logged. A chunk with a non-finite row
    maximum is not stored: the fused op raises on it."""
    safe_size, row_max = out["safe_size"], out["row_max"]
    finite = torch.isfinite(row_max)
    disagree = (pool.row_counts() != safe_size) & finite  # an all -inf row's |S| is V (the op raises on it)
    checks = torch.stack([safe_size.sum(), pool.counter[0].to(torch.int64), disagree.sum(), (~finite).sum()])
    # host sync: the chunk's one read, only where the gate is raised above the pool's limit (tests, sweeps): an
    # overflowing pool is compacted again from the chunk's logits, which the next chunk overwrites
    kept, written, n_disagree, n_non_finite = checks.tolist()
    if kept > gate or n_non_finite:
        return None
    if written <= pool.capacity and not n_disagree:
        return SparseChunk(rows.start, *pack_kept(pool, row_max, written))
    why = f"overflow its pool ({written} > {pool.capacity})" if written > pool.capacity else "disagree with |S|"
    _count_reread(rows, why)
    entries = compact_kept(
        z,
        out["threshold"],
        row_max,
        safe_size,
        transform.logit_scale,
        transform.softcap,
        transform.temperature,
        apply_transform=raw,
    )
    if entries is None:
        _count_dense_fallback(rows)
        return None
    return SparseChunk(rows.start, safe_size.clone(), *entries)


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
    than the support itself takes), so the backward is the sparse one. The statistics are formed over every entry of
    the support (those outside ``S`` as ``-inf`` or 0), and the entries in ``S`` kept once the call's one read has
    given their count (:func:`_compacted`): no read a chunk."""
    if job.n_rows == 0:
        return []
    targets = job.targets.contiguous()
    logits_of = route.chunk_logits(job)
    support, slices = job.support, job.slices()
    # where each chunk's entries start in the support (their count sizes the chunk's gather): from its host copy
    bounds = support.entry_starts([*range(0, job.n_rows, job.chunk_rows), job.n_rows])
    undecided = torch.zeros(job.n_rows, dtype=torch.bool, device=job.hidden.device) if _mass_batch(route, job) else None

    def replayed_chunk(z: torch.Tensor, i: int, rows: slice, rows_undecided: torch.Tensor | None = None) -> tuple:
        out = stats.rows(rows)
        # z: the GEMM output (the rule's thresholds from it, as forward_chunks computes them), or the torch copy
        route.fold(z, targets[rows], out, job.transform, undecided=rows_undecided)
        raw = route.transform_in_kernel  # z is the GEMM output, which the gather transforms
        lo, hi = bounds[i], bounds[i + 1]
        sizes = support.offsets[rows.start : rows.stop + 1].diff()
        local = torch.arange(rows.stop - rows.start, device=z.device)
        local_row = torch.repeat_interleave(local, sizes, output_size=hi - lo)
        return _replayed_rows(z, rows, local_row, support.token_ids[lo:hi], targets, stats, job.transform, raw)

    pending = []
    for i, rows in enumerate(slices):
        z = logits_of.forward(rows)  # in a kept buffer while the job's cap allows
        rows_undecided = None if undecided is None else undecided[rows]
        counts, keep, ids, shifted = replayed_chunk(z, i, rows, rows_undecided)
        stats.reads.add(_chunk_key(rows), counts.sum())
        if rows_undecided is not None:
            stats.reads.add(_undecided_key(rows), rows_undecided.any())
        pending.append((rows.start, counts, keep, ids, shifted))
        del z
    values = stats.reads.read()  # the call's one read: each chunk's kept count, the fused op's checks with it
    redone = [i for i, rows in enumerate(slices) if undecided is not None and values[_undecided_key(rows)][0]]
    for i in redone:  # more rows for the rule's code than the bounded batch held: folded again, those rows read
        rows = slices[i]
        _count_mass_redo(job, rows)
        counts, keep, ids, shifted = replayed_chunk(logits_of.again(rows), i, rows)
        pending[i] = (rows.start, counts, keep, ids, shifted)
        stats.reads.add(_chunk_key(rows), counts.sum())
    if redone:
        # the op's checks that read |S| (a replayed row that keeps nothing) saw the batch's estimates: formed again
        stats.reads.again(EMPTY_SUPPORT)
        values = stats.reads.read()  # host sync: the redone chunks' kept counts, with those checks
    return [_compacted(*chunk, values[_chunk_key(rows)][0]) for rows, chunk in zip(slices, pending)]


def _replayed_rows(
    z: torch.Tensor,
    rows: slice,
    local_row: torch.Tensor,
    ids: torch.Tensor,
    targets: torch.Tensor,
    stats: RowStats,
    transform: Transform,
    apply_transform: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``S``'s statistics of the rows ``rows`` (overwriting the rule fold's), from the support's entries ``(local_row,
    ids)`` of those rows, with no read of the device: ``(|S| [n], keep, ids, z - m_S)``, the last three over every
    entry (:func:`_compacted` keeps the entries in ``S`` once their count is read)."""
    n = rows.stop - rows.start
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
    # every entry, those outside S as -inf (maximum) or 0 (sums): S's values, summed in the same order
    m_s = torch.full((n,), -torch.inf, dtype=stat, device=z.device)
    m_s.scatter_reduce_(0, local_row, torch.where(keep, z_ids, -torch.inf), reduce="amax")
    shifted = z_ids - m_s.index_select(0, local_row)
    e = torch.where(keep, shifted.exp().to(torch.float64), 0.0)
    total = torch.zeros(n, dtype=torch.float64, device=z.device).index_add_(0, local_row, e)
    stats.set_max[rows] = m_s
    stats.log_sum_safe[rows] = total.log()
    if stats.entropy is not None:
        weighted = torch.where(keep, e * shifted.to(torch.float64), 0.0)
        weighted = torch.zeros_like(total).index_add_(0, local_row, weighted)
        stats.entropy[rows] = (total.log() - weighted / total).to(stat)
    counts = torch.zeros(n, dtype=torch.int64, device=z.device).index_add_(0, local_row, keep.to(torch.int64))
    stats.safe_size[rows] = counts
    hit = keep & (ids == targets[rows].index_select(0, local_row))
    stats.in_safe[rows] = torch.zeros(n, dtype=torch.int64, device=z.device).index_add_(0, local_row, hit.long()) > 0
    stats.target_shift_safe[rows] = z_y - m_s
    return counts, keep, ids, shifted


def _compacted(
    start: int, counts: torch.Tensor, keep: torch.Tensor, ids: torch.Tensor, shifted: torch.Tensor, kept: int
) -> SparseChunk:
    """The chunk's ``S`` as CSR: the entries with ``keep`` (``kept`` of them, read) in the support's order, which a
    stable sort of the flags puts first, with no further read of the device."""
    order = torch.sort((~keep).to(torch.uint8), stable=True).indices[:kept]
    return SparseChunk(start, counts, ids.index_select(0, order).to(torch.int32), shifted.index_select(0, order))
