"""Running a study: every (arm, seed) trained in-process, one after the other, with held-out evaluations.

Each run builds a ``SafeVocabGRPOTrainer`` on the arm's config (:mod:`trl_integration.study.arms`), evaluates greedy
accuracy on a fixed held-out set before training and every ``eval_every`` steps (:class:`HeldOutAccuracyCallback`),
and records the per-step training log. A run that raises is recorded as failed with what it logged so far; the
results are written after every run, so an interrupted study keeps what it finished.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import shlex
import time
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trl_integration.study.aggregate import summarize
from trl_integration.study.arms import StudySettings, arm_overrides, shared_config
from trl_integration.study.report import write_json, write_report

__all__ = ["HeldOutAccuracyCallback", "run_study", "settings_command"]

#: Keys of the training log not kept as per-step series in ``results.json`` (every other numeric key is).
_DROP_KEYS = ("step", "epoch", "num_tokens", "total_flos")


try:  # the callbacks subclass transformers' TrainerCallback when it is installed (the trl extra)
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover - without the trl extra nothing here can run anyway
    _CallbackBase = object


class HeldOutAccuracyCallback(_CallbackBase):
    """Greedy accuracy on a fixed held-out set before training and every ``every`` optimizer steps.

    The accuracy (:func:`trl_integration.demo.arithmetic.accuracy`) saves and restores torch's global random
    state, so the evaluations do not change the training run. Results accumulate in ``self.steps`` and
    ``self.accuracy``.

    Args:
        trainer: the trainer (its unwrapped model and tokenizer are evaluated).
        dataset: rows with ``prompt`` and ``answer``.
        every: evaluation period in optimizer steps (the last step is always evaluated).
    """

    def __init__(self, trainer: Any, dataset: Any, every: int) -> None:
        self.trainer = trainer
        self.dataset = dataset
        self.every = every
        self.steps: list[int] = []
        self.accuracy: list[float] = []

    def _evaluate(self, step: int) -> None:
        if self.steps and self.steps[-1] == step:
            return
        from trl_integration.demo.arithmetic import accuracy

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.steps.append(step)
        self.accuracy.append(float(accuracy(model, self.trainer.processing_class, self.dataset)))

    def on_train_begin(self, args, state, control, **kwargs):
        self._evaluate(state.global_step)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self._evaluate(state.global_step)
        return control


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
    key was not logged at that step, e.g. an empty probability bucket)."""
    rows = [h for h in history if "step" in h and "reward" in h]
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


def _run_one(arm: str, overrides: dict, seed: int, settings: StudySettings, model_path: str, train_dataset,
             test_dataset, bar) -> dict:
    """Train one (arm, seed); never raises (an exception becomes ``status="failed"``)."""
    import tempfile

    record: dict[str, Any] = {
        "arm": arm, "seed": seed, "status": "failed", "error": None, "traceback": None,
        "wall_time_s": None, "train_runtime_s": None,
        "eval": {"step": [], "accuracy": []}, "series": {"step": []}, "length_decay": None,
    }
    start = time.perf_counter()
    done_before = bar.n if bar is not None else 0
    evaluator = trainer = None
    try:
        from transformers import PrinterCallback

        from trl_integration.config import SafeVocabGRPOConfig
        from trl_integration.demo.arithmetic import arithmetic_reward
        from trl_integration.trainer import SafeVocabGRPOTrainer

        with tempfile.TemporaryDirectory(prefix="safevocab-study-") as tmp:
            config = SafeVocabGRPOConfig(**{**shared_config(settings, seed, tmp), **overrides})
            trainer = SafeVocabGRPOTrainer(
                model=model_path, reward_funcs=arithmetic_reward, args=config, train_dataset=train_dataset
            )
            trainer.remove_callback(PrinterCallback)  # the study prints a progress bar, not every log line
            evaluator = HeldOutAccuracyCallback(trainer, test_dataset, settings.eval_every)
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
        if evaluator is not None:
            record["eval"] = {"step": list(evaluator.steps), "accuracy": list(evaluator.accuracy)}
        record["wall_time_s"] = time.perf_counter() - start
        del trainer
        gc.collect()
    return record


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "cpu_count": os.cpu_count()}
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


def run_study(
    settings: StudySettings,
    *,
    command: str | None = None,
    arm_configs: dict[str, dict[str, Any]] | None = None,
    progress: bool = True,
    plots: bool = True,
) -> dict:
    """Run every (arm, seed), then write ``results.json``, ``report.md`` and the plots to ``settings.output_dir``.

    Args:
        settings: the study settings (validated here).
        command: the command line recorded in the report (default: ``safevocab study`` + ``sys.argv[2:]``).
        arm_configs: ``{arm name: SafeVocabGRPOConfig overrides}`` replacing `arm_overrides` for those names
            (arms not listed in ``settings.arms`` are ignored); for custom or deliberately broken arms.
        progress: show a progress bar (tqdm) over all optimizer steps.
        plots: draw the PNG plots (needs matplotlib).

    Returns:
        The results dict (what ``results.json`` holds).
    """
    settings.validate()
    arm_configs = dict(arm_configs or {})
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    full_command = settings_command(settings)
    if command is None:
        command = full_command

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from tqdm.auto import tqdm

    from trl_integration.demo.arithmetic import make_dataset

    try:
        import datasets
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass

    model_path = settings.model
    if model_path is None:
        from trl_integration.demo.model import tiny_model_path

        model_path = str(tiny_model_path())
    train_dataset = make_dataset(settings.train_num_prompts, seed=0, split="train")
    test_dataset = make_dataset(settings.eval_num_prompts, seed=1, split="test")

    arms = {arm: arm_configs.get(arm, arm_overrides(arm, settings)) for arm in settings.arms}
    results: dict[str, Any] = {
        "version": 1,
        "command": command,
        "command_full": full_command,
        "settings": asdict(settings),
        "model": model_path,
        "environment": _environment(),
        "arms": {a: {k: v for k, v in o.items()} for a, o in arms.items()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_time_s": None,
        "runs": [],
        "summary": {},
    }
    plan = [(arm, seed) for arm in settings.arms for seed in settings.seeds]
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    results["environment"]["torch_threads"] = settings.threads
    start = time.perf_counter()
    bar = tqdm(total=len(plan) * settings.steps, desc="study", unit="step", disable=not progress, dynamic_ncols=True)
    try:
        for i, (arm, seed) in enumerate(plan):
            bar.set_description(f"study {i + 1}/{len(plan)} {arm} seed {seed}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                record = _run_one(arm, arms[arm], seed, settings, model_path, train_dataset, test_dataset, bar)
            results["runs"].append(record)
            if record["status"] != "ok":
                bar.write(f"safevocab study: {arm} seed {seed} FAILED: {record['error']}")
            results["wall_time_s"] = time.perf_counter() - start
            results["summary"] = summarize(results)
            write_json(results, out / "results.json")  # after every run: an interrupted study keeps its runs
    finally:
        bar.close()
        torch.set_num_threads(threads_before)
        done = {(r["arm"], r["seed"]) for r in results["runs"]}
        for arm, seed in plan:  # interrupted: the runs that never started are listed as such
            if (arm, seed) not in done:
                results["runs"].append({"arm": arm, "seed": seed, "status": "not_run", "error": "not run",
                                        "eval": {"step": [], "accuracy": []}, "series": {"step": []},
                                        "wall_time_s": None, "train_runtime_s": None, "length_decay": None})
        results["wall_time_s"] = time.perf_counter() - start
        results["summary"] = summarize(results)
        write_report(results, out, plots=plots)
    return results


def settings_command(settings: StudySettings) -> str:
    """The ``safevocab study`` command line that reproduces ``settings`` with every flag explicit."""
    parts = ["safevocab", "study"]
    for name, value in asdict(settings).items():
        if name == "model" and value is None:
            continue
        parts.append(f"--{name}")
        parts.extend(str(v) for v in value) if isinstance(value, list) else parts.append(str(value))
    return shlex.join(parts)
