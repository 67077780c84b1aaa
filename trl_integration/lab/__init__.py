"""The mismatch lab: how far a model's training and rollout log-probabilities drift apart, against the exact bound.

- :mod:`~trl_integration.lab.inputs`: the precisions to compare (``parse_compare``), the default texts and free
  text (``stdlib_texts``);
- :mod:`~trl_integration.lab.sides`: the training and rollout sides (dtype, weights rounded to ``k`` mantissa bits);
- :mod:`~trl_integration.lab.tail`: ``tail_mismatch``, the tail diagnostic (signed ``log mu - log pi`` per
  probability bucket on sampled tokens), the lab's first output;
- :mod:`~trl_integration.lab.engine`: ``run_diagnose``, the scoring and its summary (``DiagnoseResult``);
- :mod:`~trl_integration.lab.kept_sets`: the kept sets' size and pruned mass per side, and their disagreement;
- :mod:`~trl_integration.lab.bands`: the shares of importance ratios outside ``[0.9, 1.1]`` and ``[0.8, 1.25]``, and
  the shares of the gap below the rule's cut;
- :mod:`~trl_integration.lab.batch_shape`: ``batch_shape_control``, the training side against itself under two batch
  shapes (micro-batch 1 vs N, padded vs packed);
- :mod:`~trl_integration.lab.precision_arms`: ``run_precision_arms``, the training side scoring the same tokens in
  bf16, fp16, fp32 and bf16 with an fp32 LM head, each against the rollout side and against itself, with its time;
- :mod:`~trl_integration.lab.report`: ``summary.json`` (``write_outputs``) and the console table (``summary_table``);
- :mod:`~trl_integration.lab.figures`: the three PNG figures.

The command is ``safevocab diagnose`` (:mod:`trl_integration.commands.diagnose`); see ``docs/mismatch.md``.

**Experimental** (as ``trl.experimental``): this module's names may change or go in any release without
deprecation; the stable API is listed in ``docs/api.md``. Importing it warns once
(:mod:`trl_integration.experimental`; ``SAFEVOCAB_EXPERIMENTAL_SILENCE=1`` silences it).
"""

from trl_integration.experimental import warn_experimental
from trl_integration.lab.engine import BOUND_TOLERANCE, DiagnoseResult, run_diagnose
from trl_integration.lab.inputs import DEFAULT_TEXTS, DTYPES, default_texts, parse_compare, stdlib_texts
from trl_integration.lab.precision_arms import PRECISION_ARMS, parse_precision_arms, run_precision_arms
from trl_integration.lab.report import summary_rows, summary_table, write_outputs
from trl_integration.lab.tail import tail_buckets, tail_mismatch

__all__ = [
    "BOUND_TOLERANCE",
    "DEFAULT_TEXTS",
    "DTYPES",
    "PRECISION_ARMS",
    "DiagnoseResult",
    "default_texts",
    "parse_compare",
    "parse_precision_arms",
    "run_diagnose",
    "run_precision_arms",
    "stdlib_texts",
    "summary_rows",
    "summary_table",
    "tail_buckets",
    "tail_mismatch",
    "write_outputs",
]

warn_experimental("trl_integration.lab")  # once, at import (trl_integration.experimental)
