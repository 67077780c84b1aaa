"""The end-of-run figure of ``safevocab-grpo``: reward, safe-set size and mismatch over the logged steps.

One PNG, ``training_curves.png``, written beside ``summary.json`` from ``trainer.state.log_history`` (the rows
that carry ``reward``), with three panels sharing the step axis:

1. **reward**: the training batch's mean reward (``reward``; the spread of 0/1 rewards within a batch would
   only hide it);
2. **safe-set size**: the mean ``|S|`` per sampled token (``safevocab/safe_size_mean``), and the mean pruned mass
   ``m = 1 - sum_{a in S} p_a`` (``safevocab/pruned_mass_mean``) on a second axis;
3. **mismatch**: the rollout-vs-training gaps ``mismatch/abs_logp_diff_mean`` (mean ``|log pi - log mu|`` per
   token), ``mismatch/log_ppl_abs_diff`` (per-sequence log-perplexity gap) and ``mismatch/k3_kl`` (the k3
   estimate of ``KL(mu || pi)``), on a log axis when every value is positive.

A metric that was not logged (rule ``none`` logs no safe-set statistics; a run without rollout log-probabilities
no mismatch) leaves its panel with a note instead of a curve. matplotlib is in the ``trl`` extra; without it no
figure is written.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["PLOT_FILE", "MISMATCH_KEYS", "write_training_curves"]

#: File name of the figure, in the run's output directory.
PLOT_FILE = "training_curves.png"

#: The mismatch metrics drawn in the third panel, with their legend labels.
MISMATCH_KEYS = {
    "mismatch/abs_logp_diff_mean": "mean |log π − log μ| per token",
    "mismatch/log_ppl_abs_diff": "|log-ppl gap| per sequence",
    "mismatch/k3_kl": "k3 KL(μ ‖ π)",
}


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of ``key`` in the logged rows."""
    steps, values = [], []
    for row in history:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(int(row.get("step", len(steps) + 1)))
            values.append(float(value))
    return steps, values


def _not_logged(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not logged in this run", ha="center", va="center", transform=ax.transAxes,
            fontsize=8, color="gray")  # fmt: skip


def write_training_curves(log_history: list[dict], out_dir: str | Path, title: str = "") -> Path | None:
    """Draw the three panels (see the module docstring) to ``out_dir / PLOT_FILE``; return the path.

    Returns ``None`` (and writes nothing) when matplotlib is not installed or no row carries a reward.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:  # the trl extra brings matplotlib; the core install does not
        return None
    history = [row for row in log_history if "reward" in row]
    if not history:
        return None
    fig = Figure(figsize=(7.0, 7.5), dpi=110)
    reward_ax, size_ax, mismatch_ax = fig.subplots(3, 1, sharex=True)

    steps, reward = _series(history, "reward")
    if reward:
        reward_ax.plot(steps, reward, marker="o", ms=3, label="mean reward of the training batch")
        reward_ax.legend(fontsize=7, loc="best")
    else:
        _not_logged(reward_ax, "reward")
    reward_ax.set_ylabel("reward", fontsize=8)

    steps, size = _series(history, "safevocab/safe_size_mean")
    if size:
        size_ax.plot(steps, size, marker="o", ms=3, color="C2", label="mean |S| per token")
        size_ax.set_ylabel("|S| (tokens)", fontsize=8)
        mass_steps, mass = _series(history, "safevocab/pruned_mass_mean")
        if mass:
            mass_ax = size_ax.twinx()
            mass_ax.plot(mass_steps, mass, ls="--", color="C3", label="mean pruned mass m")
            mass_ax.set_ylabel("pruned mass", fontsize=8)
            mass_ax.legend(fontsize=7, loc="upper right")
        size_ax.legend(fontsize=7, loc="upper left")
    else:
        _not_logged(size_ax, "safe-set size")

    drawn = []
    for key, label in MISMATCH_KEYS.items():
        steps, values = _series(history, key)
        if values:
            mismatch_ax.plot(steps, values, marker="o", ms=3, label=label)
            drawn.extend(values)
    if drawn:
        if min(drawn) > 0:
            mismatch_ax.set_yscale("log")
        mismatch_ax.legend(fontsize=7, loc="best")
    else:
        _not_logged(mismatch_ax, "rollout-vs-training mismatch")
    mismatch_ax.set_ylabel("mismatch", fontsize=8)
    mismatch_ax.set_xlabel("optimizer step")

    for ax in (reward_ax, size_ax, mismatch_ax):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or "safevocab-grpo: training curves", fontsize=10)
    fig.tight_layout()
    out = Path(out_dir) / PLOT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
