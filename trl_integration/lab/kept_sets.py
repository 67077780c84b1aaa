"""The kept sets of a diagnose run: how large the rule's safe set is, how much probability it prunes, and how often
the training and rollout sides keep different sets.

Per scored position, :func:`~trl_integration.lab.engine.run_diagnose` records each side's kept-set size ``|S|`` and
its log kept mass ``log(1 - m)`` (``m``: the pruned probability mass), as :func:`safevocab.safe_log_softmax` returns
them, and whether the two sides' sets differ (:func:`safevocab.mismatch.safe_set_disagreement`).
:func:`kept_set_stats` summarises them for ``summary.json`` (``summary["rule"]["kept_sets"]``),
:func:`kept_set_lines` prints them and :func:`plot_kept_sets` draws their distributions (``kept_sets.png``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["KEPT_SET_COLUMNS", "KEPT_SET_QUANTILES", "kept_set_stats", "kept_set_lines", "plot_kept_sets"]

#: The per-position columns ``run_diagnose`` records for these statistics (also in a `DiagnoseResult`'s ``tokens``).
KEPT_SET_COLUMNS = ("kept_size_train", "kept_size_rollout", "log_kept_mass_train", "log_kept_mass_rollout")

#: The quantiles (in per cent) reported for the kept-set size and the pruned mass.
KEPT_SET_QUANTILES = (50, 90, 99)


def _distribution(x: torch.Tensor) -> dict[str, float]:
    x = x.double().flatten()
    stats = {"mean": float(x.mean()), "max": float(x.max())}
    stats.update({f"p{q}": float(torch.quantile(x, q / 100)) for q in KEPT_SET_QUANTILES})
    return stats


def kept_set_stats(
    train_size: torch.Tensor,
    rollout_size: torch.Tensor,
    train_log_kept_mass: torch.Tensor,
    rollout_log_kept_mass: torch.Tensor,
    sets_differ: torch.Tensor,
) -> dict[str, Any]:
    """The distributions of the kept-set size and of the pruned mass on each side, and the set disagreement.

    Args:
        train_size, rollout_size: ``[N]`` integers, ``|S|`` of the training and of the rollout side per position.
        train_log_kept_mass, rollout_log_kept_mass: ``[N]`` ``log(1 - m)`` per position (``m``: pruned mass).
        sets_differ: ``[N]`` bool, the two sides keep different sets.

    Returns:
        ``{"n": N, "kept_size_train": {...}, "kept_size_rollout": {...}, "pruned_mass_train": {...},
        "pruned_mass_rollout": {...}, "set_differ_frac": float}``, each distribution with ``mean``, ``max`` and the
        quantiles ``p50``, ``p90``, ``p99`` of :data:`KEPT_SET_QUANTILES`.

    Raises:
        ValueError: no position, or tensors of different lengths.
    """
    tensors = (train_size, rollout_size, train_log_kept_mass, rollout_log_kept_mass, sets_differ)
    lengths = {int(t.numel()) for t in tensors}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"kept-set statistics: position counts {sorted(lengths)}: expected one count >= 1")
    return {
        "n": lengths.pop(),
        "kept_size_train": _distribution(train_size),
        "kept_size_rollout": _distribution(rollout_size),
        "pruned_mass_train": _distribution(-torch.expm1(train_log_kept_mass.double())),
        "pruned_mass_rollout": _distribution(-torch.expm1(rollout_log_kept_mass.double())),
        "set_differ_frac": float(sets_differ.double().mean()),
    }


def kept_set_lines(stats: dict[str, Any]) -> list[str]:
    """The console lines of :func:`kept_set_stats` (training side; the rollout side's in ``summary.json``)."""
    size, mass = stats["kept_size_train"], stats["pruned_mass_train"]
    return [
        f"  kept-set size (training side)   median {size['p50']:.0f}, p90 {size['p90']:.0f}, p99 {size['p99']:.0f}, "
        f"max {size['max']:.0f} tokens",
        f"  pruned mass (training side)     mean {mass['mean']:.3g}, median {mass['p50']:.3g}, p99 {mass['p99']:.3g}",
        f"  sampler/trainer sets differ     {stats['set_differ_frac'] * 100:.1f}% of positions",
    ]


def plot_kept_sets(tokens: dict[str, torch.Tensor], rule: str, path: str | os.PathLike) -> None:
    """Two panels: the kept-set size per position (cumulative share, log scale) and the pruned mass per position, each
    side; ``tokens`` is a `DiagnoseResult`'s ``tokens`` with ``kept_size_train`` etc. (a run with a rule)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_size, ax_mass) = plt.subplots(1, 2, figsize=(10, 3.8))
    for side, label in (("train", "training"), ("rollout", "rollout")):
        values = np.sort(tokens[f"kept_size_{side}"].numpy())  # a cumulative share: no integer-binning artefacts
        share = np.arange(1, len(values) + 1) / len(values)
        ax_size.step(values, share, where="post", label=f"{label} (median {np.median(values):.0f})")
    ax_size.set_xscale("log")
    ax_size.set_xlabel("kept-set size |S| (tokens)")
    ax_size.set_ylabel("share of positions with |S| <= x")
    ax_size.grid(alpha=0.3)
    ax_size.legend(fontsize=8)
    for side in ("train", "rollout"):
        mass = -np.expm1(tokens[f"log_kept_mass_{side}"].double().numpy())
        ax_mass.hist(mass, bins=40, histtype="step", label=f"{'training' if side == 'train' else 'rollout'}")
    ax_mass.set_xlabel("pruned mass m = 1 - pi(S)")
    ax_mass.set_ylabel("positions")
    ax_mass.set_yscale("log")
    ax_mass.legend(fontsize=8)
    fig.suptitle(f"kept sets of {rule}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
