"""Figures of ``safevocab study``: one PNG per metric, one line per arm (the mean over seeds) with a min..max band.

Training metrics are smoothed with a trailing moving average of ``settings["smooth"]`` steps; the task's held-out
metric and the learning rate are drawn as logged.
"""

from __future__ import annotations

import math
import textwrap
import warnings
from pathlib import Path
from typing import Any

__all__ = ["PLOTS", "plot_specs", "has_entropy_series", "draw_metric", "plot_metric"]

#: Characters per line of a figure's subtitle: a 9-point line of this length fits the 6.4-inch figure with room to
#: spare (the one-line subtitle of a study with rounded weights was cut at both edges).
SUBTITLE_WIDTH = 80


def plot_specs(metric: str = "accuracy", rule: bool = False, entropy: bool = False) -> dict[str, tuple[str, str, bool]]:
    """The figures of a study whose held-out metric is ``metric``: file stem -> (series key, y-axis label,
    smoothed?). ``eval/<metric>`` is the held-out metric (file ``heldout_<metric>.png``); with ``rule`` (a study
    that also scored on the DVP rule's support), ``eval/<metric>_rule`` too (``heldout_<metric>_rule.png``); with
    ``entropy`` (runs that logged ``log_entropy_metrics``), the policy's entropy over the full softmax and over the
    kept set (``entropy_full.png``, ``entropy_kept.png``)."""
    on_rule = {f"heldout_{metric}_rule": (f"eval/{metric}_rule", f"held-out {metric} on the rule's support", False)}
    entropies = {
        "entropy_full": ("safevocab/entropy_full", "policy entropy, full softmax (nats)", True),
        "entropy_kept": ("safevocab/entropy_kept", "policy entropy over the trainer's kept set (nats)", True),
    }
    return {
        "reward": ("reward", "mean reward of the training batch", True),
        f"heldout_{metric}": (f"eval/{metric}", f"held-out {metric}", False),
        **(on_rule if rule else {}),
        "log_ppl_gap": ("mismatch/log_ppl_abs_diff", "log-ppl gap |log ppl_rollout - log ppl_train|", True),
        "grad_norm": ("grad_norm", "gradient norm (before clipping)", True),
        "out_of_set_frac": ("safevocab/out_of_set_frac", "sampled tokens outside the trainer's safe set", True),
        "response_length": ("completions/mean_length", "mean response length (tokens)", True),
        "learning_rate": ("learning_rate", "learning rate", False),
        **(entropies if entropy else {}),
    }


def has_entropy_series(results: dict) -> bool:
    """Whether any run of ``results`` logged the entropy metrics (``log_entropy_metrics``, since Study 4)."""
    return any("safevocab/entropy_full" in (r.get("series") or {}) for r in results.get("runs", []))


#: The figures of the arithmetic task's study (held-out greedy accuracy), see `plot_specs`.
PLOTS: dict[str, tuple[str, str, bool]] = plot_specs("accuracy")


def _smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None and math.isfinite(v)]
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


def _arm_curves(results: dict, arm: str, key: str, smooth: int) -> tuple[list[int], list[list[float]]] | None:
    """Steps and one curve per seed of ``key`` (``eval/<metric>`` for the held-out metric): the successful seeds, and
    for a training metric also the failed ones up to where they stopped (a run that collapsed into NaN)."""
    curves: list[dict[int, float]] = []
    for r in results["runs"]:
        trained = r["status"] == "ok" or (r["status"] == "failed" and not key.startswith("eval/"))
        if r["arm"] != arm or not trained:
            continue
        if key.startswith("eval/"):
            steps, vals = r["eval"]["step"], r["eval"][key[len("eval/") :]]
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


def mismatch_label(settings: dict) -> str:
    """The injected mismatch in a few words (``"ε=0.5 uniform, rollout auto"``; a truncated sampler,
    ``sampler_rule``, as ``"no injected noise, rollouts sampled with min_p=0.05, rollout auto"``)."""
    s = settings
    parts = [f"ε={s['noise']:g} {s['noise_kind']}" if s["noise"] > 0 else "no injected noise"]
    if s.get("sampler_rule") not in (None, "none"):
        parts.append(f"rollouts sampled with {s['sampler_rule']}")
    if s.get("rollout_mantissa_bits") is not None:
        parts.append(f"weights rounded to {s['rollout_mantissa_bits']} mantissa bits")
    if s.get("rollout_perturbation"):
        parts.append(f"perturbation {s['rollout_perturbation']}")
    return ", ".join(parts) + f", rollout {s['rollout_dtype']}"


def plot_metric(results: dict, stem: str, path: Path) -> None:
    """Draw the figure ``stem`` (a key of ``plot_specs(metric)``, the metric of ``results``) to ``path``."""
    import matplotlib.pyplot as plt

    fig = draw_metric(results, stem)
    fig.savefig(path)
    plt.close(fig)


def draw_metric(results: dict, stem: str) -> Any:
    """The matplotlib figure ``stem`` of `plot_metric`, not yet saved (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from trl_integration.study.aggregate import metric_name

    key, label, smoothed = plot_specs(metric_name(results), rule=True, entropy=True)[stem]
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
        marker = "o" if key.startswith("eval/") else None
        ax.plot(
            steps,
            mean,
            color=color,
            marker=marker,
            ms=3,
            label=f"{arm} (n={n}{', = ' + same if same else ''})",
            **style,
        )
        if n > 1:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
        drawn += 1
    title = label
    if window > 1:
        title += f" ({window}-step moving average)"
    subtitle = textwrap.fill(f"{mismatch_label(s)}; mean over seeds, band = min..max", SUBTITLE_WIDTH)
    ax.set_title(f"{title}\n{subtitle}", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(label, fontsize=8)
    if key == "learning_rate":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig
