"""The protocol a backend of the fused op implements: the op's contract, so it lives with the op (the backends import
it; the op imports no backend).

:class:`safevocab.fused.op.FusedSafeLogProbs` owns the autograd bookkeeping (row statistics, the sparse
backward, the full-softmax part, the non-finite check); a backend owns the per-chunk arithmetic on dense
logits. Two implement it: :class:`safevocab.backends.torch_backend.TorchBackend` (torch passes, any device) and
:class:`safevocab.backends.triton.TritonBackend` (Triton kernels, CUDA or Triton's interpreter);
:mod:`safevocab.backends.registry` builds them by name. No backend imports the autograd function; the data they
exchange lives in :mod:`safevocab.fused` (a call's :class:`~safevocab.fused.chunking.ChunkJob`, the
:class:`~safevocab.fused.row_stats.RowStats` a forward writes, the
:class:`~safevocab.fused.coefficients.Coefficients` a backward reads).

Every per-chunk call takes the call's :class:`~safevocab.fused.chunking.ChunkJob` first: the operands
(``hidden [N, H]``, ``weight [V, H]``, ``bias [V]`` or ``None``, ``targets [N]``), the rule, the transform, the rows
per chunk and, for a backend that replays, the replayed support.

A backend may also define ``sparse_backward(job, chunks, coef, grads)``: the safe-set part of the gradient of all
its stored chunks (:class:`~safevocab.fused.row_stats.SparseChunk`) at once, in place of the fused op's torch sparse
GEMMs; the fused op then stores ``S`` for every input dtype (:func:`safevocab.fused.op.sparse_density`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from safevocab.fused.chunking import ChunkJob
from safevocab.fused.coefficients import Coefficients
from safevocab.fused.grads import Grads
from safevocab.fused.row_stats import RowStats, SparseChunk
from safevocab.rules import SafeVocabRule

__all__ = ["FusedBackend"]


class FusedBackend(Protocol):
    """Per-chunk arithmetic of the fused op: rows per chunk, forward fold, dense backward, full-softmax part."""

    #: Its key in :data:`safevocab.backends.registry.BACKENDS` (``"torch"``, ``"triton"``).
    name: str
    #: Whether :meth:`forward` and :meth:`dense_backward` take a job with a replayed ``support`` (``SafeSupport``).
    supports_replay: bool

    def rows_per_chunk(self, n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
        """Rows per chunk (at least 1) so that one chunk's scratch fits ``max_chunk_bytes``, for ``n_rows`` rows, a
        vocabulary of ``vocab``, ``rule`` and inputs of ``in_bytes`` bytes an element: the job's ``chunk_rows``."""
        ...

    def forward(self, job: ChunkJob, stats: RowStats, sparse_max_density: float | None) -> list[SparseChunk]:
        """Fill ``stats`` (each ``[N]``, preallocated) for every chunk of ``job`` (:meth:`ChunkJob.slices`); return
        the chunks whose safe sets keep at most ``sparse_max_density`` of their logits, as CSR (``None``: never).
        With a ``job.support`` (only when :attr:`supports_replay`), ``S`` is its ids intersected with the rule's
        set. With a ``job.kept_logits``, each chunk the cap lets through (:meth:`ChunkJob.keeps`, in forward order)
        computes its logits into a buffer of its own, put there for the backward."""
        ...

    def dense_backward(self, job: ChunkJob, chunks: list[slice], coef: Coefficients, grads: Grads) -> None:
        """Add the whole gradient of the forward chunks ``chunks`` (row slices of ``job``) to ``grads``, recomputing
        their logits exactly as the forward did (same row slices, same calls), so ``S = {z >= t}`` is the forward's
        (with a ``job.support``: its ids on that set); a chunk whose buffer the forward kept
        (:meth:`ChunkJob.take_kept`) folds that buffer instead of recomputing it."""
        ...

    def full_softmax_backward(
        self, job: ChunkJob, idx: torch.Tensor, coef: Coefficients, grads: Grads, counts: list[int]
    ) -> None:
        """Add ``-c_F pi + g_lp 1[a=y not in S]`` of the rows ``idx`` (``[k]`` int64) to ``grads`` (``counts``: how
        many of them each forward chunk holds, as the op read them): ascending rows of
        sparse chunks whose gradient leaves ``S`` (the other rows of their chunks have ``c_F = 0`` and
        ``g_lp 1[a=y not in S] = 0``, so folding a whole chunk adds nothing for them). ``pi`` uses the forward's row
        statistics, so the logits must be the forward's bit for bit: each chunk holding such rows is recomputed whole
        as :meth:`forward` computed it (same row slice, same calls, a buffer of the same shape;
        :meth:`ChunkJob.chunks_of`), or taken from the forward's kept buffer (:meth:`ChunkJob.take_kept`)."""
        ...
