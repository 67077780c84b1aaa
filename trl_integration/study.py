"""``safevocab study``: remedies for training–inference mismatch compared arm by arm, over several seeds.

Under one controlled mismatch (injected bounded logit noise ``--noise EPS`` on the ``generate`` rollouts, and/or a
lower rollout precision ``--rollout_dtype``), the command trains the same GRPO job once per *(arm, seed)*,
in-process and one after the other, and writes a report folder:

- ``report.md``: the settings, the exact command, a table of final and best held-out accuracy per arm (mean ± std
  over seeds), the final training reward per arm, the mismatch diagnostics, and any run that failed;
- one PNG per metric (reward, held-out accuracy, log-ppl gap, gradient norm, out-of-set fraction, response length,
  learning rate): one line per arm, the mean over seeds, with a shaded band from the smallest to the largest seed;
- ``results.json``: the settings and every run's per-step series (written after each run, so an interrupted study
  keeps what it finished).

The arms (``--arms``, default all five):

- ``no_remedy``: ``safe_vocab_rule=none`` (full vocabulary), no importance-sampling correction;
- ``tis``: ``none`` + truncated IS (``token_truncate``, the ratio clipped above at ``--is_clip_max``);
- ``mis``: ``none`` + masked IS (``--mis_mode`` ``token_mask`` or ``sequence_mask``; ratios outside
  ``[--is_clip_min, --is_clip_max]`` are zeroed);
- ``dvp``: ``--dvp_rule`` (default ``min_p=0.01``) in the sampler and the trainer, no IS;
- ``dvp_length_decay``: ``dvp`` + ``--length_decay --length_decay_period auto`` (the LR is held until the response
  length surges, then halved every ``round(1.8 x surge step)`` steps).

Every arm shares the model, the data, the batch, the optimiser settings and the learning-rate schedule
(``--lr_scheduler_type``, default ``constant``; ``dvp_length_decay`` replaces it by the length-decay schedule, which
is constant until a surge). Runs of the same seed share the data order, the sampling seed and the noise seed. The
held-out accuracy is greedy accuracy on a fixed set of ``--eval_num_prompts`` test-split arithmetic problems,
measured before training and every ``--eval_every`` steps by a ``TrainerCallback``.

Exit status: 0; 1 when a run failed (the report is still written, with the failure); 2 on a bad flag (before any
work).

Examples::

    safevocab study                                           # 5 arms x 3 seeds x 150 steps, noise 0.5
    safevocab study --noise 0 --output_dir runs/study-eps0    # the no-injected-mismatch control
    safevocab study --noise 0 --rollout_dtype bfloat16 --arms no_remedy dvp --seeds 0 1
    safevocab study --steps 3 --seeds 0 --arms no_remedy dvp --eval_num_prompts 20   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ARM_NAMES",
    "ARM_DESCRIPTIONS",
    "PLOTS",
    "StudySettings",
    "arm_overrides",
    "HeldOutAccuracyCallback",
    "run_study",
    "settings_command",
    "summarize",
    "render_report",
    "write_report",
    "add_study_subparser",
    "build_parser",
    "main",
]

#: The arms, in report order.
ARM_NAMES: tuple[str, ...] = ("no_remedy", "tis", "mis", "dvp", "dvp_length_decay")

#: One line per arm for the report.
ARM_DESCRIPTIONS: dict[str, str] = {
    "no_remedy": "full vocabulary (rule none), no IS correction",
    "tis": "rule none + token-level truncated IS (token_truncate)",
    "mis": "rule none + masked IS",
    "dvp": "DVP: safe-vocabulary rule in sampler and trainer, no IS",
    "dvp_length_decay": "DVP + length-decay LR (period auto)",
}

#: The figures: file stem -> (series key, y-axis label, smoothed?). ``eval/accuracy`` is the held-out accuracy.
PLOTS: dict[str, tuple[str, str, bool]] = {
    "reward": ("reward", "mean reward of the training batch", True),
    "heldout_accuracy": ("eval/accuracy", "held-out greedy accuracy", False),
    "log_ppl_gap": ("mismatch/log_ppl_abs_diff", "log-ppl gap |log ppl_rollout - log ppl_train|", True),
    "grad_norm": ("grad_norm", "gradient norm (before clipping)", True),
    "out_of_set_frac": ("safevocab/out_of_set_frac", "sampled tokens outside the trainer's safe set", True),
    "response_length": ("completions/mean_length", "mean response length (tokens)", True),
    "learning_rate": ("learning_rate", "learning rate", False),
}

#: Keys of the training log not kept as per-step series in ``results.json`` (every other numeric key is).
_DROP_KEYS = ("step", "epoch", "num_tokens", "total_flos")

#: Steps averaged for the "final reward" of a run.
FINAL_REWARD_STEPS = 10

_MIS_MODES = ("token_mask", "sequence_mask")
_NOISE_KINDS = ("uniform", "clipped_gaussian")
_ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class StudySettings:
    """Everything a study run depends on (the command-line flags of ``safevocab study``).

    Attributes:
        arms: arm names, a subset of `ARM_NAMES`, in the order they run.
        seeds: training seeds; each arm runs once per seed (sampling, data order and noise seeds).
        steps: optimizer steps per run.
        eval_every: held-out evaluation every this many steps (and at step 0 and at the last step).
        eval_num_prompts: size of the fixed held-out set (test split, seed 1, as ``safevocab-grpo``'s summary).
        noise: bound ε of the injected rollout logit noise (``rollout_logit_noise``); 0 disables it.
        noise_kind: ``uniform`` or ``clipped_gaussian``.
        rollout_dtype: precision of the ``generate`` rollouts (``auto`` = the model's, float32 here).
        dvp_rule: safe-vocabulary rule of the ``dvp`` arms.
        mis_mode: ``token_mask`` or ``sequence_mask`` for the ``mis`` arm.
        is_clip_min: lower IS bound of the ``mis`` arm (ratios below it are masked).
        is_clip_max: upper IS bound of ``tis`` (truncation) and ``mis`` (masking).
        learning_rate: initial learning rate.
        lr_scheduler_type: the Trainer's schedule for every arm but ``dvp_length_decay``.
        num_prompts_per_step: prompts per optimizer step (the batch is this times ``num_generations``).
        num_generations: completions per prompt (the GRPO group size).
        max_completion_length: longest completion in tokens.
        train_num_prompts: size of the training prompt pool (train split, seed 0).
        model: model folder; ``None`` = the bundled tiny arithmetic model.
        smooth: trailing moving-average window (steps) of the per-step training metrics in the plots.
        threads: torch intra-op threads during the study (``torch.set_num_threads``). The default 1 is the fastest
            for the tiny model on a shared CPU: 2 threads were ~6x slower per step when other jobs loaded the cores.
        output_dir: where the report, the plots and ``results.json`` go.
    """

    arms: list[str] = field(default_factory=lambda: list(ARM_NAMES))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    steps: int = 150
    eval_every: int = 25
    eval_num_prompts: int = 200
    noise: float = 0.5
    noise_kind: str = "uniform"
    rollout_dtype: str = "auto"
    dvp_rule: str = "min_p=0.01"
    mis_mode: str = "token_mask"
    is_clip_min: float = 0.5
    is_clip_max: float = 2.0
    learning_rate: float = 1e-4
    lr_scheduler_type: str = "constant"
    num_prompts_per_step: int = 8
    num_generations: int = 8
    max_completion_length: int = 8
    train_num_prompts: int = 4096
    model: str | None = None
    smooth: int = 10
    threads: int = 1
    output_dir: str = "runs/safevocab-study"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag on any out-of-range value."""
        unknown = [a for a in self.arms if a not in ARM_NAMES]
        if unknown or not self.arms:
            raise ValueError(f"--arms {self.arms!r} is not accepted: accepted a non-empty subset of {list(ARM_NAMES)}")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"--arms {self.arms!r} repeats an arm")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds {self.seeds!r} is not accepted: accepted distinct integers")
        for name in ("steps", "eval_every", "eval_num_prompts", "num_prompts_per_step", "num_generations",
                     "max_completion_length", "train_num_prompts", "smooth", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} {value!r} is out of range: accepted an integer >= 1")
        if self.num_generations < 2:
            raise ValueError(f"--num_generations {self.num_generations!r} is out of range: GRPO needs >= 2")
        if not (math.isfinite(self.noise) and self.noise >= 0):
            raise ValueError(f"--noise {self.noise!r} is out of range: accepted a finite float >= 0")
        if self.noise_kind not in _NOISE_KINDS:
            raise ValueError(f"--noise_kind {self.noise_kind!r} is not accepted: accepted one of {_NOISE_KINDS}")
        if self.rollout_dtype not in _ROLLOUT_DTYPES:
            raise ValueError(
                f"--rollout_dtype {self.rollout_dtype!r} is not accepted: accepted one of {_ROLLOUT_DTYPES}"
            )
        if self.mis_mode not in _MIS_MODES:
            raise ValueError(f"--mis_mode {self.mis_mode!r} is not accepted: accepted one of {_MIS_MODES}")
        if not (0 <= self.is_clip_min < self.is_clip_max):
            raise ValueError(
                f"--is_clip_min {self.is_clip_min!r} / --is_clip_max {self.is_clip_max!r} are out of range: "
                "accepted 0 <= min < max"
            )
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"--learning_rate {self.learning_rate!r} is out of range: accepted a float > 0")
        from safevocab import parse_rule

        parse_rule(self.dvp_rule)  # raises ValueError naming the rule


# ----------------------------------------------------------------------------------------------------
# arms and runs
# ----------------------------------------------------------------------------------------------------


def arm_overrides(arm: str, settings: StudySettings) -> dict[str, Any]:
    """The ``SafeVocabGRPOConfig`` fields that define ``arm`` (on top of the shared settings)."""
    no_is = dict(vllm_importance_sampling_correction=False)
    if arm == "no_remedy":
        return dict(safe_vocab_rule="none", **no_is)
    if arm == "tis":
        return dict(
            safe_vocab_rule="none",
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_min=None,
            vllm_importance_sampling_clip_max=settings.is_clip_max,
        )
    if arm == "mis":
        return dict(
            safe_vocab_rule="none",
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=settings.mis_mode,
            vllm_importance_sampling_clip_min=settings.is_clip_min,
            vllm_importance_sampling_clip_max=settings.is_clip_max,
        )
    if arm == "dvp":
        return dict(safe_vocab_rule=settings.dvp_rule, safe_vocab_in_sampler=True, **no_is)
    if arm == "dvp_length_decay":
        return dict(
            safe_vocab_rule=settings.dvp_rule, safe_vocab_in_sampler=True, length_decay=True,
            length_decay_period="auto", **no_is,
        )
    raise ValueError(f"unknown arm {arm!r}: accepted one of {list(ARM_NAMES)}")


def _shared_config(settings: StudySettings, seed: int, output_dir: str) -> dict[str, Any]:
    return dict(
        output_dir=output_dir,
        max_steps=settings.steps,
        per_device_train_batch_size=settings.num_prompts_per_step * settings.num_generations,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        learning_rate=settings.learning_rate,
        lr_scheduler_type=settings.lr_scheduler_type,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=seed,
        rollout_noise_seed=seed,
        rollout_logit_noise=settings.noise,
        rollout_logit_noise_kind=settings.noise_kind,
        rollout_dtype=settings.rollout_dtype,
        rollout_logprobs=True,
        log_mismatch_metrics=True,
    )


try:  # the callbacks subclass transformers' TrainerCallback when it is installed (the trl extra)
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover - without the trl extra nothing here can run anyway
    _CallbackBase = object


class HeldOutAccuracyCallback(_CallbackBase):
    """Greedy accuracy on a fixed held-out set before training and every ``every`` optimizer steps.

    The accuracy (:func:`trl_integration.tasks.arithmetic.accuracy`) saves and restores torch's global random
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
        from trl_integration.tasks.arithmetic import accuracy

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
        from trl_integration.tasks.arithmetic import arithmetic_reward
        from trl_integration.trainer import SafeVocabGRPOTrainer

        with tempfile.TemporaryDirectory(prefix="safevocab-study-") as tmp:
            config = SafeVocabGRPOConfig(**{**_shared_config(settings, seed, tmp), **overrides})
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

    from trl_integration.tasks.arithmetic import make_dataset

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
        from trl_integration.assets import tiny_model_path

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
            _write_json(results, out / "results.json")  # after every run: an interrupted study keeps its runs
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


def _write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def _run_metrics(run: dict) -> dict[str, float | None]:
    """Scalar outcomes of one run (None where undefined)."""
    ev = run.get("eval") or {}
    steps, acc = ev.get("step") or [], ev.get("accuracy") or []
    after = [a for s, a in zip(steps, acc) if s > 0]
    series = run.get("series") or {}

    def mean_of(key: str, last: int | None = None) -> float | None:
        vals = [v for v in (series.get(key) or []) if v is not None]
        if last is not None:
            vals = vals[-last:]
        return sum(vals) / len(vals) if vals else None

    return {
        "initial_accuracy": acc[0] if steps and steps[0] == 0 else None,
        "final_accuracy": after[-1] if after else None,
        "best_accuracy": max(after) if after else None,
        "final_reward": mean_of("reward", FINAL_REWARD_STEPS),
        "first_reward": (lambda v: sum(v) / len(v) if v else None)(
            [x for x in (series.get("reward") or [])[:FINAL_REWARD_STEPS] if x is not None]),
        "log_ppl_gap": mean_of("mismatch/log_ppl_abs_diff"),
        "k3_kl": mean_of("mismatch/k3_kl"),
        "out_of_set_frac": mean_of("safevocab/out_of_set_frac"),
        "is_clipped_frac": mean_of("mismatch/is_clipped_frac"),
        "grad_norm": mean_of("grad_norm"),
        "mean_length": mean_of("completions/mean_length"),
        "wall_time_s": run.get("wall_time_s"),
    }


def summarize(results: dict) -> dict[str, dict]:
    """Per arm: run counts and mean/std over the successful seeds of each outcome of `_run_metrics`, plus the
    final-accuracy difference to ``no_remedy`` paired by seed (when both ran)."""
    arms = list(results["arms"])
    per_run = {(r["arm"], r["seed"]): (r, _run_metrics(r)) for r in results["runs"]}
    summary: dict[str, dict] = {}
    for arm in arms:
        runs = [(r, m) for (a, _), (r, m) in per_run.items() if a == arm]
        ok = [(r, m) for r, m in runs if r["status"] == "ok"]
        entry: dict[str, Any] = {
            "runs": len(runs),
            "ok": len(ok),
            "failed": [{"seed": r["seed"], "error": r.get("error")} for r, _ in runs if r["status"] == "failed"],
            "not_run": [r["seed"] for r, _ in runs if r["status"] == "not_run"],
            "seeds_ok": [r["seed"] for r, _ in ok],
        }
        for key in ("initial_accuracy", "final_accuracy", "best_accuracy", "final_reward", "first_reward",
                    "log_ppl_gap", "k3_kl", "out_of_set_frac", "is_clipped_frac", "grad_norm", "mean_length",
                    "wall_time_s"):
            mean, std = _mean_std([m[key] for _, m in ok])
            entry[key] = {"mean": mean, "std": std, "n": sum(m[key] is not None for _, m in ok)}
        diffs = []
        for r, m in ok:
            base = per_run.get(("no_remedy", r["seed"]))
            if arm != "no_remedy" and base is not None and base[0]["status"] == "ok":
                if m["final_accuracy"] is not None and base[1]["final_accuracy"] is not None:
                    diffs.append(m["final_accuracy"] - base[1]["final_accuracy"])
        mean, std = _mean_std(diffs)
        entry["final_accuracy_vs_no_remedy"] = {"mean": mean, "std": std, "n": len(diffs)}
        decays = [r.get("length_decay") for r, _ in ok if r.get("length_decay")]
        if decays:
            entry["length_decay"] = {
                "surges_detected": sum(d["surge_step"] is not None for d in decays),
                "runs": len(decays),
                "surge_steps": [d["surge_step"] for d in decays],
                "decay_periods": [d["decay_period"] for d in decays],
            }
        summary[arm] = entry
    for i, arm in enumerate(arms):  # an arm whose every run equals an earlier arm's, step for step
        summary[arm]["identical_to"] = next((other for other in arms[:i] if _same_runs(results, arm, other)), None)
    return summary


def _same_runs(results: dict, arm: str, other: str) -> bool:
    """Whether ``arm`` and ``other`` finished the same seeds with identical reward, gradient-norm and held-out
    accuracy series (e.g. ``dvp_length_decay`` when no surge is detected under a constant LR)."""
    runs = {r["seed"]: r for r in results["runs"] if r["arm"] == arm and r["status"] == "ok"}
    others = {r["seed"]: r for r in results["runs"] if r["arm"] == other and r["status"] == "ok"}
    if not runs or set(runs) != set(others):
        return False
    for seed, run in runs.items():
        a, b = run["series"], others[seed]["series"]
        if not a.get("reward") or any(a.get(k) != b.get(k) for k in ("step", "reward", "grad_norm")):
            return False
        if run["eval"] != others[seed]["eval"]:
            return False
    return True


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------


def _pm(stat: dict | None, digits: int = 3, signed: bool = False) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    fmt = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    text = fmt.format(stat["mean"])
    if stat.get("std") is not None:
        text += f" ± {stat['std']:.{digits}f}"
    return text


def _g(stat: dict | None) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    return f"{stat['mean']:.3g}"


def _status(entry: dict) -> str:
    text = f"{entry['ok']}/{entry['runs']}"
    if entry["failed"]:
        text += f" (**{len(entry['failed'])} failed**)"
    if entry["not_run"]:
        text += f" ({len(entry['not_run'])} not run)"
    return text


def _settings_rows(results: dict) -> list[tuple[str, str]]:
    s = results["settings"]
    env = results.get("environment", {})
    batch = s["num_prompts_per_step"] * s["num_generations"]
    mismatch = []
    if s["noise"] > 0:
        mismatch.append(f"{s['noise_kind']} logit noise, ε = {s['noise']:g} (rollout_logit_noise)")
    mismatch.append(f"rollout_dtype {s['rollout_dtype']}")
    if s["noise"] == 0 and s["rollout_dtype"] in ("auto", "float32"):
        mismatch.append("no injected mismatch (fp32 rollout and fp32 training)")
    model = results.get("model") or "bundled"
    try:
        from trl_integration.assets import TINY_MODEL_NAME, tiny_model_path

        if Path(model).resolve() == tiny_model_path().resolve():
            model = f"{TINY_MODEL_NAME} (bundled)"
    except Exception:
        pass
    return [
        ("model", str(model)),
        ("task", f"arithmetic (train pool {s['train_num_prompts']} prompts, seed 0), reward arithmetic_reward"),
        ("mismatch", "; ".join(mismatch)),
        ("steps per run", str(s["steps"])),
        ("batch", f"{s['num_prompts_per_step']} prompts × {s['num_generations']} generations = {batch} completions "
                  f"per step, max_completion_length {s['max_completion_length']}"),
        ("optimiser", f"AdamW, lr {s['learning_rate']:g}, schedule {s['lr_scheduler_type']} (dvp_length_decay: "
                      "LengthDecayLR, constant until a surge), beta 0, loss dapo (trl default), temperature 1"),
        ("DVP rule", s["dvp_rule"]),
        ("IS settings", f"tis: token_truncate, clip_max {s['is_clip_max']:g}; mis: {s['mis_mode']}, "
                        f"[{s['is_clip_min']:g}, {s['is_clip_max']:g}]"),
        ("seeds", ", ".join(str(x) for x in s["seeds"])),
        ("held-out evaluation", f"greedy accuracy on {s['eval_num_prompts']} test-split problems (seed 1), at step 0 "
                                f"and every {s['eval_every']} steps"),
        ("software", f"torch {env.get('torch')}, transformers {env.get('transformers')}, trl {env.get('trl')}, "
                     f"python {env.get('python')}, {env.get('torch_threads')} torch threads"),
        ("wall time", f"{results['wall_time_s']:.0f} s in total" if results.get("wall_time_s") is not None else "–"),
    ]


def render_report(
    results: dict, image_prefix: str = "", heading_level: int = 1, plots: bool = True, title: str | None = None
) -> str:
    """The Markdown of ``report.md``.

    Args:
        results: the dict `run_study` returns (or ``results.json`` loaded).
        image_prefix: prepended to the PNG file names in the image links (e.g. ``"img/study/eps0.5/"``).
        heading_level: level of the top heading (``1`` = ``#``); the sections are one level deeper.
        plots: include the figure links.
        title: the top heading's text (default: "safevocab study: arms × seeds × steps").
    """
    h = "#" * heading_level
    hh = "#" * (heading_level + 1)
    s = results["settings"]
    summ = results["summary"]
    arms = list(results["arms"])
    title = title or f"safevocab study: {len(arms)} arms × {len(s['seeds'])} seeds × {s['steps']} steps"
    lines = [f"{h} {title}", ""]
    lines += [f"{hh} Command", "", "```bash", results["command"], "```", ""]
    if results.get("command_full") and results["command_full"] != results["command"]:
        lines += ["With every flag explicit:", "", "```bash", results["command_full"], "```", ""]
    lines += [f"{hh} Settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _settings_rows(results)]
    lines += ["", "Arms:", ""]
    for arm in arms:
        what = ARM_DESCRIPTIONS.get(arm, "custom arm")
        lines.append(f"- `{arm}`: {what} — `{_overrides_text(results['arms'][arm])}`")
    initial = [summ[a]["initial_accuracy"]["mean"] for a in arms if summ[a]["initial_accuracy"]["mean"] is not None]
    lines += ["", f"{hh} Held-out accuracy", ""]
    if initial:
        lines.append(f"Held-out greedy accuracy before training: {initial[0]:.3f} (the same model for every run).")
        lines.append("")
    lines += [
        "Mean ± sample standard deviation over the seeds that finished. *final*: at the last step; *best*: the "
        "highest of the evaluations after step 0; *Δ final vs no_remedy*: the difference to `no_remedy` with the "
        "same seed, averaged over seeds.",
        "",
        "| arm | runs ok | final accuracy | best accuracy | Δ final vs no_remedy |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        e = summ[arm]
        delta = "–" if arm == "no_remedy" else _pm(e["final_accuracy_vs_no_remedy"], signed=True)
        lines.append(f"| {arm} | {_status(e)} | {_pm(e['final_accuracy'])} | {_pm(e['best_accuracy'])} | {delta} |")
    lines += [
        "",
        f"{hh} Training reward and mismatch",
        "",
        f"*final reward*: mean training-batch reward of the last {FINAL_REWARD_STEPS} steps (first "
        f"{FINAL_REWARD_STEPS} steps for *first reward*). The other columns are means over all steps: log-ppl gap "
        "`mismatch/log_ppl_abs_diff`, k3 KL `mismatch/k3_kl`, out-of-set `safevocab/out_of_set_frac`, "
        "IS clipped/masked `mismatch/is_clipped_frac` (IS arms only), gradient norm before clipping.",
        "",
        "| arm | first reward | final reward | log-ppl gap | k3 KL | out-of-set | IS clipped/masked | grad norm | "
        "length | s / run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        e = summ[arm]
        lines.append(
            f"| {arm} | {_pm(e['first_reward'])} | {_pm(e['final_reward'])} | {_g(e['log_ppl_gap'])} | "
            f"{_g(e['k3_kl'])} | {_g(e['out_of_set_frac'])} | {_g(e['is_clipped_frac'])} | {_g(e['grad_norm'])} | "
            f"{_g(e['mean_length'])} | {_g(e['wall_time_s'])} |"
        )
    for arm in arms:
        if summ[arm].get("identical_to"):
            lines += ["", f"`{arm}` reproduced `{summ[arm]['identical_to']}` exactly: the same per-step reward, "
                          "gradient norm and held-out accuracy in every seed."]
    decays = [(a, summ[a]["length_decay"]) for a in arms if summ[a].get("length_decay")]
    for arm, d in decays:
        if d["surges_detected"] == 0:
            lines += ["", f"`{arm}`: the response-length surge detector never fired ({d['runs']} runs), so the LR "
                          "stayed at its initial value."]
        else:
            lines += ["", f"`{arm}`: the surge detector fired in {d['surges_detected']} of {d['runs']} runs "
                          f"(surge steps {d['surge_steps']}, decay periods {d['decay_periods']})."]
    failed = [(r["arm"], r["seed"], r.get("error")) for r in results["runs"] if r["status"] == "failed"]
    not_run = [(r["arm"], r["seed"]) for r in results["runs"] if r["status"] == "not_run"]
    lines += ["", f"{hh} Failed runs", ""]
    if not failed and not not_run:
        lines.append("None: every (arm, seed) finished.")
    for arm, seed, err in failed:
        lines.append(f"- **{arm}, seed {seed}: failed** — `{err}` (traceback in results.json)")
    for arm, seed in not_run:
        lines.append(f"- {arm}, seed {seed}: not run (the study was interrupted)")
    if plots:
        lines += ["", f"{hh} Figures", "",
                  f"One line per arm: the mean over seeds; the band spans the smallest to the largest seed. Training "
                  f"metrics are smoothed with a trailing {s['smooth']}-step moving average (raw series in "
                  "results.json).", ""]
        for stem, (_, label, _) in PLOTS.items():
            lines += [f"![{label}]({image_prefix}{stem}.png)", ""]
    return "\n".join(lines).rstrip() + "\n"


def _overrides_text(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items())


def _smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None and math.isfinite(v)]
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


def _arm_curves(results: dict, arm: str, key: str, smooth: int) -> tuple[list[int], list[list[float]]] | None:
    """Steps and one curve per successful seed of ``key`` (``eval/accuracy`` for the held-out accuracy)."""
    curves: list[dict[int, float]] = []
    for r in results["runs"]:
        if r["arm"] != arm or r["status"] != "ok":
            continue
        if key == "eval/accuracy":
            steps, vals = r["eval"]["step"], r["eval"]["accuracy"]
        else:
            steps, vals = r["series"].get("step", []), r["series"].get(key)
            if vals is None:
                continue
            vals = [float("nan") if v is None else v for v in vals]
            if smooth > 1:
                vals = _smooth(vals, smooth)
        curves.append(dict(zip(steps, vals)))
    if not curves:
        return None
    steps = sorted(set().union(*curves))
    return steps, [[c.get(st, float("nan")) for st in steps] for c in curves]


def _plot_metric(results: dict, stem: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    key, label, smoothed = PLOTS[stem]
    s = results["settings"]
    window = s["smooth"] if smoothed else 1
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    for i, arm in enumerate(results["arms"]):
        color = colors[i % len(colors)]
        curves = _arm_curves(results, arm, key, window)
        entry = results["summary"].get(arm, {})
        if curves is None:
            reason = "failed" if entry.get("failed") else "no data"
            ax.plot([], [], color=color, ls=":", label=f"{arm} ({reason})")
            continue
        steps, values = curves
        same = entry.get("identical_to")
        style = dict(lw=max(1.0, 2.6 - 0.4 * i), ls=("-", "--", "-.", ":")[i % 4])
        arr = np.array(values, dtype=float)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (a step no seed logged)
            mean, lo, hi = np.nanmean(arr, axis=0), np.nanmin(arr, axis=0), np.nanmax(arr, axis=0)
        n = arr.shape[0]
        marker = "o" if key == "eval/accuracy" else None
        ax.plot(steps, mean, color=color, marker=marker, ms=3, label=f"{arm} (n={n}{', = ' + same if same else ''})",
                **style)
        if n > 1:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
        drawn += 1
    title = label
    if window > 1:
        title += f" ({window}-step moving average)"
    noise = f"ε={s['noise']:g} {s['noise_kind']}" if s["noise"] > 0 else "no injected noise"
    ax.set_title(f"{title}\n{noise}, rollout {s['rollout_dtype']}; mean over seeds, band = min..max", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(label, fontsize=8)
    if key == "learning_rate":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(results: dict, output_dir: str | os.PathLike, plots: bool = True) -> list[Path]:
    """Write ``results.json``, ``report.md`` and (with ``plots``) one PNG per entry of `PLOTS`.

    Returns:
        The written paths, ``report.md`` first.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.md", out / "results.json"]
    if plots:
        for stem in PLOTS:
            _plot_metric(results, stem, out / f"{stem}.png")
            files.append(out / f"{stem}.png")
    results["files"] = [f.name for f in files]
    _write_json(results, out / "results.json")
    (out / "report.md").write_text(render_report(results, plots=plots), encoding="utf-8")
    return files


# ----------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------


def add_study_subparser(subparsers) -> argparse.ArgumentParser:
    """Add the ``study`` subcommand to an ``argparse`` subparsers action (``safevocab``'s)."""
    d = StudySettings()
    p = subparsers.add_parser(
        "study",
        help="compare mismatch remedies (no remedy, TIS, MIS, DVP, DVP + length decay) over seeds, with a report",
        description="Train GRPO on the bundled tiny arithmetic model once per (arm, seed) under a controlled "
        "training-inference mismatch, and write report.md, PNG plots and results.json. See docs/results.md.",
    )
    p.add_argument("--arms", nargs="+", default=d.arms, choices=ARM_NAMES, metavar="ARM",
                   help=f"arms to run, among {', '.join(ARM_NAMES)} (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=d.seeds, metavar="SEED",
                   help="seeds; each arm runs once per seed (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--eval_every", type=int, default=d.eval_every,
                   help="held-out evaluation every K steps, plus step 0 and the last (default: %(default)s)")
    p.add_argument("--eval_num_prompts", type=int, default=d.eval_num_prompts,
                   help="held-out test-split problems scored greedily (default: %(default)s)")
    p.add_argument("--noise", type=float, default=d.noise, metavar="EPS",
                   help="bound of the injected rollout logit noise, 0 for none (default: %(default)s)")
    p.add_argument("--noise_kind", choices=_NOISE_KINDS, default=d.noise_kind,
                   help="distribution of the noise (default: %(default)s)")
    p.add_argument("--rollout_dtype", choices=_ROLLOUT_DTYPES, default=d.rollout_dtype,
                   help="precision of the generate rollouts (default: %(default)s)")
    p.add_argument("--dvp_rule", default=d.dvp_rule, help="safe-vocabulary rule of the dvp arms (default: %(default)s)")
    p.add_argument("--mis_mode", choices=_MIS_MODES, default=d.mis_mode, help="mis arm's mode (default: %(default)s)")
    p.add_argument("--is_clip_min", type=float, default=d.is_clip_min,
                   help="mis: ratios below are masked (default: %(default)s)")
    p.add_argument("--is_clip_max", type=float, default=d.is_clip_max,
                   help="tis: truncation; mis: ratios above are masked (default: %(default)s)")
    p.add_argument("--learning_rate", type=float, default=d.learning_rate, help="(default: %(default)s)")
    p.add_argument("--lr_scheduler_type", default=d.lr_scheduler_type,
                   help="Trainer LR schedule of every arm but dvp_length_decay (default: %(default)s)")
    p.add_argument("--num_prompts_per_step", type=int, default=d.num_prompts_per_step, help="(default: %(default)s)")
    p.add_argument("--num_generations", type=int, default=d.num_generations, help="(default: %(default)s)")
    p.add_argument("--max_completion_length", type=int, default=d.max_completion_length,
                   help="(default: %(default)s)")
    p.add_argument("--train_num_prompts", type=int, default=d.train_num_prompts, help="(default: %(default)s)")
    p.add_argument("--model", default=None, help="model folder (default: the bundled tiny arithmetic model)")
    p.add_argument("--smooth", type=int, default=d.smooth,
                   help="moving-average window of the per-step plots (default: %(default)s)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads during the study; 1 is fastest for the tiny model (default: %(default)s)")
    p.add_argument("--output_dir", default=d.output_dir, help="report folder (default: %(default)s)")
    p.add_argument("--no_plots", action="store_true", help="write report.md and results.json only")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_study_command)
    return p


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser with the single subcommand ``study`` (``safevocab``'s own parser adds it too)."""
    parser = argparse.ArgumentParser(prog="safevocab")
    add_study_subparser(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser


def _fail(message: str) -> int:
    print(f"safevocab study: error: {message}", file=sys.stderr)
    return 2


def _study_command(args, argv: Sequence[str] | None = None) -> int:
    names = [f.name for f in StudySettings.__dataclass_fields__.values()]
    settings = StudySettings(**{n: getattr(args, n) for n in names})
    try:
        settings.validate()
        if settings.model is not None and not Path(settings.model).is_dir():
            raise ValueError(f"--model {settings.model!r} is not a folder (save_pretrained output)")
    except ValueError as err:
        return _fail(str(err))
    command = getattr(args, "_command", None)
    if command is None and sys.argv[1:2] == ["study"]:  # the console script: what the user typed
        command = shlex.join(["safevocab", *sys.argv[1:]])
    results = run_study(settings, command=command, progress=not args.quiet, plots=not args.no_plots)
    summ = results["summary"]
    print(f"safevocab study: wrote {Path(settings.output_dir) / 'report.md'} ({results['wall_time_s']:.0f} s)")
    for arm in results["arms"]:
        e = summ[arm]
        print(f"  {arm:<18} runs ok {_status(e):<12} final acc {_pm(e['final_accuracy'])}  "
              f"best {_pm(e['best_accuracy'])}  final reward {_pm(e['final_reward'])}")
    failed = sum(len(summ[a]["failed"]) for a in results["arms"])
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``safevocab study ARGS`` as a function: ``argv`` are the arguments after ``study``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(["study", *argv])
    args._command = "safevocab study " + shlex.join(argv)
    return args.func(args)
