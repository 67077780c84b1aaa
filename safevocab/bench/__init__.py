"""Benchmark of ``fused_safe_logprobs`` against the matmul floor, a naive masked log-softmax and trl.

Run ``python -m safevocab.bench`` (``--help`` for sizes). Every variant runs forward + backward on the
same seeded inputs, in one fresh subprocess:

- ``floor``: the three bare LM-head GEMMs (``h W^T`` forward, ``G W`` and ``G^T h`` backward);
- ``recompute_floor``: the four bare GEMMs of a per-token head that recomputes its logits in the backward (``h W^T``
  twice, then ``G W`` and ``G^T h``): the limit of trl's ``ChunkedLogProbFunction``, of Liger's per-token kernel and
  of ``fused``'s dense backward without ``--keep-logits-bytes`` (the rule ``none``), as ``floor`` is of a head that
  keeps its logits;
- ``fused``: :func:`safevocab.fused_safe_logprobs` with the chosen rule;
- ``naive``: materialised ``h W^T`` followed by :func:`safevocab.safe_log_softmax` under autograd;
- ``trl``: trl's unmasked ``ChunkedLogProbFunction`` (only when trl is installed; on CUDA it runs trl's
  Triton fold kernels);
- ``fused_torch`` (CUDA default): the fused path forced to ``backend="torch"``, so ``fused / fused_torch`` is
  what the Triton kernels buy (``fused`` uses ``--backend``, default ``auto``: Triton on CUDA);
- ``fused_replay``: the fused path with a replayed :class:`~safevocab.support.SafeSupport` (the sets ``--rule``
  keeps on these logits, built once outside the timing) and no rule: what exact support replay costs (with
  ``--backend``, as ``fused``: the Triton backend replays too);
- ``liger`` (CUDA default, when ``liger_kernel`` imports): Liger-Kernel's ``LigerFusedLinearGRPOLoss``
  (temperature only, no pruning; ``beta=0``, on-policy) on the same rows viewed as ``[N / T, T]`` sequences.

``--preset gpu`` sets ``--device cuda --n 16384 --h 4096 --v 151936 --dtype bfloat16``, a 1 GiB chunk
budget and the variants ``floor,fused,fused_torch,trl,liger`` (explicit flags still win). Comparison
variants that fail (missing package, out of memory) are reported in the table instead of stopping the run.

It reports time (best of ``--repeats``, taken round-robin across variants, the usual guard against a busy
machine; the JSON has the median too) and peak extra memory of each (tensor storage allocated during one
step and alive at once, inputs excluded: see :class:`~safevocab.bench.measure.LiveTensorBytes`;
``torch.cuda.max_memory_allocated`` on GPU), and the ratios of ``fused`` to each other variant that ran. Timings
are ratios from one run on one machine; tests never assert them.

The package, one idea a module:

- :mod:`safevocab.bench.run`: :func:`run`, the benchmark's driver (one worker, or the matrix of rules and thread
  counts), the table of one run, and :func:`show_progress`;
- :mod:`safevocab.bench.cli`: the flags (:func:`make_parser`) and the ``--preset`` values;
- :mod:`safevocab.bench.variants`: each variant's step on the process's one set of inputs;
- :mod:`safevocab.bench.worker`: the worker subprocess, which measures the steps round-robin;
- :mod:`safevocab.bench.matrix`: several rules and thread counts in one run (``--rules``, ``--threads``,
  ``--busy-cores``);
- :mod:`safevocab.bench.inputs`: the inputs, in two logit profiles (``--logits-profile``);
- :mod:`safevocab.bench.measure`: how one step's peak memory and time are measured;
- ``__main__``: the ``python -m safevocab.bench`` entry point (a worker process runs it too).

This package imports trl lazily, and only to time it: ``safevocab`` itself never depends on trl. It prints nothing
itself: :func:`run` returns the report, progress lines go to the ``safevocab.bench`` logger (INFO), and the entry
points (``python -m safevocab.bench``, ``safevocab bench``) print the report and show the progress
(:func:`show_progress`).

**Experimental** (as ``trl.experimental``): this package's names may change or go in any release without
deprecation; the stable API is listed in ``docs/api.md``.
"""

from safevocab.bench.cli import PRESETS, make_parser
from safevocab.bench.run import PROGRESS_LOGGERS, run, show_progress
from safevocab.bench.variants import DEFAULT_VARIANTS, VARIANTS

__all__ = ["DEFAULT_VARIANTS", "PRESETS", "PROGRESS_LOGGERS", "VARIANTS", "make_parser", "run", "show_progress"]
