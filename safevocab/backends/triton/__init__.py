"""Triton backend of :class:`safevocab.fused.op.FusedSafeLogProbs`: per-chunk GEMM in torch, fold in Triton.

:class:`TritonBackend` implements :class:`safevocab.fused.protocol.FusedBackend`: its forward and dense backward
replace the torch backend's passes (:mod:`safevocab.backends.torch_backend`) with the kernels of
:mod:`safevocab.kernels` (one op a file); the autograd bookkeeping stays in :mod:`safevocab.fused.op`, which calls
:meth:`TritonBackend.sparse_backward` for the chunks whose ``S`` the forward stored (every input dtype), and the
forward of a replayed support runs here too. The backward (dense chunks and the full-softmax part of sparse ones)
recomputes each chunk on the forward's row slice with the same calls, so ``S = {z >= t}`` is rebuilt, and ``pi``
normalised, from bit-identical logits.

Each call of the backend decides its route once, from the rule and the inputs' dtype
(:meth:`Route.of <safevocab.backends.triton.route.Route.of>`): the forward kernel computes the threshold (``NoPruning``,
``MinP``, ``MinProb``), the selection kernel does (``TopK``, ``TopP``, compositions; bf16/fp16/fp32 inputs), or the
rule's torch code does on an fp32 copy (other rules, fp64 inputs); the route then makes every chunk's logits buffer
and thresholds, in forward and backward alike. The package, one idea a module:

- :mod:`safevocab.backends.triton.route`: the route (:class:`~safevocab.backends.triton.route.Route`), a chunk's
  scratch, its logits buffer and its thresholds on the route;
- :mod:`safevocab.backends.triton.forward`: the forward (row statistics, sparse chunks) and the replayed forward;
- :mod:`safevocab.backends.triton.backward`: the dense backward, the full-softmax part and the sparse backward.

The logits gradient is written over the GEMM output, in the inputs' dtype, and the gradient GEMMs
accumulate the weight gradient in fp32 (for bf16/fp16 inputs the per-logit gradient is rounded to the
inputs' dtype first, as trl's Triton path does; the torch backend keeps it in fp32 for that GEMM).

Importing this package imports Triton (its kernels): :mod:`safevocab.backends.registry` imports it only when the
backend is used.
"""

from __future__ import annotations

import contextlib

import torch

from safevocab.backends.triton.backward import (
    dense_backward,
    full_softmax_backward,
    queue_sparse_reads,
    sparse_backward,
)
from safevocab.backends.triton.forward import forward_chunks, replay_forward
from safevocab.backends.triton.route import Route
from safevocab.fused.chunking import ChunkJob
from safevocab.fused.coefficients import Coefficients
from safevocab.fused.grads import Grads
from safevocab.fused.row_stats import RowStats, SparseChunk
from safevocab.rules import SafeVocabRule

__all__ = ["TritonBackend"]


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """The context that makes ``device`` the current CUDA device (nothing off CUDA)."""
    # Triton launches on the current CUDA device: make it the tensors' one.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _route(job: ChunkJob) -> Route:
    return Route.of(job.rule, job.hidden.element_size())


class TritonBackend:
    """The Triton kernels fold every chunk (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    Every method takes the call's :class:`~safevocab.fused.chunking.ChunkJob`, decides the call's route once
    (:meth:`Route.of <safevocab.backends.triton.route.Route.of>`) and runs the kernels on the tensors' CUDA device.
    """

    name = "triton"
    #: Replayed supports: the rule's fold plus a gather of the given ids
    #: (:func:`~safevocab.backends.triton.forward.replay_forward`).
    supports_replay = True

    def rows_per_chunk(self, n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
        # the kernels need less scratch than the torch passes: the route's own count
        return Route.of(rule, in_bytes).chunk_rows(n_rows, vocab, max_chunk_bytes)

    def forward(self, job: ChunkJob, stats: RowStats, sparse_max_density: float | None) -> list[SparseChunk]:
        route = _route(job)
        with _device_guard(job.hidden.device):
            if job.support is not None:  # every chunk stored sparsely, whatever the density
                return replay_forward(job, route, stats)
            return forward_chunks(job, route, stats, sparse_max_density)

    def dense_backward(self, job: ChunkJob, chunks: list[slice], coef: Coefficients, grads: Grads) -> None:
        route = _route(job)
        with _device_guard(job.hidden.device):
            dense_backward(job, route, chunks, coef, grads)

    def full_softmax_backward(
        self, job: ChunkJob, idx: torch.Tensor, coef: Coefficients, grads: Grads, counts: list[int]
    ) -> None:
        route = _route(job)
        with _device_guard(job.hidden.device):
            full_softmax_backward(job, route, idx, coef, grads, counts)

    def queue_sparse_reads(self, job: ChunkJob, chunks: list[SparseChunk], coef: Coefficients) -> None:
        """Queue on ``coef.reads`` what :meth:`sparse_backward` will read, so that the fused op reads it with its own
        values: one read of the device per backward call."""
        with _device_guard(job.hidden.device):
            queue_sparse_reads(job, chunks, coef)

    def sparse_backward(self, job: ChunkJob, chunks: list[SparseChunk], coef: Coefficients, grads: Grads) -> None:
        """The safe-set part of the stored chunks' gradient in Triton (any input dtype), used by ``FusedSafeLogProbs``
        instead of its torch sparse GEMMs; with it the forward stores ``S`` for bf16/fp16 inputs too."""
        route = _route(job)
        with _device_guard(job.hidden.device):
            sparse_backward(job, route, chunks, coef, grads)
