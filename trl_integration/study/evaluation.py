"""The held-out evaluations of a study run: when they happen, how often the metric is drawn, on which support.

A :class:`HeldOutMetricCallback` scores the task's held-out metric on its fixed held-out set:

- **when**: before training (step 0) and every ``every`` optimizer steps and at the last step, or at exactly the
  steps ``steps`` (``--eval_steps``);
- **how often**: once with the metric's own sampling seed (the default, as every study before issue 33 ran), or
  once per evaluation seed ``s`` in ``seeds`` (``--eval_seeds``: ``metric(..., seed=s)``), the recorded metric
  then being the mean over the seeds, each seed's value kept;
- **on which support**: the full distribution, and with ``rule_sampling`` (``--eval_on_rule``) also on the safe
  vocabulary of the DVP rule, sampled under it (``metric(..., min_p=RHO)`` or ``metric(..., top_p=P)``), at the same
  steps and seeds.

What a run records (``results.json``'s ``run["eval"]``, :meth:`HeldOutMetricCallback.record`), with ``M`` the
metric's name: ``step`` and ``M`` (one value per evaluated step) always; with ``seeds``, ``eval_seeds`` and
``M_by_seed`` (per step, one value per evaluation seed, in ``eval_seeds``' order); with ``rule_sampling``,
``rule_sampling`` (and ``rule_min_p`` for a ``min_p`` rule, as earlier studies recorded it), ``M_rule`` (the mean over
seeds on the rule's support) and, with seeds, ``M_rule_by_seed``.
The metric must restore torch's global random state, so evaluating does not change a run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from trl_integration.study.arms import StudySettings, rule_sampling
from trl_integration.task import StudyTask

__all__ = ["HeldOutMetricCallback", "HeldOutAccuracyCallback", "check_evaluation", "evaluation_callback"]

try:  # the callbacks subclass transformers' TrainerCallback when it is installed (the trl extra)
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover - without the trl extra nothing here can run anyway
    _CallbackBase = object


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


class HeldOutMetricCallback(_CallbackBase):
    """A held-out metric on a fixed set, before training and every ``every`` optimizer steps (see the module
    docstring). Results accumulate in ``self.steps`` and ``self.values`` (and, with ``seeds``/``rule_sampling``, in
    ``self.values_by_seed``, ``self.rule_values``, ``self.rule_values_by_seed``).

    Args:
        trainer: the trainer (its unwrapped model and tokenizer are evaluated).
        dataset: the held-out rows the metric reads.
        every: evaluation period in optimizer steps (the last step is always evaluated); unused with ``steps``.
        metric: ``metric(model, tokenizer, dataset, **keywords) -> float``.
        name: what the metric measures (``"accuracy"``), for the records.
        steps: evaluate at exactly these optimizer steps (0: before training) instead of every ``every``.
        seeds: evaluation seeds, each passed as ``seed=``; ``None``: one call without it.
        rule_sampling: also score with these sampler keywords (``{"min_p": RHO}`` or ``{"top_p": P}``: the rule's
            support); ``None``: the full distribution only.
    """

    def __init__(self, trainer: Any, dataset: Any, every: int, metric: Callable[..., float], name: str = "metric",
                 *, steps: Sequence[int] | None = None, seeds: Sequence[int] | None = None,
                 rule_sampling: dict[str, float] | None = None) -> None:  # fmt: skip
        self.trainer = trainer
        self.dataset = dataset
        self.every = every
        self.metric = metric
        self.name = name
        self.at_steps = None if steps is None else frozenset(int(s) for s in steps)
        self.seeds = None if seeds is None else [int(s) for s in seeds]
        self.rule_sampling = None if rule_sampling is None else dict(rule_sampling)
        self.steps: list[int] = []
        self.values: list[float] = []
        self.values_by_seed: list[list[float]] = []
        self.rule_values: list[float] = []
        self.rule_values_by_seed: list[list[float]] = []

    def _metric(self) -> Callable[..., float]:
        return self.metric

    def _scores(self, metric: Callable[..., float], model: Any, **keywords: Any) -> tuple[float, list[float] | None]:
        """The metric's value (the mean over the evaluation seeds) and, with seeds, each seed's value."""
        tokenizer = self.trainer.processing_class
        if self.seeds is None:
            return float(metric(model, tokenizer, self.dataset, **keywords)), None
        values = [float(metric(model, tokenizer, self.dataset, seed=seed, **keywords)) for seed in self.seeds]
        return _mean(values), values

    def _evaluate(self, step: int) -> None:
        if self.steps and self.steps[-1] == step:
            return
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        metric = self._metric()
        self.steps.append(step)
        value, by_seed = self._scores(metric, model)
        self.values.append(value)
        if by_seed is not None:
            self.values_by_seed.append(by_seed)
        if self.rule_sampling is not None:
            value, by_seed = self._scores(metric, model, **self.rule_sampling)
            self.rule_values.append(value)
            if by_seed is not None:
                self.rule_values_by_seed.append(by_seed)

    def _due(self, step: int, max_steps: int) -> bool:
        if self.at_steps is not None:
            return step in self.at_steps
        return step % self.every == 0 or step >= max_steps

    def on_train_begin(self, args, state, control, **kwargs):
        if self.at_steps is None or state.global_step in self.at_steps:
            self._evaluate(state.global_step)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self._due(state.global_step, state.max_steps):
            self._evaluate(state.global_step)
        return control

    def record(self) -> dict[str, Any]:
        """What ``results.json`` keeps of the evaluations (the module docstring lists the keys)."""
        name = self.name
        out: dict[str, Any] = {"step": list(self.steps), name: list(self.values)}
        if self.seeds is not None:
            out["eval_seeds"] = list(self.seeds)
            out[f"{name}_by_seed"] = [list(v) for v in self.values_by_seed]
        if self.rule_sampling is not None:
            out["rule_sampling"] = dict(self.rule_sampling)
            if "min_p" in self.rule_sampling:
                out["rule_min_p"] = self.rule_sampling["min_p"]
            out[f"{name}_rule"] = list(self.rule_values)
            if self.seeds is not None:
                out[f"{name}_rule_by_seed"] = [list(v) for v in self.rule_values_by_seed]
        return out


class HeldOutAccuracyCallback(HeldOutMetricCallback):
    """Greedy arithmetic accuracy (:func:`trl_integration.demo.arithmetic.accuracy`) as the held-out metric: the
    :class:`HeldOutMetricCallback` of the ``arithmetic`` task, with the values also under ``self.accuracy``.

    Args:
        trainer: the trainer (its unwrapped model and tokenizer are evaluated).
        dataset: rows with ``prompt`` and ``answer``.
        every: evaluation period in optimizer steps (the last step is always evaluated).
    """

    def __init__(self, trainer: Any, dataset: Any, every: int) -> None:
        super().__init__(trainer, dataset, every, metric=None, name="accuracy")  # type: ignore[arg-type]

    def _metric(self) -> Callable[..., float]:
        from trl_integration.demo.arithmetic import accuracy  # looked up at each evaluation, as it always was

        return accuracy

    @property
    def accuracy(self) -> list[float]:
        return self.values


def check_evaluation(settings: StudySettings, task: StudyTask) -> None:
    """Refuse, in one line naming the flag, evaluation settings the task's metric cannot honour.

    Raises:
        ValueError: ``eval_seeds`` for a metric without a ``seed`` keyword, ``eval_on_rule`` for one without the
            rule's ``min_p`` or ``top_p`` (``StudyTask.metric_keywords``).
    """
    rule_keyword = next(iter(rule_sampling(settings))) if settings.eval_on_rule else "min_p"
    for flag, on, keyword in (("--eval_seeds", settings.eval_seeds is not None, "seed"),
                              ("--eval_on_rule", settings.eval_on_rule, rule_keyword)):  # fmt: skip
        if on and keyword not in task.metric_keywords:
            raise ValueError(
                f"{flag} needs a held-out metric that takes {keyword}=, but task {task.name!r}'s metric takes "
                f"{tuple(task.metric_keywords)!r} (StudyTask.metric_keywords): accepted a sampled metric such as "
                "freetext's"
            )


def evaluation_callback(trainer: Any, dataset: Any, settings: StudySettings, task: StudyTask) -> HeldOutMetricCallback:
    """The held-out evaluation of one study run, as ``settings`` asks for it (:func:`check_evaluation` first)."""
    return HeldOutMetricCallback(
        trainer,
        dataset,
        settings.eval_every,
        task.held_out_metric,
        task.metric_name,
        steps=settings.eval_steps,
        seeds=settings.eval_seeds,
        rule_sampling=rule_sampling(settings) if settings.eval_on_rule else None,
    )
