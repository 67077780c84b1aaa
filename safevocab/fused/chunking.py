"""One call of the fused op cut into chunks of rows: the job every per-chunk call reads, the row slices, and a
chunk's transformed logits, computed identically in forward and backward.

The fused op (:mod:`safevocab.fused.op`) walks ``[N, H]`` hidden states in chunks of rows, never materialising
``[N, V]``. A backend (:mod:`safevocab.backends.torch_backend`, the Triton one in :mod:`safevocab.backends.triton`)
folds each chunk's logits into per-row statistics and, in backward, turns a recomputed chunk into its logits gradient:

- :class:`ChunkJob`: what every per-chunk call of a backend needs (the operands, the rule, the transform, the rows per
  chunk, a replayed support), built once per forward and once per backward;
- :func:`chunk_slices` and :class:`ChunkLogits`: the row slices and the chunk GEMM, identical in forward and
  backward, so a recomputed chunk is bit-identical to the forward's; :func:`balanced_chunk_rows`: equal chunk sizes;
  :func:`forward_chunks_of`: the forward chunks holding given rows;
- :class:`KeptLogits`: the chunks' logits buffers a forward keeps for its backward, within the caller's byte cap
  (``keep_logits_bytes``), so that the backward folds them instead of recomputing them (one GEMM fewer a chunk).

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
    "LEAVING_ROWS",
    "ChunkJob",
    "ChunkLogits",
    "KeptLogits",
    "balanced_chunk_rows",
    "chunk_slices",
    "forward_chunks_of",
    "rows_per_chunk",
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
        kept_logits: the call's kept chunk buffers (:class:`KeptLogits`; the one mutable part of a job, shared by its
            forward and backward), or ``None`` (default): every backward recomputes its chunks.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor
    rule: SafeVocabRule
    transform: Transform
    chunk_rows: int
    support: SafeSupport | None = None
    kept_logits: KeptLogits | None = None

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

    def chunks_of(self, idx: torch.Tensor, counts: list[int]) -> list[tuple[slice, slice | torch.Tensor]]:
        """The forward chunks holding the rows ``idx`` (ascending), each with the rows to fold
        (:func:`forward_chunks_of`; ``counts``: how many of ``idx`` each forward chunk holds)."""
        return forward_chunks_of(idx, self.n_rows, self.chunk_rows, counts)

    def keeps(self, rows: slice, nbytes: int) -> bool:
        """Whether the forward keeps the chunk ``rows`` in a buffer of its own (``nbytes`` bytes) for the backward
        (:meth:`KeptLogits.reserve`; ``False`` without :attr:`kept_logits`)."""
        return self.kept_logits is not None and self.kept_logits.reserve(nbytes)

    def kept(self, rows: slice) -> torch.Tensor | None:
        """The buffer the forward kept for the chunk ``rows``, left kept (``None``: none kept)."""
        return None if self.kept_logits is None else self.kept_logits.peek(rows.start)

    def take_kept(self, rows: slice) -> torch.Tensor | None:
        """The buffer the forward kept for the chunk ``rows``, handed over once (:meth:`KeptLogits.take`), or
        ``None``: recompute it."""
        return None if self.kept_logits is None else self.kept_logits.take(rows.start)


class KeptLogits:
    """The buffers of chunks' logits a forward keeps for its backward, within a byte cap: the fused op's
    ``keep_logits_bytes`` (:func:`safevocab.fused_safe_logprobs`).

    A backend offers each forward chunk in order (:meth:`reserve`, with the bytes its buffer will take); chunks are kept
    while the running total stays within ``max_bytes``, and the first that does not fit closes the store, so the kept
    chunks are the call's first ones and the rest recompute. A kept chunk's buffer is the one its forward fold read, in
    a tensor of its own (``[rows, V]``: the reused buffer would be overwritten by the next chunk), so the backward
    folds the forward's logits bit for bit without the GEMM that would recompute them.

    The backward writes the logits gradient over the buffer, so each is handed over once (:meth:`take` drops the
    reference) and the fused op drops the rest when its backward ends (:meth:`clear`): a second backward
    (``retain_graph=True``) recomputes every chunk, and no buffer outlives the backward that used it.

    Args:
        max_bytes: the cap, at least 1 (the fused op builds no store for 0).
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        #: Bytes reserved by the kept chunks (their buffers' real sizes).
        self.reserved = 0
        self._open = True
        self._buffers: dict[int, torch.Tensor] = {}

    def reserve(self, nbytes: int) -> bool:
        """Whether the next forward chunk is kept: its buffer's ``nbytes`` fit the cap with every chunk kept before
        it, and no earlier chunk was refused. The caller then hands its buffer over (:meth:`put`)."""
        if self._open and self.reserved + nbytes <= self.max_bytes:
            self.reserved += nbytes
            return True
        self._open = False  # in forward order: the first chunk that does not fit ends the keeping
        return False

    def put(self, start: int, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (``[rows, V]``, reserved with :meth:`reserve`) for the chunk starting at row ``start``."""
        self._buffers[start] = buffer

    def peek(self, start: int) -> torch.Tensor | None:
        """The kept buffer of the chunk starting at row ``start``, left in the store, or ``None``."""
        return self._buffers.get(start)

    def take(self, start: int) -> torch.Tensor | None:
        """The kept buffer of the chunk starting at row ``start``, removed from the store (the backward overwrites it),
        or ``None`` when none is kept (never, refused, or taken already)."""
        return self._buffers.pop(start, None)

    def release(self, start: int) -> None:
        """Drop the buffer of the chunk starting at row ``start`` (a forward that found its backward will not need
        it), give its bytes back, and keep no further chunk."""
        buffer = self._buffers.pop(start, None)
        if buffer is not None:
            self.reserved -= buffer.numel() * buffer.element_size()
        self._open = False

    def clear(self) -> None:
        """Drop every buffer still kept (the fused op, when its backward ends: those it did not read too)."""
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers held now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)


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


def forward_chunks_of(
    idx: torch.Tensor, n_rows: int, chunk_rows: int, counts: list[int]
) -> list[tuple[slice, slice | torch.Tensor]]:
    """The forward chunks (:func:`chunk_slices`) holding the rows ``idx`` (ascending), each with the rows to fold:
    ``[(rows, at)]``, ``at`` the slice ``rows`` itself (the whole chunk, no gather) when ``idx`` holds at least half
    of its rows, else that chunk's part of ``idx``. The whole chunk is for callers to whose other rows the
    computation adds nothing (the full-softmax part: zero coefficients there).

    ``counts`` (one per forward chunk: how many rows of ``idx`` it holds, as the caller read them with
    :func:`rows_per_chunk`) split ``idx`` with no read of the device."""
    held = [(chunk, count) for chunk, count in enumerate(counts) if count]
    chunks = [chunk for chunk, _ in held]
    parts = idx.split([count for _, count in held]) if held else []
    out: list[tuple[slice, slice | torch.Tensor]] = []
    for chunk, part in zip(chunks, parts):
        rows = slice(chunk * chunk_rows, min((chunk + 1) * chunk_rows, n_rows))
        out.append((rows, rows if 2 * part.numel() >= rows.stop - rows.start else part))
    return out


#: The backward's read (``Coefficients.reads``) of the stored chunks' rows whose gradient leaves ``S``, per forward
#: chunk (:func:`rows_per_chunk`).
LEAVING_ROWS = "rows leaving S"


def rows_per_chunk(rows: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """``[C]`` int32 on the device: how many ``True`` rows of ``rows`` (``[N]`` bool) each forward chunk of
    ``chunk_rows`` rows holds. No read of the device (the caller reads it with its other values; the rows' indices
    then come from ``torch.nonzero_static`` of that size, and :func:`forward_chunks_of` splits them)."""
    n_rows = rows.shape[0]
    n_chunks = -(-n_rows // chunk_rows)
    padded = torch.zeros(n_chunks * chunk_rows, dtype=torch.int32, device=rows.device)
    padded[:n_rows] = rows
    return padded.view(n_chunks, chunk_rows).sum(-1)


class ChunkLogits:
    """Computes transformed logits of a chunk of rows into one reused buffer (no page faults per chunk).

    Forward and backward build one each with the same ``rows`` and call it on the same row slices of
    ``hidden``, so a recomputed chunk is bit-identical to the forward's. The reused buffers (``[rows, V]``: the
    transformed logits in the statistics' dtype, and for half inputs the GEMM output in theirs) are allocated on first
    use: a call whose chunks all come from kept buffers (:class:`KeptLogits`) needs only what it touches.

    The parts, for a kept chunk: :meth:`gemm` (the GEMM output, into a given buffer or the reused one) and
    :meth:`transformed` (the statistics-dtype logits of a GEMM output, by the same copy and transform); calling the
    object runs both on the reused buffers.
    """

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: Transform, rows: int
    ):
        self.weight_t, self.bias, self.transform = weight.t(), bias, transform
        #: The statistics' dtype (fp64 for fp64 inputs, else fp32): the transformed logits'.
        self.stat = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        self.in_dtype, self.device = hidden.dtype, hidden.device
        self.shape = (rows, weight.shape[0])
        self._buf: torch.Tensor | None = None
        self._raw: torch.Tensor | None = None
        self.neg_inf_cols = None
        if bias is not None and transform.softcap is not None:
            self.neg_inf_cols = (bias == -torch.inf).nonzero().squeeze(-1)

    def buffer(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the reused statistics-dtype buffer."""
        if self._buf is None:
            self._buf = torch.empty(self.shape, device=self.device, dtype=self.stat)
        return self._buf[:n]

    def raw_buffer(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the reused buffer in the inputs' dtype: the GEMM's (the statistics-dtype buffer
        itself for fp32/fp64 inputs, whose GEMM writes the logits in place)."""
        if self.in_dtype == self.stat:
            return self.buffer(n)
        if self._raw is None:
            self._raw = torch.empty(self.shape, device=self.device, dtype=self.in_dtype)
        return self._raw[:n]

    def gemm(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The raw logits ``h @ weight.T (+ bias)`` of the rows ``h`` (``[n, H]``) in the inputs' dtype, written into
        ``out`` (``[n, V]``, contiguous: a kept chunk's own buffer, laid out as the reused one) or the reused
        buffer (default)."""
        out = self.raw_buffer(h.shape[0]) if out is None else out
        if self.bias is None:
            torch.mm(h, self.weight_t, out=out)
        else:
            torch.addmm(self.bias, h, self.weight_t, out=out)
        return out

    def transformed(self, raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The transformed logits (statistics' dtype) of the GEMM output ``raw`` (``[n, V]``), written into ``out``
        (default: over ``raw`` itself where it is in the statistics' dtype, else into the reused buffer)."""
        z = out if out is not None else (raw if raw.dtype == self.stat else self.buffer(raw.shape[0]))
        if z is not raw:
            z.copy_(raw)  # the GEMM rounds to the inputs' dtype, exactly as materialised logits would be
        return self.transform.apply_(z, self.neg_inf_cols)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.transformed(self.gemm(h))
