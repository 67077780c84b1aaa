"""What a study trains and evaluates on: :class:`StudyTask`, the contract of ``safevocab study --task``.

A task bundles the three things a GRPO study of one problem needs and that no arm may change:

- the **data**: ``train_dataset(num_prompts, seed)`` gives rows with a ``prompt`` column (plain text) plus whatever
  columns the reward reads; ``held_out_dataset(num_prompts)`` gives a fixed held-out set, disjoint from every
  training draw;
- the **reward**: trl reward functions, ``reward(completions, **columns) -> list[float]``, as ``GRPOTrainer`` calls
  them;
- the **held-out metric**: ``held_out_metric(model, tokenizer, dataset) -> float`` (higher is better; e.g. greedy
  accuracy), which must leave torch's global random state as it found it, so evaluating does not change a run. A
  sampled metric may take keywords, listed in ``metric_keywords``: ``seed`` (its sampling seed; ``safevocab study
  --eval_seeds``) and ``min_p`` (sample on the support of the rule ``min_p``; ``--eval_on_rule``).

A task is named on the command line as ``module:function`` (``function()`` returns a :class:`StudyTask`) or by a
built-in name; see :func:`trl_integration.study.tasks.load_task`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StudyTask"]


@dataclass(frozen=True)
class StudyTask:
    """One task of a study: data, reward and held-out metric (see the module docstring).

    Attributes:
        name: short name used in reports and output folders (``"arithmetic"``, ``"freetext"``).
        model_path: the model folder the task is meant for (a local ``save_pretrained`` directory); a study's
            ``--model`` overrides it.
        train_dataset: ``(num_prompts, seed) -> datasets.Dataset`` with a ``prompt`` column and the reward's columns.
        held_out_dataset: ``(num_prompts) -> datasets.Dataset``, the fixed held-out rows (disjoint from training).
        reward_funcs: trl reward functions, ``(completions: list[str], **columns) -> list[float]``.
        held_out_metric: ``(model, tokenizer, dataset) -> float``, higher is better; restores torch's RNG state.
        metric_name: what ``held_out_metric`` measures, for reports and plots (``"accuracy"``, ``"reward"``).
        max_completion_length: the task's completion length in tokens when a study does not set one (``None``: the
            study's default).
        description: one line for reports.
        metric_keywords: the keywords ``held_out_metric`` also takes: ``"seed"`` (an int, the sampling seed of the
            evaluation) and/or ``"min_p"`` (a float in (0, 1]: sample on that rule's support); ``()`` for a metric
            that takes neither (e.g. greedy accuracy).
    """

    name: str
    model_path: str
    train_dataset: Callable[[int, int], Any]
    held_out_dataset: Callable[[int], Any]
    reward_funcs: Sequence[Callable[..., list[float]]]
    held_out_metric: Callable[[Any, Any, Any], float]
    metric_name: str = "accuracy"
    max_completion_length: int | None = None
    description: str = ""
    metric_keywords: tuple[str, ...] = ()
