"""Aggregation of a study's runs: per-run outcomes, then mean ± sample std over the seeds of each arm.

Per run (:func:`run_metrics`): the task's held-out metric (``results["task"]["metric_name"]``, e.g. greedy accuracy)
before training, at the last step (*final*) and the best after step 0; the training reward of the first and of the
last ``FINAL_REWARD_STEPS`` steps; and means over all steps of the log-ppl gap, k3 KL, out-of-set fraction, IS
clipped/masked fraction, gradient norm and response length. Per arm (:func:`summarize`): mean and standard
deviation (``n - 1``) of each over the seeds that finished, the differences of the final and late metric to
``no_remedy`` and to ``no_mismatch`` paired by seed with a 95 % confidence interval (Student's t over the paired
differences: ``mean ± t_{0.975, n-1} · std / sqrt(n)``), the length-decay detector's decisions, and whether the arm
reproduced an earlier arm step for step. *late*: the mean of the held-out evaluations in the second half of
training (steps > half the last evaluated step), less noisy than the single final evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["FINAL_REWARD_STEPS", "OUTCOMES", "BASELINES", "metric_name", "run_metrics", "summarize", "t_quantile_975"]

#: Steps averaged for the "final reward" of a run.
FINAL_REWARD_STEPS = 10


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


#: Arms every other arm is compared with, paired by seed (when they ran).
BASELINES = ("no_remedy", "no_mismatch")

#: Student's t quantile t_{0.975, df} for df = 1..30 (beyond: the normal's 1.960 is within 2 %).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """Two-sided 95 % Student's t quantile for ``df`` degrees of freedom (``df >= 1``)."""
    if df < 1:
        raise ValueError(f"df={df!r} is out of range: accepted an integer >= 1")
    return _T975[df - 1] if df <= len(_T975) else 1.960


def _paired(diffs: Sequence[float]) -> dict[str, Any]:
    mean, std = _mean_std(diffs)
    n = len(diffs)
    ci = None
    if std is not None:
        half = t_quantile_975(n - 1) * std / math.sqrt(n)
        ci = [mean - half, mean + half]
    return {"mean": mean, "std": std, "n": n, "ci95": ci}


#: The per-run outcomes `summarize` aggregates (``*_metric``: the task's held-out metric).
OUTCOMES = ("initial_metric", "final_metric", "late_metric", "best_metric", "final_reward", "first_reward", "log_ppl_gap", "k3_kl",
            "out_of_set_frac", "is_clipped_frac", "grad_norm", "mean_length", "wall_time_s")


def metric_name(results: dict) -> str:
    """The held-out metric's name in ``results`` (``"accuracy"`` in files written before tasks existed)."""
    return (results.get("task") or {}).get("metric_name", "accuracy")


def run_metrics(run: dict, metric: str = "accuracy") -> dict[str, float | None]:
    """Scalar outcomes of one run (None where undefined); ``metric`` names the held-out metric's series."""
    ev = run.get("eval") or {}
    steps, acc = ev.get("step") or [], ev.get(metric) or []
    after = [a for s, a in zip(steps, acc) if s > 0]
    late = [a for s, a in zip(steps, acc) if steps and s > steps[-1] / 2]
    series = run.get("series") or {}

    def mean_of(key: str, last: int | None = None) -> float | None:
        vals = [v for v in (series.get(key) or []) if v is not None]
        if last is not None:
            vals = vals[-last:]
        return sum(vals) / len(vals) if vals else None

    return {
        "initial_metric": acc[0] if steps and steps[0] == 0 else None,
        "final_metric": after[-1] if after else None,
        "late_metric": sum(late) / len(late) if late else None,
        "best_metric": max(after) if after else None,
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
    """Per arm: run counts and mean/std over the successful seeds of each outcome of `run_metrics`, plus the
    final-metric difference to ``no_remedy`` paired by seed (when both ran)."""
    arms = list(results["arms"])
    metric = metric_name(results)
    per_run = {(r["arm"], r["seed"]): (r, run_metrics(r, metric)) for r in results["runs"]}
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
        for key in OUTCOMES:
            mean, std = _mean_std([m[key] for _, m in ok])
            entry[key] = {"mean": mean, "std": std, "n": sum(m[key] is not None for _, m in ok)}
        for base_arm in BASELINES:
            if base_arm not in arms or arm == base_arm:
                continue
            for key in ("final_metric", "late_metric"):
                diffs = []
                for r, m in ok:
                    base = per_run.get((base_arm, r["seed"]))
                    if base is not None and base[0]["status"] == "ok" and None not in (m[key], base[1][key]):
                        diffs.append(m[key] - base[1][key])
                entry[f"{key}_vs_{base_arm}"] = _paired(diffs)
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
    metric series (e.g. ``dvp_length_decay`` when no surge is detected under a constant LR)."""
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
