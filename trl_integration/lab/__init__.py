"""The mismatch lab: how far a model's training and rollout log-probabilities drift apart, against the exact bound.

- :mod:`~trl_integration.lab.inputs`: the precisions to compare (``parse_compare``) and the default texts;
- :mod:`~trl_integration.lab.engine`: ``run_diagnose``, the scoring and its summary (``DiagnoseResult``);
- :mod:`~trl_integration.lab.report`: ``summary.json`` and the console table (``write_outputs``);
- :mod:`~trl_integration.lab.figures`: the two PNG figures.

The command is ``safevocab diagnose`` (:mod:`trl_integration.commands.diagnose`); see ``docs/mismatch.md``.
"""

from trl_integration.lab.engine import BOUND_TOLERANCE, DiagnoseResult, run_diagnose
from trl_integration.lab.inputs import DEFAULT_TEXTS, DTYPES, default_texts, parse_compare
from trl_integration.lab.report import print_summary, write_outputs

__all__ = [
    "BOUND_TOLERANCE",
    "DEFAULT_TEXTS",
    "DTYPES",
    "DiagnoseResult",
    "default_texts",
    "parse_compare",
    "print_summary",
    "run_diagnose",
    "write_outputs",
]
