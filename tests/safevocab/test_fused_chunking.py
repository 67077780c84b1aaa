"""``safevocab.fused.chunking``: the chunk job every per-chunk call of a backend reads, and the chunks it cuts the rows
into (the same row slices in forward and backward)."""

import dataclasses

import pytest
import torch

from safevocab import parse_rule
from safevocab.fused.chunking import ChunkJob, chunk_slices, forward_chunks_of, rows_per_chunk
from safevocab.fused.transform import Transform


def _job(n_rows: int, chunk_rows: int) -> ChunkJob:
    hidden, weight = torch.zeros(n_rows, 3), torch.zeros(7, 3)
    targets = torch.zeros(n_rows, dtype=torch.int64)
    return ChunkJob(hidden, weight, None, targets, parse_rule("top_k=2"), Transform(1.0, None, 1.0), chunk_rows)


def _reference_split(idx: torch.Tensor, n_rows: int, chunk_rows: int) -> list[tuple[slice, slice | torch.Tensor]]:
    """The chunks holding rows of ``idx`` and what to fold of each, from the definition: every forward chunk with one
    of them, the whole chunk when it holds at least half of its rows, else its rows of ``idx``."""
    out = []
    for rows in chunk_slices(n_rows, chunk_rows):
        part = idx[(idx >= rows.start) & (idx < rows.stop)]
        if part.numel():
            out.append((rows, rows if 2 * part.numel() >= rows.stop - rows.start else part))
    return out


def _same_chunks(got, want) -> None:
    assert [rows for rows, _ in got] == [rows for rows, _ in want]
    for (_, at), (_, expected) in zip(got, want, strict=True):
        assert at == expected if isinstance(at, slice) and isinstance(expected, slice) else torch.equal(at, expected)


@pytest.mark.parametrize("n_rows, chunk_rows", [(0, 4), (1, 4), (10, 4), (12, 4), (3, 10)])
def test_a_job_cuts_its_rows_as_the_chunk_functions_do(n_rows, chunk_rows):
    job = _job(n_rows, chunk_rows)
    assert (job.n_rows, job.vocab, job.support) == (n_rows, 7, None)  # no replayed support by default
    assert job.buffer_rows == min(chunk_rows, n_rows)
    assert job.slices() == chunk_slices(n_rows, chunk_rows)
    idx = torch.arange(0, n_rows, 3)
    counts = [int(((idx >= s.start) & (idx < s.stop)).sum()) for s in job.slices()]
    _same_chunks(job.chunks_of(idx, counts), forward_chunks_of(idx, n_rows, chunk_rows, counts))


@pytest.mark.parametrize("n_rows, chunk_rows", [(1, 4), (10, 4), (12, 4), (3, 10), (37, 5)])
@pytest.mark.parametrize("seed", range(4))
def test_rows_per_chunk_and_the_counted_split_find_the_rows_of_each_chunk(n_rows, chunk_rows, seed):
    """The backward's one read (rows per forward chunk), the indices by ``nonzero_static`` of that size and the split
    by those counts give the indices ``nonzero`` gives and the chunks of the definition, each with the same rows to
    fold; also for no row at all and for every row."""
    g = torch.Generator().manual_seed(seed)
    for rows in (
        torch.rand(n_rows, generator=g) < 0.3,
        torch.zeros(n_rows, dtype=torch.bool),
        torch.ones(n_rows, dtype=torch.bool),
    ):
        counts = rows_per_chunk(rows, chunk_rows).tolist()
        assert counts == [int(rows[s].sum()) for s in chunk_slices(n_rows, chunk_rows)]
        idx = torch.nonzero_static(rows, size=sum(counts)).squeeze(-1)
        assert torch.equal(idx, rows.nonzero().squeeze(-1))
        _same_chunks(forward_chunks_of(idx, n_rows, chunk_rows, counts), _reference_split(idx, n_rows, chunk_rows))


def test_a_job_is_frozen():
    job = _job(5, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.chunk_rows = 3
