"""Tasks the tests name as ``--task study_plugins:...`` (this folder is on ``sys.path`` in the test session)."""

from __future__ import annotations

from trl_integration.demo.arithmetic_task import arithmetic_task
from trl_integration.task import StudyTask


def exact_match_task() -> StudyTask:
    """The arithmetic task under another metric name and a completion length of its own."""
    base = arithmetic_task()
    return StudyTask(
        name="arith-em",
        model_path=base.model_path,
        train_dataset=base.train_dataset,
        held_out_dataset=base.held_out_dataset,
        reward_funcs=base.reward_funcs,
        held_out_metric=base.held_out_metric,
        metric_name="exact_match",
        max_completion_length=6,
        description="arithmetic, named otherwise",
    )


def not_a_task():
    return {"name": "arithmetic"}


def broken_task():
    raise RuntimeError("no data today")
