"""Running a study: every (arm, seed) trained in-process, one after the other, with held-out evaluations.

Each run builds a ``HardenedSafeVocabGRPOTrainer`` (the command's trainer) on the arm's config (:mod:`trl_integration.study.arms`) with the task's
data and reward (:class:`~trl_integration.task.StudyTask`), evaluates the task's held-out metric on its fixed
held-out set before training and every ``eval_every`` steps, or at ``eval_steps``, once or once per evaluation seed,
on the full distribution and optionally on the DVP rule's support (:mod:`trl_integration.study.evaluation`,
:class:`HeldOutMetricCallback`), and records the per-step training log. A run that raises is recorded as failed with what it logged so far; the results are written
after every run, so an interrupted study keeps what it finished, and ``resume=True`` (``--resume``) trains only the
runs not finished yet (:mod:`trl_integration.study.resume`). ``results["code"]`` and every trained run's ``code``
hold the git commit and whether the tree was clean (:mod:`trl_integration.study.provenance`).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import shlex
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from trl_integration.demo.model import is_tiny_model, tiny_model_path
from trl_integration.study.aggregate import summarize
from trl_integration.study.arms import StudySettings, arm_overrides, resolved_max_completion_length, shared_config
from trl_integration.study.contrasts import contrasts
from trl_integration.study.evaluation import (
    HeldOutAccuracyCallback,
    HeldOutMetricCallback,
    check_evaluation,
    evaluation_callback,
)
from trl_integration.study.provenance import code_version
from trl_integration.study.report import write_json, write_report
from trl_integration.study.resume import finished_runs
from trl_integration.study.tasks import load_task
from trl_integration.task import StudyTask

__all__ = ["HeldOutMetricCallback", "HeldOutAccuracyCallback", "run_study", "settings_command", "task_record"]

#: Keys of the training log not kept as per-step series in ``results.json`` (every other numeric key is).
_DROP_KEYS = ("step", "epoch", "num_tokens", "total_flos")


try:  # the progress callback subclasses transformers' TrainerCallback when it is installed (the trl extra)
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover - without the trl extra nothing here can run anyway
    _CallbackBase = object


class _ProgressCallback(_CallbackBase):
    """Advances the study's progress bar by one per optimizer step."""

    def __init__(self, bar, label: str) -> None:
        self.bar = bar
        self.label = label

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(1)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "reward" in logs:
            self.bar.set_postfix_str(f"{self.label} reward {logs['reward']:.3f}", refresh=False)
        return control


def _finite_or_none(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _series_from_history(history: list[dict]) -> dict[str, list]:
    """Per-step training series ``{"step": [...], key: [...]}`` from ``trainer.state.log_history`` (None where a
    key was not logged at that step, e.g. an empty probability bucket, or was not finite: :func:`_nonfinite_steps`
    keeps those)."""
    rows = _step_rows(history)
    keys: list[str] = []
    for h in rows:
        for k, v in h.items():
            if k in _DROP_KEYS or k in keys:
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.append(k)
    series: dict[str, list] = {"step": [int(h["step"]) for h in rows]}
    for k in keys:
        series[k] = [_finite_or_none(h.get(k)) for h in rows]
    return series


def _step_rows(history: list[dict]) -> list[dict]:
    return [h for h in history if "step" in h and "reward" in h]


def _nonfinite_steps(history: list[dict]) -> dict[str, list[int]]:
    """``{key: [steps]}``: the steps at which a logged number was NaN or infinite (strict JSON has no NaN, so the
    series hold None there; the collapse criterion needs to tell "not finite" from "not logged")."""
    out: dict[str, list[int]] = {}
    for h in _step_rows(history):
        for k, v in h.items():
            if k in _DROP_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(float(v)):
                out.setdefault(k, []).append(int(h["step"]))
    return out


#: What torch's sampler raises when the distribution it is handed holds inf or NaN (logits that overflowed).
_NON_FINITE_SAMPLING = "probability tensor contains either `inf`, `nan`"


def _parameters_finite(model) -> bool | None:
    """Whether every parameter of ``model`` is finite (``None`` when there is no model to read)."""
    if model is None:
        return None
    import torch

    with torch.no_grad():
        return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _run_one(
    arm: str,
    overrides: dict,
    seed: int,
    settings: StudySettings,
    model_path: str,
    task: StudyTask,
    train_dataset,
    test_dataset,
    bar,
) -> dict:
    """Train one (arm, seed); never raises (an exception becomes ``status="failed"``)."""
    import tempfile

    record: dict[str, Any] = {
        "arm": arm,
        "seed": seed,
        "status": "failed",
        "error": None,
        "traceback": None,
        "wall_time_s": None,
        "train_runtime_s": None,
        "eval": {"step": [], task.metric_name: []},
        "series": {"step": []},
        "nonfinite": {},
        "parameters_finite": None,
        "stopped_non_finite": False,
        "length_decay": None,
    }
    start = time.perf_counter()
    done_before = bar.n if bar is not None else 0
    evaluator = trainer = None
    try:
        from transformers import PrinterCallback

        from trl_integration.grpo.config import SafeVocabGRPOConfig
        from trl_integration.harness.trainer import HardenedSafeVocabGRPOTrainer

        with tempfile.TemporaryDirectory(prefix="safevocab-study-") as tmp:
            config = SafeVocabGRPOConfig(**{**shared_config(settings, seed, tmp), **overrides})
            trainer = HardenedSafeVocabGRPOTrainer(
                model=model_path, reward_funcs=list(task.reward_funcs), args=config, train_dataset=train_dataset
            )
            trainer.remove_callback(PrinterCallback)  # the study prints a progress bar, not every log line
            evaluator = evaluation_callback(trainer, test_dataset, settings, task)
            trainer.add_callback(evaluator)
            trainer.add_callback(_ProgressCallback(bar, f"{arm} seed {seed}"))
            trainer.train()
        record["train_runtime_s"] = next(
            (h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h), None
        )
        scheduler = trainer.lr_scheduler
        detector = getattr(scheduler, "detector", None)
        if overrides.get("length_decay"):
            record["length_decay"] = {
                "surge_step": None if detector is None else detector.surge_step,
                "detected_at": None if detector is None else detector.detected_at,
                "decay_active": bool(getattr(scheduler, "decay_active", False)),
                "decay_period": scheduler.decay_period if getattr(scheduler, "decay_active", False) else None,
            }
        steps_done = trainer.state.global_step
        if steps_done < settings.steps:
            raise RuntimeError(f"training stopped after {steps_done} of {settings.steps} steps")
        record["status"] = "ok"
    except Exception as err:  # a crashed arm is reported, not dropped
        record["error"] = f"{type(err).__name__}: {err}"
        record["traceback"] = traceback.format_exc(limit=8)
        if bar is not None:  # keep the bar's total meaningful
            bar.update(max(0, done_before + settings.steps - bar.n))
    finally:  # a run that crashed mid-way keeps the series and evaluations it got to
        if trainer is not None:
            record["series"] = _series_from_history(trainer.state.log_history)
            record["nonfinite"] = _nonfinite_steps(trainer.state.log_history)
            record["parameters_finite"] = _parameters_finite(getattr(trainer, "model", None))
        # a run that stopped because its weights or its sampling distribution went non-finite (the collapse criterion)
        record["stopped_non_finite"] = record["status"] == "failed" and (
            record["parameters_finite"] is False or _NON_FINITE_SAMPLING in (record["error"] or "")
        )
        if evaluator is not None:
            record["eval"] = evaluator.record()
        record["wall_time_s"] = time.perf_counter() - start
        del trainer
        gc.collect()
    return record


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    for name in ("torch", "transformers", "trl"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # pragma: no cover
            env[name] = None
    try:
        import torch

        env["torch_threads"] = torch.get_num_threads()
        env["cuda"] = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        pass
    return env


def task_record(task: StudyTask, spec: str) -> dict[str, Any]:
    """What ``results.json`` keeps of a task (``spec``: how ``--task`` named it)."""
    rewards = [getattr(f, "__name__", type(f).__name__) for f in task.reward_funcs]
    return {
        "spec": spec,
        "name": task.name,
        "model_path": task.model_path,
        "metric_name": task.metric_name,
        "reward_funcs": rewards,
        "description": task.description,
    }


def _quiet_libraries() -> Callable[[], None]:
    """Silence transformers' logging and the progress bars of transformers and datasets during the study.

    Returns the function that puts back what was there: these are process-wide settings, and a study run from Python
    (a notebook, a test) must not leave the caller's later training without its progress bar (transformers derives
    ``disable_tqdm`` from the logging level).
    """
    try:
        import datasets
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        return lambda: None
    verbosity = hf_logging.get_verbosity()
    hf_bars = hf_logging.is_progress_bar_enabled()
    datasets_bars = datasets.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()

    def restore() -> None:
        hf_logging.set_verbosity(verbosity)
        if hf_bars:
            hf_logging.enable_progress_bar()
        if datasets_bars:
            datasets.enable_progress_bars()

    return restore


def run_study(
    settings: StudySettings,
    *,
    task: StudyTask | str | None = None,
    command: str | None = None,
    arm_configs: dict[str, dict[str, Any]] | None = None,
    progress: bool = True,
    plots: bool = True,
    resume: bool = False,
) -> dict:
    """Run every (arm, seed), then write ``results.json``, ``report.md`` and the plots to ``settings.output_dir``.

    Args:
        settings: the study settings (validated here).
        task: the task (a :class:`~trl_integration.task.StudyTask`, or a spec for
            :func:`~trl_integration.study.tasks.load_task`); default: ``settings.task`` (which a task given here
            replaces; ``results["task"]`` records what ran).
        command: the command line recorded in the report (default: ``safevocab study`` + ``sys.argv[2:]``).
        arm_configs: ``{arm name: SafeVocabGRPOConfig overrides}`` replacing `arm_overrides` for those names
            (arms not listed in ``settings.arms`` are ignored); for custom or deliberately broken arms.
        progress: show a progress bar (tqdm) over all optimizer steps.
        plots: draw the PNG plots (needs matplotlib).
        resume: keep the finished runs of the ``results.json`` already in ``settings.output_dir`` and train only
            the others (:mod:`~trl_integration.study.resume`: refused when the settings differ).

    Returns:
        The results dict (what ``results.json`` holds).

    Raises:
        ValueError: bad settings, a task that cannot be loaded, or (``resume``) settings that differ from the
            recorded runs', before any training.
    """
    settings.validate()
    spec = settings.task if task is None else task if isinstance(task, str) else f"{task.name} (a StudyTask object)"
    task = load_task(settings.task if task is None else task)
    check_evaluation(settings, task)
    settings = replace(
        settings, max_completion_length=resolved_max_completion_length(settings, task.max_completion_length)
    )
    arm_configs = dict(arm_configs or {})
    out = Path(settings.output_dir)
    arms = {arm: arm_configs.get(arm, arm_overrides(arm, settings)) for arm in settings.arms}
    model_path = settings.model or task.model_path
    if is_tiny_model(model_path):
        tiny_model_path()  # raises, saying how to rebuild it, when this install lacks the bundled model
    previous = finished_runs(out / "results.json", settings, arms, task.name) if resume else {}
    previous_results = json.loads((out / "results.json").read_text(encoding="utf-8")) if previous else {}
    out.mkdir(parents=True, exist_ok=True)
    full_command = settings_command(settings)
    if command is None:
        command = full_command

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from tqdm.auto import tqdm

    restore_libraries = _quiet_libraries()
    train_dataset = task.train_dataset(settings.train_num_prompts, 0)
    test_dataset = task.held_out_dataset(settings.eval_num_prompts)

    results: dict[str, Any] = {
        "version": 1,
        "command": command,
        "command_full": full_command,
        "settings": asdict(settings),
        "task": task_record(task, spec),
        "model": model_path,
        "environment": _environment(),
        "code": code_version(),  # the commit and whether the tree was clean, here where the study runs
        "arms": {a: dict(o) for a, o in arms.items()},
        "started": previous_results.get("started", time.strftime("%Y-%m-%d %H:%M:%S")),
        "wall_time_s": None,
        "runs": [],
        "runs_trained": 0,
        "runs_resumed": 0,
        "summary": {},
        "contrasts": {},
    }
    wall_before = float(previous_results.get("wall_time_s") or 0.0)
    plan = [(arm, seed) for arm in settings.arms for seed in settings.seeds]
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    results["environment"]["torch_threads"] = settings.threads
    start = time.perf_counter()
    bar = tqdm(total=len(plan) * settings.steps, desc="study", unit="step", disable=not progress, dynamic_ncols=True)
    try:
        for i, (arm, seed) in enumerate(plan):
            if (arm, seed) in previous:  # --resume: finished before, kept as it was
                results["runs"].append(previous[(arm, seed)])
                results["runs_resumed"] += 1
                bar.update(settings.steps)
                continue
            bar.set_description(f"study {i + 1}/{len(plan)} {arm} seed {seed}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                record = _run_one(arm, arms[arm], seed, settings, model_path, task, train_dataset, test_dataset, bar)
            record["code"] = results["code"]  # per run: a study resumed from another commit keeps each run's own
            results["runs"].append(record)
            results["runs_trained"] += 1
            if record["status"] != "ok":
                bar.write(f"safevocab study: {arm} seed {seed} FAILED: {record['error']}")
            results["wall_time_s"] = wall_before + time.perf_counter() - start
            results["summary"] = summarize(results)
            results["contrasts"] = contrasts(results)
            write_json(results, out / "results.json")  # after every run: an interrupted study keeps its runs
    finally:
        bar.close()
        torch.set_num_threads(threads_before)
        done = {(r["arm"], r["seed"]) for r in results["runs"]}
        for arm, seed in plan:  # interrupted: the runs that never started are listed as such
            if (arm, seed) not in done:
                results["runs"].append(
                    {
                        "arm": arm,
                        "seed": seed,
                        "status": "not_run",
                        "error": "not run",
                        "eval": {"step": [], task.metric_name: []},
                        "series": {"step": []},
                        "wall_time_s": None,
                        "train_runtime_s": None,
                        "length_decay": None,
                    }
                )
        results["wall_time_s"] = wall_before + time.perf_counter() - start
        results["summary"] = summarize(results)
        results["contrasts"] = contrasts(results)
        restore_libraries()
        write_report(results, out, plots=plots)
    return results


def settings_command(settings: StudySettings) -> str:
    """The ``safevocab study`` command line that reproduces ``settings`` with every flag explicit."""
    parts = ["safevocab", "study"]
    for name, value in asdict(settings).items():
        if value is None or value is False:  # unset (model, eval_seeds, ...) or a switch that is off (eval_on_rule)
            continue
        parts.append(f"--{name}")
        if value is True:  # a switch (store_true): the flag alone
            continue
        parts.extend(str(v) for v in value) if isinstance(value, list) else parts.append(str(value))
    return shlex.join(parts)
