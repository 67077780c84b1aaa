"""Outputs of the mismatch lab: ``summary.json``, the figures, and the summary table that ``safevocab diagnose``
prints on the console (the tail diagnostic first, when the summary has one; then the batch-shape control and the
precision arms, when it has them). This module prints nothing itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

from trl_integration.demo.model import TINY_MODEL_NAME, is_tiny_model
from trl_integration.lab.engine import DiagnoseResult

__all__ = ["write_outputs", "summary_rows", "summary_table"]


def write_outputs(
    result: DiagnoseResult, output_dir: str | os.PathLike, plots: bool = True, max_points: int = 20000
) -> list[Path]:
    """Write ``summary.json`` and (``plots=True``) ``tail_mismatch.png`` (when ``result.summary`` has the tail
    diagnostic, ``"tail"``), ``mismatch_vs_p.png``, ``bucket_means.png``, ``batch_shape.png`` (when it has the
    batch-shape control, ``"batch_shape"``: :func:`~trl_integration.lab.batch_shape.plot_batch_shape`) and
    ``precision_arms.png`` (when it has the precision arms, ``"precision_arms"``:
    :func:`~trl_integration.lab.precision_arms.plot_precision_arms`).

    Args:
        result: the `DiagnoseResult` to write.
        output_dir: created if needed.
        plots: also draw the PNG plots (needs matplotlib).
        max_points: the scatter plot shows a seeded random subset of at most this many tokens.

    Returns:
        The written paths (``summary.json`` first).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "summary.json"]
    tail = plots and result.summary.get("tail") is not None
    if tail:
        files.append(out / "tail_mismatch.png")
    if plots:
        files += [out / "mismatch_vs_p.png", out / "bucket_means.png"]
    control = plots and bool(result.summary.get("batch_shape"))
    if control:
        files.append(out / "batch_shape.png")
    arms = plots and bool(result.summary.get("precision_arms"))
    if arms:
        files.append(out / "precision_arms.png")
    result.summary["files"] = [f.name for f in files]
    files[0].write_text(json.dumps(result.summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    if plots:
        from trl_integration.lab.figures import plot_bucket_means, plot_mismatch_vs_p, plot_tail_mismatch

        if tail:
            plot_tail_mismatch(result.summary, out / "tail_mismatch.png")
        plot_mismatch_vs_p(result, out / "mismatch_vs_p.png", max_points)
        plot_bucket_means(result, out / "bucket_means.png")
    if control:
        from trl_integration.lab.batch_shape import plot_batch_shape

        plot_batch_shape(result.summary, out / "batch_shape.png")
    if arms:
        from trl_integration.lab.precision_arms import plot_precision_arms

        plot_precision_arms(result.summary, out / "precision_arms.png")
    return files


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _pct2(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2f}%"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _tail_lines(summary: dict) -> list[tuple[str, str]]:
    """The tail diagnostic's rows: per prompt source and bucket, the signed mean ``log mu - log pi`` ± its SE."""
    tail = summary.get("tail")
    if not tail:
        return []
    from trl_integration.lab.figures import SOURCE_LABELS, mismatch_source

    lines = [
        (
            "tail mismatch",
            f"mean log μ − log π of sampled tokens ({tail['num_samples']} × ≤ "
            f"{tail['max_new_tokens']} tokens per prompt); {mismatch_source(summary)}",
        )
    ]
    for source, data in tail["sources"].items():
        label = tail.get("labels", {}).get(source, SOURCE_LABELS.get(source, source))
        overall = "-" if data["signed_mean"] is None else f"{data['signed_mean']:+.4g}"
        lines.append(
            (f"  {source}", f"{label}: {data['n_tokens']} tokens from {data['n_prompts']} prompts, mean {overall}")
        )
        for r in data["buckets"]:
            if r["n"] == 0:
                value = "-"
            else:
                se = "" if r["signed_se"] is None else f" ± {r['signed_se']:.2g}"
                value = f"{r['signed_mean']:+.4g}{se}"
            lines.append((f"    {r['name']}", f"{value:<20} n={r['n']:<6d} ({r['frac'] * 100:.1f}% of tokens)"))
    return lines


def summary_rows(summary: dict, files: list[Path]) -> list[tuple[str, str]]:
    """The summary as ``(label, value)`` rows, the tail diagnostic first, ending with the written ``files``."""
    model = str(summary["model"])
    if is_tiny_model(model):
        model = f"{TINY_MODEL_NAME} (bundled)"
    lines = [
        ("model", model),
        *_tail_lines(summary),
        ("compare (train:rollout)", f"{summary['train_dtype']}:{summary['rollout_dtype']}"),
        ("injected noise", f"{summary['noise']:g} ({summary['noise_kind']})" if summary["noise"] else "none"),
        (
            "rollout weights",
            "as trained"
            if summary.get("rollout_mantissa_bits") is None
            else f"rounded to {summary['rollout_mantissa_bits']} mantissa bits",
        ),
        ("tokens scored", f"{summary['n_tokens']} in {summary['n_sequences']} sequences ({summary['mode']})"),
        (
            "eps_max (logit gap)",
            f"{summary['eps_max']:.4g}  (p50 {summary['eps_quantiles']['p50']:.3g}, "
            f"p99 {summary['eps_quantiles']['p99']:.3g})",
        ),
        (
            "within bound",
            f"{summary['frac_within_bound'] * 100:.2f}% at eps={summary['eps_ref']:.4g} ({summary['eps_ref_source']})",
        ),
        ("|Δ log p| mean / max", f"{summary['abs_diff_mean']:.3g} / {summary['abs_diff_max']:.3g}"),
        (
            "ratio π/μ outside",
            f"[0.9, 1.1]: {_pct2(summary.get('frac_ratio_outside_0.9_1.1'))}, "
            f"[0.8, 1.25]: {_pct2(summary.get('frac_ratio_outside_0.8_1.25'))} of the tokens",
        ),
        (
            "k3 KL / chi2 token",
            f"{summary['sequence_metrics']['k3_kl']:.3g} / {summary['sequence_metrics']['chi2_token']:.3g}",
        ),
    ]
    for r in summary["buckets"]:
        mean = "-" if r["abs_diff_mean"] is None else f"{r['abs_diff_mean']:.3g}"
        lines.append((f"  bucket {r['name']}", f"n={r['n']:<6d} mean |Δ|={mean}  bound≤{r['bound_at_lo']:.3g}"))
    rule = summary["rule"]
    if rule:
        kept = rule["abs_diff_mean_kept_pruned"]
        lines += [
            (
                f"rule {rule['rule']}",
                f"keeps {rule['kept_frac'] * 100:.1f}% of tokens, sets differ at "
                f"{rule['set_differ_frac'] * 100:.2f}% of positions",
            ),
            (
                "  mean |Δ| on kept tokens",
                f"{_fmt(rule['abs_diff_mean_kept_full'])} full softmax -> "
                f"{_fmt(kept)} renormalised π_S (all tokens: "
                f"{rule['abs_diff_mean_all']:.3g})",
            ),
            (
                "  k3 below the cut",
                f"{_pct(rule.get('k3_share_outside'))} of the k3 sum on tokens outside the "
                f"training set; {_pct(rule.get('k3_removable'))} removed by masking them and "
                "renormalising",
            ),
        ]
        inner, outer = rule.get("ratio_outside_0.9_1.1_share_outside"), rule.get("ratio_outside_0.8_1.25_share_outside")
        lines.append((
            "  ratios below the cut",
            f"{_pct(inner)} / {_pct(outer)} of the ratios outside [0.9, 1.1] / [0.8, 1.25] are tokens outside the "
            "training set" if inner is not None else "no ratio outside [0.9, 1.1]",
        ))  # fmt: skip
    from trl_integration.lab.batch_shape import batch_shape_rows

    lines += batch_shape_rows(summary)
    from trl_integration.lab.precision_arms import precision_arm_rows

    lines += precision_arm_rows(summary)
    lines.append(("wrote", ", ".join(str(f) for f in files)))
    return lines


def summary_table(summary: dict, files: list[Path]):
    """:func:`summary_rows` as a ``rich.table.Table`` titled "safevocab diagnose" (print it with rich's
    ``Console().print``), or, without rich, as aligned plain text (a ``str``)."""
    lines = summary_rows(summary, files)
    try:
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is part of the trl extra
        width = max(len(k) for k, _ in lines)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)
    table = Table(title="safevocab diagnose", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in lines:
        table.add_row(k, v)
    return table
