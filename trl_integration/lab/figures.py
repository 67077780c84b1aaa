"""Figures of the mismatch lab: the tail diagnostic, per-token gap against the bound, and mean gap by bucket.

- ``tail_mismatch.png``: the tail diagnostic (:mod:`trl_integration.lab.tail`): per bucket of training probability,
  the signed mean ``log mu - log pi`` of the sampled tokens (± one standard error), one bar per prompt source;
- ``mismatch_vs_p.png``: ``|log pi - log mu|`` of every scored token (a seeded subset of at most ``max_points``)
  against its training probability ``p`` on a logit axis, with the bound ``log(p + (1 - p) e^(2 eps))`` at the
  reference eps;
- ``bucket_means.png``: per probability bucket, the mean and max gap, the bound at the bucket's lower edge and
  at each token's own ``eps_t``, and with a rule the renormalised gap of the tokens both sides keep.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from safevocab.bounds import logprob_mismatch_bound
from trl_integration.lab.engine import DiagnoseResult

__all__ = ["plot_tail_mismatch", "plot_mismatch_vs_p", "plot_bucket_means"]

#: How the tail diagnostic's prompt sources are labelled in the figure.
SOURCE_LABELS = {"task": "task prompts", "free_text": "free text"}


def plot_tail_mismatch(summary: dict, path: Path) -> None:
    """Draw ``tail_mismatch.png`` from ``summary["tail"]`` (see the module docstring) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tail = summary["tail"]
    sources = list(tail["sources"].items())
    names = [r["name"] for r in sources[0][1]["buckets"]] if sources else []
    x = np.arange(len(names))
    width = 0.8 / max(1, len(sources))
    fig, ax = plt.subplots(figsize=(6.8, 4.4), dpi=110)
    for i, (source, data) in enumerate(sources):
        rows = data["buckets"]
        mean = [np.nan if r["signed_mean"] is None else r["signed_mean"] for r in rows]
        err = [0.0 if r["signed_se"] is None else r["signed_se"] for r in rows]
        offset = (i - (len(sources) - 1) / 2) * width
        label = f"{tail.get('labels', {}).get(source, SOURCE_LABELS.get(source, source))} ({data['n_tokens']} tokens)"
        ax.bar(x + offset, mean, width, yerr=err, capsize=3, label=label, color=f"C{i}", alpha=0.85)
        for xi, r in zip(x, rows):
            ax.annotate(
                f"n={r['n']}",
                (xi + offset, 0.0),
                xytext=(0, -11 if (r["signed_mean"] or 0) >= 0 else 4),
                textcoords="offset points",
                ha="center",
                fontsize=6,
            )
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xticks(x, names, rotation=15, fontsize=8)
    ax.set_xlabel("bucket of training probability p = π(y) of the sampled token")
    ax.set_ylabel("mean log μ(y) − log π(y)  (nats)")
    ax.set_title(
        f"tail mismatch on sampled tokens: {mismatch_source(summary)}\n(> 0: the rollout over-samples "
        "these tokens; bars ± 1 standard error)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="best")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def mismatch_source(summary: dict) -> str:
    """The rollout side's mismatch sources in words (``"float32 vs bfloat16, lift ε=1"``)."""
    parts = [f"{summary['train_dtype']} vs {summary['rollout_dtype']}"]
    if summary.get("rollout_mantissa_bits") is not None:
        parts.append(f"weights rounded to {summary['rollout_mantissa_bits']} mantissa bits")
    if summary["noise"] > 0:
        parts.append(f"{summary['noise_kind']} ε={summary['noise']:g}")
    return ", ".join(parts)


def plot_mismatch_vs_p(result: DiagnoseResult, path: Path, max_points: int) -> None:
    """Draw ``mismatch_vs_p.png`` (see the module docstring) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    s, t = result.summary, result.tokens
    p = t["p"].numpy()
    gap = t["log_r"].abs().numpy()
    idx = np.arange(p.size)
    if p.size > max_points:
        idx = np.random.default_rng(0).choice(p.size, max_points, replace=False)
    p, gap = p[idx], gap[idx]
    # A logit x-axis shows both tails: the bound is flat (~2 eps) for p -> 0 and vanishes as p -> 1.
    p = np.clip(p, 1e-9, 1 - 1e-9)
    nonzero = gap > 0
    floor = float(gap[nonzero].min()) / 10 if nonzero.any() else 1e-12
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    ax.scatter(
        p[nonzero],
        gap[nonzero],
        s=4,
        alpha=0.35,
        color="tab:blue",
        label=f"|log π − log μ| per token ({int(nonzero.sum())} shown)",
    )
    if (~nonzero).any():
        ax.scatter(
            p[~nonzero],
            np.full((~nonzero).sum(), floor),
            s=4,
            alpha=0.35,
            color="tab:gray",
            marker="v",
            label=f"exactly 0 ({int((~nonzero).sum())}, drawn at the floor)",
        )
    p_lo = max(min(float(p.min()), 1e-3) / 3, 1e-9)
    p_hi = 1 - max(min(1 - float(p.max()), 1e-3) / 3, 1e-9)
    grid = 1.0 / (1.0 + np.exp(-np.linspace(math.log(p_lo / (1 - p_lo)), math.log(p_hi / (1 - p_hi)), 400)))
    eps = s["eps_ref"]
    curve = logprob_mismatch_bound(torch.tensor(grid), torch.tensor(eps, dtype=torch.float64)).numpy()
    ax.plot(
        grid,
        np.maximum(curve, floor / 10),
        color="tab:red",
        lw=2,
        label=f"bound log(p + (1 − p)·exp(2ε)), ε = {eps:.3g}",
    )
    ax.set_xscale("logit")
    ticks = [
        t for t in (1e-8, 1e-6, 1e-4, 1e-2, 0.5, 1 - 1e-2, 1 - 1e-4, 1 - 1e-6, 1 - 1e-8) if grid[0] <= t <= grid[-1]
    ]
    labels = {
        1e-8: "1e-8",
        1e-6: "1e-6",
        1e-4: "1e-4",
        1e-2: "0.01",
        0.5: "0.5",
        1 - 1e-2: "0.99",
        1 - 1e-4: "1-1e-4",
        1 - 1e-6: "1-1e-6",
        1 - 1e-8: "1-1e-8",
    }
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FixedFormatter([labels[t] for t in ticks]))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2)
    ax.set_xlabel("training probability p of the token")
    ax.set_ylabel("|Δ log p|  (nats)")
    ax.set_title(f"{mismatch_source(s)}: {s['frac_within_bound'] * 100:.1f}% within the bound")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bucket_means(result: DiagnoseResult, path: Path) -> None:
    """Draw ``bucket_means.png`` (see the module docstring) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = result.summary
    rows = s["buckets"]
    x = np.arange(len(rows))
    rule = s["rule"]
    width = 0.38 if rule else 0.6
    nan = float("nan")
    fig, ax = plt.subplots(figsize=(6.4, 5.2), dpi=110)
    vals = [nan if r["abs_diff_mean"] is None else r["abs_diff_mean"] for r in rows]
    ax.bar(x - (width / 2 if rule else 0), vals, width, color="tab:blue", label="mean |Δ log p|, full softmax")
    if rule:
        pruned = [nan if v is None else v for v in rule["bucket_abs_diff_mean_kept_pruned"]]
        ax.bar(
            x + width / 2, pruned, width, color="tab:green", label=f"mean |Δ log π_S|, tokens kept by {rule['rule']}"
        )
    ax.plot(
        x,
        [nan if r["abs_diff_max"] is None else r["abs_diff_max"] for r in rows],
        "kv",
        markersize=6,
        label="max |Δ log p|",
    )
    ax.plot(
        x,
        [nan if r["local_bound_mean"] is None else r["local_bound_mean"] for r in rows],
        "o",
        color="tab:orange",
        markersize=6,
        label="mean bound at each token's own ε_t",
    )
    ax.plot(
        x,
        [r["bound_at_lo"] for r in rows],
        "_",
        color="tab:red",
        markersize=22,
        mew=2,
        label=f"bound at the bucket's lower edge, ε = {s['eps_ref']:.3g}",
    )
    ax.set_yscale("log")
    for xi, r in zip(x, rows):
        ax.annotate(
            f"n={r['n']}",
            (xi, 0.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=7,
        )
    ax.set_xticks(x, [r["name"] for r in rows], rotation=15, fontsize=8)
    ax.set_ylabel("nats")
    ax.set_title("mismatch by training-probability bucket")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
