"""The protocol a backend of the fused op implements.

:class:`safevocab.fused_op.FusedSafeLogProbs` owns the autograd bookkeeping (row statistics, the sparse
backward, the full-softmax part, the non-finite check); a backend owns the per-chunk arithmetic on dense
logits. Two implement it: :class:`safevocab.backends.torch_backend.TorchBackend` (torch passes, any device) and
:class:`safevocab.backends.triton_backend.TritonBackend` (Triton kernels, CUDA or Triton's interpreter);
:mod:`safevocab.backends.registry` builds them by name. No backend imports the autograd function; the data they
exchange lives in :mod:`safevocab.chunking`.

A backend may also define ``sparse_backward(chunks, hidden, weight, coef, transform, grads)``: the safe-set part of
the gradient of all its stored chunks (:class:`~safevocab.chunking.SparseChunk`) at once, in place of the fused op's
torch sparse GEMMs; the fused op then stores ``S`` for every input dtype (``safevocab.fused_op.sparse_density``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from safevocab.chunking import Coefficients, RowStats, SparseChunk, Transform
from safevocab.rules import SafeVocabRule
from safevocab.support import SafeSupport

__all__ = ["FusedBackend"]

#: The gradients of ``(hidden, weight, bias)`` a backward adds into (``None``: not needed).
Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class FusedBackend(Protocol):
    """Per-chunk arithmetic of the fused op: rows per chunk, forward fold, dense backward, full-softmax part."""

    #: Its key in :data:`safevocab.backends.registry.BACKENDS` (``"torch"``, ``"triton"``).
    name: str
    #: Whether :meth:`forward` and :meth:`dense_backward` take a replayed ``support`` (``SafeSupport``).
    supports_replay: bool

    def rows_per_chunk(self, n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
        """Rows per chunk so that one chunk's scratch fits ``max_chunk_bytes`` (at least 1)."""
        ...

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        rule: SafeVocabRule,
        transform: Transform,
        chunk_rows: int,
        stats: RowStats,
        sparse_max_density: float | None,
        support: SafeSupport | None = None,
    ) -> list[SparseChunk]:
        """Fill ``stats`` for every chunk of ``chunk_rows`` rows (:func:`safevocab.chunking.chunk_slices`); return
        the chunks whose safe sets keep at most ``sparse_max_density`` of their logits, as CSR (``None``: never).
        With a ``support`` (only when :attr:`supports_replay`), ``S`` is its ids intersected with the rule's set."""
        ...

    def dense_backward(
        self,
        chunks: list[slice],
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        coef: Coefficients,
        transform: Transform,
        chunk_rows: int,
        grads: Grads,
        rule: SafeVocabRule,
        support: SafeSupport | None = None,
    ) -> None:
        """Add the whole gradient of the forward chunks ``chunks`` to ``grads``, recomputing their logits exactly
        as the forward did (same row slices, same calls), so ``S = {z >= t}`` is the forward's."""
        ...

    def full_softmax_backward(
        self,
        idx: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        coef: Coefficients,
        transform: Transform,
        chunk_rows: int,
        grads: Grads,
        rule: SafeVocabRule,
    ) -> None:
        """Add ``-c_F pi + g_lp 1[a=y not in S]`` of the rows ``idx`` to ``grads``: ascending rows of sparse chunks
        whose gradient leaves ``S`` (the other rows of their chunks have ``c_F = 0`` and ``g_lp 1[a=y not in S] = 0``,
        so folding a whole chunk adds nothing for them). ``pi`` uses the forward's row statistics, so the logits
        must be the forward's bit for bit: each chunk holding such rows is recomputed whole as :meth:`forward`
        computed it (same row slice, same calls, a buffer of the same shape;
        :func:`safevocab.chunking.forward_chunks_of`)."""
        ...
