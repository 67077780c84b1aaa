"""``safevocab study``: remedies for training–inference mismatch compared arm by arm, over several seeds.

- :mod:`~trl_integration.task`: ``StudyTask``, what a study trains and evaluates on (data, reward, metric);
- :mod:`~trl_integration.study.tasks`: ``load_task``, a task from ``arithmetic``, ``freetext`` or ``module:function``;
- :mod:`~trl_integration.study.arms`: the arms (``ARM_NAMES``, ``DEFAULT_ARMS``, ``arm_overrides``) and
  ``StudySettings``;
- :mod:`~trl_integration.study.run`: ``run_study``, every (arm, seed) trained in-process with held-out evaluations;
- :mod:`~trl_integration.study.evaluation`: the held-out evaluations (steps, evaluation seeds, the rule's support);
- :mod:`~trl_integration.study.resume`: ``--resume``, the finished runs a study keeps;
- :mod:`~trl_integration.study.aggregate`: ``summarize``, mean ± std over seeds per arm;
- :mod:`~trl_integration.study.contrasts`: ``contrasts``, combinations of arms paired by seed (harm, DVP's cost, ...);
- :mod:`~trl_integration.study.report`: ``report.md`` and ``results.json`` (``render_report``, ``write_report``);
- :mod:`~trl_integration.study.plots`: one PNG per metric (``plot_specs``, ``PLOTS``).

The command line is :mod:`trl_integration.commands.study`. See ``docs/results.md``.

**Experimental** (as ``trl.experimental``): this module's names may change or go in any release without
deprecation; the stable API is listed in ``docs/api.md``. Importing it warns once
(:mod:`trl_integration.experimental`; ``SAFEVOCAB_EXPERIMENTAL_SILENCE=1`` silences it).
"""

from trl_integration.experimental import warn_experimental
from trl_integration.study.aggregate import summarize
from trl_integration.study.arms import ARM_DESCRIPTIONS, ARM_NAMES, DEFAULT_ARMS, StudySettings, arm_overrides
from trl_integration.study.plots import PLOTS, plot_specs
from trl_integration.study.report import render_report, write_report
from trl_integration.study.run import HeldOutAccuracyCallback, HeldOutMetricCallback, run_study, settings_command
from trl_integration.study.tasks import BUILTIN_TASKS, load_task
from trl_integration.task import StudyTask

__all__ = [
    "ARM_NAMES",
    "DEFAULT_ARMS",
    "ARM_DESCRIPTIONS",
    "PLOTS",
    "plot_specs",
    "StudySettings",
    "StudyTask",
    "BUILTIN_TASKS",
    "load_task",
    "arm_overrides",
    "HeldOutMetricCallback",
    "HeldOutAccuracyCallback",
    "run_study",
    "settings_command",
    "summarize",
    "render_report",
    "write_report",
]

warn_experimental("trl_integration.study")  # once, at import (trl_integration.experimental)
