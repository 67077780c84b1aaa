"""Aggregation of a study's runs: per-run outcomes, then mean ± sample std over the seeds of each arm.

Per run (:func:`run_metrics`): the task's held-out metric (``results["task"]["metric_name"]``, e.g. greedy accuracy)
before training, at the last step (*final*) and the best after step 0; the training reward of the first and of the
last ``FINAL_REWARD_STEPS`` steps; and means over all steps of the log-ppl gap, k3 KL, out-of-set fraction, IS
clipped/masked fraction, gradient norm, response length, and of the DVP rule's pruned mass ``m_t``
(``safevocab/pruned_mass_mean``) and the sequence total variation between the pruned and the unpruned policy it
implies (``safevocab/seq_tv_estimate``, ``1 - mean_b prod_t (1 - m_t)`` over the step's rollouts). Per arm
(:func:`summarize`): mean and standard deviation (``n - 1``) of each over the seeds that finished, the differences
of the final and late metric to ``no_remedy`` and to ``no_mismatch`` paired by seed with a 95 % confidence interval
(Student's t over the paired differences: ``mean ± t_{0.975, n-1} · std / sqrt(n)``, with the differences and their
seeds), the length-decay detector's decisions, and whether the arm reproduced an earlier arm step for step. *late*:
the mean of the held-out evaluations in the second half of training (steps > half the last evaluated step), less
noisy than the single final evaluation.

Studies that score the metric on the DVP rule's support too (``--eval_on_rule``) get the same outcomes with the
suffix ``_rule`` (``late_metric_rule``, ...); studies with evaluation seeds (``--eval_seeds``) record the metric as
the mean over them, and :func:`eval_seed_outcomes` gives the final and late metric of each evaluation seed alone,
whose paired differences ``summarize`` keeps as ``<key>_vs_<baseline>_by_eval_seed`` (one entry per evaluation
seed). Older ``results.json`` have neither: those keys are absent (or ``None``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from trl_integration.study.collapse import collapse_summary

__all__ = [
    "FINAL_REWARD_STEPS", "OUTCOMES", "BASELINES", "SCORINGS", "metric_name", "run_metrics", "eval_seed_outcomes",
    "paired_stats", "scorings", "eval_seeds", "summarize", "t_quantile_975", "t_quantile_95",
]  # fmt: skip

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
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


#: Student's t quantile t_{0.95, df} for df = 1..30 (beyond: the normal's 1.645 is within 2 %).
_T95 = (
    6.314,
    2.920,
    2.353,
    2.132,
    2.015,
    1.943,
    1.895,
    1.860,
    1.833,
    1.812,
    1.796,
    1.782,
    1.771,
    1.761,
    1.753,
    1.746,
    1.740,
    1.734,
    1.729,
    1.725,
    1.721,
    1.717,
    1.714,
    1.711,
    1.708,
    1.706,
    1.703,
    1.701,
    1.699,
    1.697,
)


def t_quantile_975(df: int) -> float:
    """Two-sided 95 % Student's t quantile for ``df`` degrees of freedom (``df >= 1``)."""
    if df < 1:
        raise ValueError(f"df={df!r} is out of range: accepted an integer >= 1")
    return _T975[df - 1] if df <= len(_T975) else 1.960


def t_quantile_95(df: int) -> float:
    """One-sided 95 % (two-sided 90 %) Student's t quantile for ``df`` degrees of freedom (``df >= 1``): the
    interval of an equivalence test by two one-sided tests at 5 % each (TOST)."""
    if df < 1:
        raise ValueError(f"df={df!r} is out of range: accepted an integer >= 1")
    return _T95[df - 1] if df <= len(_T95) else 1.645


def paired_stats(diffs: Sequence[float], seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Mean, sample std, ``n``, the 95 % t-interval ``ci95`` and the 90 % one ``ci90`` (for an equivalence test by
    two one-sided tests: equivalent within a margin ``d`` when ``ci90`` lies inside ``(-d, d)``; both ``None`` below
    two values) of paired differences, with the differences themselves (``diffs``) and the seeds they pair
    (``seeds``)."""
    mean, std = _mean_std(diffs)
    n = len(diffs)
    ci = ci90 = None
    if std is not None:
        half, half90 = (q * std / math.sqrt(n) for q in (t_quantile_975(n - 1), t_quantile_95(n - 1)))
        ci, ci90 = [mean - half, mean + half], [mean - half90, mean + half90]
    return {
        "mean": mean,
        "std": std,
        "n": n,
        "ci95": ci,
        "ci90": ci90,
        "diffs": list(diffs),
        "seeds": list(seeds) if seeds is not None else None,
    }


#: The held-out scorings a run may record: the suffix of their outcome keys and of their ``eval`` series
#: (``""``: the full distribution, always; ``"_rule"``: the DVP rule's support, with ``--eval_on_rule``).
SCORINGS = ("", "_rule")

#: The held-out outcomes of one scoring (``+ suffix``), from its evaluations.
_EVAL_OUTCOMES = ("initial_metric", "final_metric", "late_metric", "best_metric")

#: The per-run outcomes `summarize` aggregates (``*_metric``: the task's held-out metric; ``*_rule``: on the rule's
#: support, ``None`` where not scored).
OUTCOMES = (
    *_EVAL_OUTCOMES,
    *(f"{k}_rule" for k in _EVAL_OUTCOMES),
    "final_reward",
    "first_reward",
    "log_ppl_gap",
    "k3_kl",
    "out_of_set_frac",
    "is_clipped_frac",
    "grad_norm",
    "mean_length",
    "pruned_mass",
    "seq_tv",
    "entropy_full_first",
    "entropy_full_final",
    "entropy_kept_first",
    "entropy_kept_final",
    "wall_time_s",
)


def metric_name(results: dict) -> str:
    """The held-out metric's name in ``results`` (``"accuracy"`` in files written before tasks existed)."""
    return (results.get("task") or {}).get("metric_name", "accuracy")


def scorings(results: dict) -> list[str]:
    """The suffixes of the scorings some run of ``results`` recorded (``[""]`` or ``["", "_rule"]``)."""
    metric = metric_name(results)
    rule = any(f"{metric}_rule" in (r.get("eval") or {}) for r in results.get("runs", []))
    return ["", "_rule"] if rule else [""]


def eval_seeds(results: dict) -> list[int] | None:
    """The evaluation seeds the runs of ``results`` were scored with (``None``: one score, the metric's own)."""
    for run in results.get("runs", []):
        seeds = (run.get("eval") or {}).get("eval_seeds")
        if seeds:
            return list(seeds)
    return None


def _eval_outcomes(steps: Sequence[int], values: Sequence[float]) -> dict[str, float | None]:
    """initial, final, late and best metric of one series of evaluations (``None`` where undefined)."""
    values = list(values)
    if len(values) != len(steps):  # a scoring this run did not record
        return dict.fromkeys(_EVAL_OUTCOMES)
    after = [a for s, a in zip(steps, values) if s > 0]
    late = [a for s, a in zip(steps, values) if steps and s > steps[-1] / 2]
    return {
        "initial_metric": values[0] if steps and steps[0] == 0 else None,
        "final_metric": after[-1] if after else None,
        "late_metric": sum(late) / len(late) if late else None,
        "best_metric": max(after) if after else None,
    }


def eval_seed_outcomes(run: dict, metric: str = "accuracy") -> dict[str, list[float | None]]:
    """Per scoring, the final and late metric of each evaluation seed alone: ``{"final_metric": [...],
    "late_metric": [...], "final_metric_rule": [...], ...}`` (one value per seed of ``run["eval"]["eval_seeds"]``;
    ``{}`` for a run scored once)."""
    ev = run.get("eval") or {}
    steps, seeds = ev.get("step") or [], ev.get("eval_seeds") or []
    out: dict[str, list[float | None]] = {}
    for suffix in SCORINGS:
        rows = ev.get(f"{metric}{suffix}_by_seed")
        if not seeds or rows is None or len(rows) != len(steps):
            continue
        per_seed = [_eval_outcomes(steps, [row[j] for row in rows]) for j in range(len(seeds))]
        for key in ("final_metric", "late_metric"):
            out[f"{key}{suffix}"] = [o[key] for o in per_seed]
    return out


def run_metrics(run: dict, metric: str = "accuracy") -> dict[str, float | None]:
    """Scalar outcomes of one run (None where undefined); ``metric`` names the held-out metric's series."""
    ev = run.get("eval") or {}
    steps = ev.get("step") or []
    held_out = {}
    for suffix in SCORINGS:
        outcomes = _eval_outcomes(steps, ev.get(f"{metric}{suffix}") or [])
        held_out.update({f"{key}{suffix}": value for key, value in outcomes.items()})
    series = run.get("series") or {}

    def mean_of(key: str, last: int | None = None, first: int | None = None) -> float | None:
        vals = [v for v in (series.get(key) or []) if v is not None]
        if last is not None:
            vals = vals[-last:]
        if first is not None:
            vals = vals[:first]
        return sum(vals) / len(vals) if vals else None

    return {
        **held_out,
        "final_reward": mean_of("reward", FINAL_REWARD_STEPS),
        "first_reward": (lambda v: sum(v) / len(v) if v else None)(
            [x for x in (series.get("reward") or [])[:FINAL_REWARD_STEPS] if x is not None]
        ),
        "log_ppl_gap": mean_of("mismatch/log_ppl_abs_diff"),
        "k3_kl": mean_of("mismatch/k3_kl"),
        "out_of_set_frac": mean_of("safevocab/out_of_set_frac"),
        "is_clipped_frac": mean_of("mismatch/is_clipped_frac"),
        "grad_norm": mean_of("grad_norm"),
        "mean_length": mean_of("completions/mean_length"),
        "pruned_mass": mean_of("safevocab/pruned_mass_mean"),
        "seq_tv": mean_of("safevocab/seq_tv_estimate"),
        # the policy's entropy (log_entropy_metrics), over the first and the last FINAL_REWARD_STEPS steps
        "entropy_full_first": mean_of("safevocab/entropy_full", first=FINAL_REWARD_STEPS),
        "entropy_full_final": mean_of("safevocab/entropy_full", FINAL_REWARD_STEPS),
        "entropy_kept_first": mean_of("safevocab/entropy_kept", first=FINAL_REWARD_STEPS),
        "entropy_kept_final": mean_of("safevocab/entropy_kept", FINAL_REWARD_STEPS),
        "wall_time_s": run.get("wall_time_s"),
    }


def summarize(results: dict) -> dict[str, dict]:
    """Per arm: run counts and mean/std over the successful seeds of each outcome of `run_metrics`, plus the
    final- and late-metric differences to ``no_remedy`` and ``no_mismatch`` paired by seed (when both ran), per
    scoring and, with evaluation seeds, per evaluation seed (the module docstring)."""
    arms = list(results["arms"])
    metric = metric_name(results)
    per_run = {
        (r["arm"], r["seed"]): (r, {**run_metrics(r, metric), **_by_eval_seed(r, metric)}) for r in results["runs"]
    }
    compared = [f"{key}{suffix}" for suffix in scorings(results) for key in ("final_metric", "late_metric")]
    n_eval_seeds = len(eval_seeds(results) or [])
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
            for key in compared:
                entry[f"{key}_vs_{base_arm}"] = _paired_to(ok, per_run, base_arm, key)
                if n_eval_seeds:
                    entry[f"{key}_vs_{base_arm}_by_eval_seed"] = [
                        _paired_to(ok, per_run, base_arm, f"{key}@{j}") for j in range(n_eval_seeds)
                    ]
        entry["collapse"] = collapse_summary([r for r, _ in runs])
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


def _by_eval_seed(run: dict, metric: str) -> dict[str, float | None]:
    """`eval_seed_outcomes` flattened: ``"<key>@<j>"`` is the outcome of the ``j``-th evaluation seed."""
    return {f"{key}@{j}": v for key, values in eval_seed_outcomes(run, metric).items() for j, v in enumerate(values)}


def _paired_to(ok: list, per_run: dict, base_arm: str, key: str) -> dict[str, Any]:
    """`paired_stats` of ``key`` between the finished runs ``ok`` and ``base_arm``'s runs of the same seeds."""
    diffs, seeds = [], []
    for r, m in ok:
        base = per_run.get((base_arm, r["seed"]))
        if base is not None and base[0]["status"] == "ok" and None not in (m.get(key), base[1].get(key)):
            diffs.append(m[key] - base[1][key])
            seeds.append(r["seed"])
    return paired_stats(diffs, seeds)


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
