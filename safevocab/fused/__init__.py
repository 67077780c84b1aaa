"""The fused op's internals: the autograd function over chunks of rows and what it and its backends exchange.

:func:`safevocab.fused_safe_logprobs` (:mod:`safevocab.logprobs`) is the entry point; this package is what it runs:

- :mod:`safevocab.fused.op`: :class:`~safevocab.fused.op.FusedSafeLogProbs`, the autograd function (row statistics,
  the backward's parts, which chunks store ``S`` for the sparse backward);
- :mod:`safevocab.fused.protocol`: what a backend implements (:class:`~safevocab.fused.protocol.FusedBackend`);
- :mod:`safevocab.fused.chunking`: :class:`~safevocab.fused.chunking.ChunkJob`, what every per-chunk call of a backend
  reads, the row slices and a chunk's logits, identical in forward and backward;
- :mod:`safevocab.fused.transform`: the sampler's logit transform and its chain rule;
- :mod:`safevocab.fused.row_stats`: what a backend's forward writes (max-shifted row statistics, CSR safe sets);
- :mod:`safevocab.fused.coefficients`: the backward's per-row coefficients and the fp16 gradient shift;
- :mod:`safevocab.fused.grads`: a chunk's logits gradient into the input gradients (fp32 accumulation);
- :mod:`safevocab.fused.sparse_backward`: the safe-set part of a stored chunk's gradient by torch sparse GEMMs;
- :mod:`safevocab.fused.checks`: the one-line errors read off the forward's row statistics.

The per-chunk arithmetic is a backend's (:mod:`safevocab.backends`); no backend imports :mod:`safevocab.fused.op`.
This ``__init__`` imports nothing, so a backend importing one module of the package does not import the op.
"""
