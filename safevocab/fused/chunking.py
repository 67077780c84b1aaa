"""One call of the fused op cut into chunks of rows: the job every per-chunk call reads, the row slices, and a
chunk's transformed logits, computed identically in forward and backward.

The fused op (:mod:`safevocab.fused.op`) walks ``[N, H]`` hidden states in chunks of rows, never materialising
``[N, V]``. A backend (:mod:`safevocab.backends.torch_backend`, the Triton one in :mod:`safevocab.backends.triton`)
folds each chunk's logits into per-row statistics and, in backward, turns a recomputed chunk into its logits gradient:

- :class:`ChunkJob`: what every per-chunk call of a backend needs (the operands, the rule, the transform, the rows per
  chunk, a replayed support), built once per forward and once per backward;
- :func:`chunk_slices` and :class:`ChunkLogits`: the row slices and the chunk GEMM, identical in forward and
  backward, so a recomputed chunk is bit-identical to the forward's; :func:`balanced_chunk_rows`: equal chunk sizes;
  :func:`forward_chunks_of`: the forward chunks holding given rows.

The data a backend writes and reads lives beside this module: the per-row statistics and CSR sets
(:mod:`safevocab.fused.row_stats`), the backward coefficients (:mod:`safevocab.fused.coefficients`), the transform
(:mod:`safevocab.fused.transform`) and the gradient GEMMs (:mod:`safevocab.fused.grads`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from safevocab.fused.transform import Transform
from safevocab.rules import SafeVocabRule
from safevocab.support import SafeSupport

__all__ = [
    "CHUNK_ROW_MULTIPLE",
    "ChunkJob",
    "ChunkLogits",
    "balanced_chunk_rows",
    "chunk_slices",
    "forward_chunks_of",
]


@dataclass(frozen=True)
class ChunkJob:
    """One call of the fused op as every per-chunk call of a backend reads it: the rows and the LM head, the targets,
    the rule and the transform, how many rows a chunk holds, and a replayed support.

    The fused op builds it in its forward and again in its backward, from the tensors it saved (a sharded weight is
    gathered again there); a backend reads it and never changes it. Its chunks (:meth:`slices`) are the same row
    slices in forward and backward, so a recomputed chunk is the forward's bit for bit.

    Attributes:
        hidden: ``[N, H]`` hidden states (the rows), float32/bfloat16/float16/float64.
        weight: ``[V, H]`` LM-head weight, ``hidden``'s dtype.
        bias: ``[V]`` LM-head bias in ``hidden``'s dtype, or ``None`` (no bias).
        targets: ``[N]`` int64 token ids in ``[0, V)``.
        rule: the safe-vocabulary rule, ``S = {z >= t}`` with ``t`` its threshold (``NoPruning`` for no rule).
        transform: the sampler's logit transform, applied to ``hidden @ weight.T + bias`` before everything else.
        chunk_rows: rows per chunk (at least 1): the backend's ``rows_per_chunk`` for these operands.
        support: replayed kept ids per row, on ``hidden``'s device, for a backend whose ``supports_replay``: ``S`` is
            its ids intersected with the rule's set. Default ``None``: ``S`` is the rule's set.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor
    rule: SafeVocabRule
    transform: Transform
    chunk_rows: int
    support: SafeSupport | None = None

    @property
    def n_rows(self) -> int:
        """``N``, the rows of the call."""
        return self.hidden.shape[0]

    @property
    def vocab(self) -> int:
        """``V``, the vocabulary size."""
        return self.weight.shape[0]

    @property
    def buffer_rows(self) -> int:
        """Rows of a chunk's reused buffers, ``min(chunk_rows, N)``: forward and backward size them alike."""
        return min(self.chunk_rows, self.n_rows)

    def slices(self) -> list[slice]:
        """The row slices of the chunks (:func:`chunk_slices`), identical in forward and backward."""
        return chunk_slices(self.n_rows, self.chunk_rows)

    def chunks_of(self, idx: torch.Tensor) -> list[tuple[slice, slice | torch.Tensor]]:
        """The forward chunks holding the rows ``idx`` (ascending), each with the rows to fold
        (:func:`forward_chunks_of`)."""
        return forward_chunks_of(idx, self.n_rows, self.chunk_rows)


#: Row chunks are sized in multiples of this (:func:`balanced_chunk_rows`): the GEMMs of a chunk tile its rows by 128
#: (cuBLAS/CUTLASS output tiles on Hopper), so a chunk of ``128 k + 1`` rows runs a nearly idle extra tile row.
CHUNK_ROW_MULTIPLE = 128


def balanced_chunk_rows(n_rows: int, max_rows: int, multiple: int = CHUNK_ROW_MULTIPLE) -> int:
    """Rows per chunk for ``n_rows`` rows and at most ``max_rows`` a chunk: as few chunks as ``max_rows``-row ones
    (``n = ceil(n_rows / max_rows)``), of balanced sizes ``ceil(n_rows / n)`` rounded up to a multiple of
    ``multiple`` where that still fits ``max_rows`` (else left unrounded: rounding down would add a chunk).

    ``max_rows``-row chunks leave a short tail (8192 rows by 3533: 3533, 3533, 1126), a GEMM too small to fill the
    device; balanced ones do not (2816, 2816, 2560). Never more chunks than ``max_rows``-row ones, never more rows
    than ``max_rows``, never fewer than 1; ``n_rows <= max_rows`` gives one chunk of ``n_rows``.
    """
    max_rows = max(1, max_rows)
    if n_rows <= max_rows:
        return max(1, n_rows)
    n_chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // n_chunks)
    rounded = -(-rows // multiple) * multiple
    return rounded if rounded <= max_rows else rows


def chunk_slices(n_rows: int, chunk_rows: int) -> list[slice]:
    """The row slices of the chunks, identical in forward and backward."""
    return [slice(start, min(start + chunk_rows, n_rows)) for start in range(0, n_rows, chunk_rows)]


def forward_chunks_of(idx: torch.Tensor, n_rows: int, chunk_rows: int) -> list[tuple[slice, slice | torch.Tensor]]:
    """The forward chunks (:func:`chunk_slices`) holding the rows ``idx`` (ascending), each with the rows to fold:
    ``[(rows, at)]``, ``at`` the slice ``rows`` itself (the whole chunk, no gather) when ``idx`` holds at least half
    of its rows, else that chunk's part of ``idx``. The whole chunk is for callers to whose other rows the
    computation adds nothing (the full-softmax part: zero coefficients there)."""
    if idx.numel() == 0:
        return []
    chunk_of = torch.div(idx, chunk_rows, rounding_mode="floor")
    chunks, counts = torch.unique_consecutive(chunk_of, return_counts=True)
    out: list[tuple[slice, slice | torch.Tensor]] = []
    for chunk, part in zip(chunks.tolist(), idx.split(counts.tolist())):
        rows = slice(chunk * chunk_rows, min((chunk + 1) * chunk_rows, n_rows))
        out.append((rows, rows if 2 * part.numel() >= rows.stop - rows.start else part))
    return out


class ChunkLogits:
    """Computes transformed logits of a chunk of rows into one reused buffer (no page faults per chunk).

    Forward and backward build one each with the same ``rows`` and call it on the same row slices of
    ``hidden``, so a recomputed chunk is bit-identical to the forward's.
    """

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: Transform, rows: int
    ):
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
