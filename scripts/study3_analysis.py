"""The pre-registered analysis of Study 3 (docs/results.md, "Study 3: pre-registration"): every estimand, its
intervals and the decision the plan attaches to it, from the ``results.json`` files the study commands write.

    python scripts/study3_analysis.py --trunc runs/study3/trunc/results.json --bf16 runs/study3/bf16/results.json \
        --tail runs/study3/tail-0.03/results.json runs/study3/tail-0.1/results.json \
               runs/study3/tail-0.3/results.json runs/study3/tail-1.07/results.json \
        [--json out.json] [--markdown tables.md] [--plot estimands.png] [--allow_mixed_commits] [--allow_dirty]

Conditions: ``trunc`` (rollouts sampled with ``min_p=0.05``, the stock arms scoring the full softmax; its own
no-mismatch control, since its rule's support is ``min_p=0.05``), ``bf16`` (bf16 rollouts against the fp32 trainer;
its folder holds the ``min_p=0.01`` controls ``no_mismatch`` and ``dvp_no_mismatch``) and ``tail@EPS`` (Study 2's
tail perturbation at four sizes; each pairs with the ``bf16`` folder's controls). Every estimand pairs runs by
training seed (``paired_stats``: mean, 95 % and 90 % Student's t intervals), on both scorings (the late held-out
reward on the rule's support, primary, and on the full distribution).

Per condition (where its arms ran; names of :data:`trl_integration.study.contrasts.CONTRASTS`): ``harm``
(no_remedy − no_mismatch), ``dvp_minus_tis``, ``dvp_residual_clean`` (dvp − no_mismatch), ``dvp_residual_harm``
(dvp − dvp_no_mismatch), ``dvp_interaction``, ``dvp_cost``, ``tis_gain``, ``dvp_gain``, ``tis_residual_harm``,
``dvp_tis_minus_dvp``, ``dvp_tis_residual_clean``. The dose-response: per training seed, the least-squares slope of
``harm`` (and of ``dvp_interaction``, and of ``dvp_residual_clean``) against ``log10 k3`` of the four tail sizes
(:data:`DOSE_K3`, measured before the plan), then ``paired_stats`` over seeds: the change per decade of k3.

Mechanism (descriptive, :func:`mechanism`): each arm's logged ``mismatch/k3_kl`` and ``mismatch/log_ppl_diff``, the
mean over its steps, then over its seeds.

The primary family (rule's support; Bonferroni over these five, 99 % intervals): ``harm`` in trunc and bf16,
``dvp_minus_tis`` in trunc and bf16, and the slope of ``harm``. Decisions: :func:`decide_harm`,
:func:`decide_versus`, :func:`decide_clean`, :func:`decide_removal`, :func:`decide_slope`; each is also taken for
every evaluation seed alone (robust when all agree).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # study2_analysis: the shared interval helpers

from study2_analysis import CONTROLS, above, below, bonferroni, with_controls, within

from trl_integration.study.aggregate import paired_stats
from trl_integration.study.contrasts import contrasts
from trl_integration.study.provenance import add_code_version_flags, check_code_versions

#: The margin of every equivalence statement (late held-out reward), Study 2's.
MARGIN = 0.005
#: k3 KL(mu || pi) on sampled tokens of each tail size, measured on the untrained testbed before the plan
#: (``safevocab diagnose --task freetext --max_new_tokens 32 --num_samples 8 --rule min_p=0.01 --noise EPS
#: --noise_kind tail``; 1.07 from docs/testbed.md).
DOSE_K3 = {0.03: 7.39e-5, 0.1: 8.33e-4, 0.3: 8.05e-3, 1.07: 0.122}
#: The scorings: the primary (the rule's support) first; the keys of `contrasts`.
SCORINGS = {"rule": "late_metric_rule", "full": "late_metric"}
TITLES = {"rule": "on the rule's support (primary)", "full": "on the full distribution"}
#: The per-condition estimands (contrast names), in table order.
ESTIMANDS = (
    "harm",
    "dvp_minus_tis",
    "dvp_residual_clean",
    "dvp_residual_harm",
    "dvp_interaction",
    "dvp_cost",
    "tis_gain",
    "dvp_gain",
    "tis_residual_harm",
    "dvp_tis_minus_dvp",
    "dvp_tis_residual_clean",
)
#: The slopes of the dose-response (contrast names).
SLOPES = ("harm", "dvp_interaction", "dvp_residual_clean")
#: The logged mismatch each arm trained under (descriptive; name: the trainer's metric), per run the mean over its
#: logged steps, then the mean over its finished seeds.
MECHANISM = {"k3_kl": "mismatch/k3_kl", "log_ppl_diff": "mismatch/log_ppl_diff"}
#: The primary family: (condition or "dose", estimand).
PRIMARY = (("trunc", "harm"), ("bf16", "harm"), ("trunc", "dvp_minus_tis"), ("bf16", "dvp_minus_tis"), ("dose", "harm"))


def tail_label(eps: float) -> str:
    return f"tail@{eps:g}"


def conditions(trunc: dict | None, bf16: dict | None, tails: list[dict]) -> dict[str, dict]:
    """``{condition: results}``, each tail study with the bf16 folder's controls appended (refused without them)."""
    out: dict[str, dict] = {}
    if trunc is not None:
        out["trunc"] = trunc
    if bf16 is not None:
        out["bf16"] = bf16
    for study in tails:
        eps = float(study["settings"]["noise"])
        if study["settings"].get("noise_kind") != "tail" or eps not in DOSE_K3:
            raise ValueError(
                f"--tail: a study with --noise {eps:g} --noise_kind {study['settings'].get('noise_kind')}"
                f" is not one of the registered sizes: accepted --noise_kind tail with --noise in "
                f"{sorted(DOSE_K3)}"
            )
        if bf16 is None or not all(arm in bf16["arms"] for arm in CONTROLS):
            raise ValueError("--tail needs --bf16 with the controls no_mismatch and dvp_no_mismatch")
        out[tail_label(eps)] = with_controls(study, bf16)
    return out


def estimands(studies: dict[str, dict], key: str) -> dict[str, dict[str, dict]]:
    """``{condition: {estimand: paired_stats (with "by_eval_seed")}}`` of one scoring ``key``."""
    out: dict[str, dict[str, dict]] = {}
    for condition, results in studies.items():
        found = contrasts(results)
        out[condition] = {
            name: {**found[name][key], "by_eval_seed": found[name].get(f"{key}_by_eval_seed") or []}
            for name in ESTIMANDS
            if name in found
        }
    return out


def mechanism(studies: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """``{condition: {arm: {"k3_kl", "log_ppl_diff", "n"}}}``: the mismatch each arm's trainer logged (k3 KL(mu || pi)
    on sampled tokens, and ``log mu - log pi`` of the sequences: the log of the kept mass for a stock arm under the
    truncated sampler), per run the mean over its steps, then over the finished seeds (``None`` where not logged)."""
    out: dict[str, dict[str, dict]] = {}
    for condition, results in studies.items():
        per_arm: dict[str, dict] = {}
        for arm in results["arms"]:
            runs = [r for r in results["runs"] if r["arm"] == arm and r["status"] == "ok"]
            entry: dict = {"n": len(runs)}
            for name, metric in MECHANISM.items():
                means = []
                for run in runs:
                    logged = [v for v in (run.get("series") or {}).get(metric) or [] if v is not None]
                    if logged:
                        means.append(sum(logged) / len(logged))
                entry[name] = sum(means) / len(means) if means else None
            per_arm[arm] = entry
        out[condition] = per_arm
    return out


def ols_slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` on ``xs``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _slope_stats(per_dose: dict[float, dict]) -> dict:
    """``paired_stats`` over training seeds of the per-seed slope against ``log10 k3`` (seeds present at every
    dose)."""
    doses = sorted(per_dose)
    by_dose = {d: dict(zip(per_dose[d]["seeds"] or [], per_dose[d]["diffs"])) for d in doses}
    seeds = sorted(set.intersection(*(set(v) for v in by_dose.values()))) if by_dose else []
    xs = [math.log10(DOSE_K3[d]) for d in doses]
    slopes = [ols_slope(xs, [by_dose[d][s] for d in doses]) for s in seeds]
    return paired_stats(slopes, seeds)


def dose_slopes(found: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """The dose-response slopes (per decade of k3) of `SLOPES`, with each evaluation seed's (``by_eval_seed``);
    empty without at least two tail sizes."""
    tails = {eps: found[tail_label(eps)] for eps in DOSE_K3 if tail_label(eps) in found}
    out: dict[str, dict] = {}
    if len(tails) < 2:
        return out
    for name in SLOPES:
        if not all(name in e for e in tails.values()):
            continue
        stats = _slope_stats({eps: e[name] for eps, e in tails.items()})
        n_eval = min(len(e[name]["by_eval_seed"]) for e in tails.values())
        stats["by_eval_seed"] = [
            _slope_stats({eps: e[name]["by_eval_seed"][j] for eps, e in tails.items()}) for j in range(n_eval)
        ]
        stats["doses"] = sorted(tails)
        out[name] = stats
    return out


def _three_way(
    stats: dict, ci: list[float] | None, negative: str, positive: str, equivalent: str, undecided: str
) -> str:
    """``negative``/``positive`` when the interval ``ci`` (default the 95 %) lies below/above 0 (", within the margin"
    added when the 90 % interval also lies inside it), else ``equivalent`` when the 90 % interval lies inside
    (−margin, margin), else ``undecided``."""
    ci = stats["ci95"] if ci is None else ci
    inside = within(stats["ci90"], MARGIN)
    if below(ci) or above(ci):
        return (negative if below(ci) else positive) + (", within the margin" if inside else "")
    return equivalent if inside else undecided


def decide_harm(stats: dict, ci: list[float] | None = None) -> str:
    return _three_way(
        stats, ci, "harm detected", "gain detected", "no harm (equivalent to 0)", "no harm detected (not shown absent)"
    )


def decide_versus(stats: dict, ci: list[float] | None = None) -> str:
    return _three_way(stats, ci, "TIS above DVP", "DVP above TIS", "DVP and TIS equivalent", "not distinguished")


def decide_clean(stats: dict, ci: list[float] | None = None) -> str:
    return _three_way(
        stats,
        ci,
        "below the clean control",
        "above the clean control",
        "reaches the clean control (equivalent)",
        "undecided",
    )


def decide_removal(residual: dict, interaction: dict) -> str:
    """Study 2's rule: removes ⇔ interaction's 95 % interval > 0 and the residual (against DVP without mismatch)
    equivalent to 0 within the margin."""
    if not above(interaction["ci95"]):
        return "DVP does not reduce the harm"
    return "DVP removes the harm" if within(residual["ci90"], MARGIN) else "DVP reduces the harm but does not remove it"


def decide_slope(stats: dict, ci: list[float] | None = None, sign: int = -1) -> str:
    ci = stats["ci95"] if ci is None else ci
    if (below if sign < 0 else above)(ci):
        return "dose-response detected"
    return "no dose-response detected"


#: estimand -> its decision function (estimands without one are descriptive).
DECISIONS = {
    "harm": decide_harm,
    "dvp_minus_tis": decide_versus,
    "dvp_residual_clean": decide_clean,
    "dvp_tis_residual_clean": decide_clean,
    "tis_residual_harm": decide_clean,
}


def decisions(found: dict[str, dict[str, dict]], slopes: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """``{condition: {estimand: {"decision", "bonferroni" (primary only), "by_eval_seed", "robust"}}}``; the
    dose-response under condition ``"dose"``."""
    primary = set(PRIMARY)
    out: dict[str, dict[str, dict]] = {}

    def entry(condition: str, name: str, stats: dict, decide) -> dict:
        by_seed = [decide(s) for s in stats["by_eval_seed"]]
        value = decide(stats)
        e = {"decision": value, "by_eval_seed": by_seed, "robust": bool(by_seed) and all(v == value for v in by_seed)}
        if (condition, name) in primary:
            e["bonferroni"] = decide(stats, bonferroni(stats))
        return e

    for condition, found_c in found.items():
        out[condition] = {
            name: entry(condition, name, found_c[name], decide) for name, decide in DECISIONS.items() if name in found_c
        }
        if "dvp_residual_harm" in found_c and "dvp_interaction" in found_c:
            r, i = found_c["dvp_residual_harm"], found_c["dvp_interaction"]
            by_seed = [decide_removal(a, b) for a, b in zip(r["by_eval_seed"], i["by_eval_seed"])]
            value = decide_removal(r, i)
            out[condition]["dvp_removal"] = {
                "decision": value,
                "by_eval_seed": by_seed,
                "robust": bool(by_seed) and all(v == value for v in by_seed),
            }
    if slopes:
        out["dose"] = {}
        for name, sign in (("harm", -1), ("dvp_interaction", 1), ("dvp_residual_clean", -1)):
            if name in slopes:
                out["dose"][name] = entry("dose", name, slopes[name], lambda s, ci=None, g=sign: decide_slope(s, ci, g))
    return out


def _interval(ci: list[float] | None) -> str:
    return "–" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def markdown(report: dict) -> str:
    """The outcome's tables: per scoring, every estimand per condition (mean, 95 %, 90 %, n) with its decision,
    the dose-response slopes, and the primary family with its Bonferroni decisions; then the mechanism table."""
    out: list[str] = []
    for scoring, title in TITLES.items():
        part = report[scoring]
        out += [
            f"**Late held-out reward {title}**: paired differences over training seeds.",
            "",
            "| condition | estimand | mean | 95 % | 90 % | n | decision | robust |",
            "|---|---|---:|---|---|---:|---|---|",
        ]
        for condition, found_c in part["estimands"].items():
            for name, stats in found_c.items():
                d = part["decisions"].get(condition, {}).get(name)
                mean = "n/a" if stats["mean"] is None else f"{stats['mean']:+.4f}"
                out.append(
                    f"| {condition} | {name} | {mean} | {_interval(stats['ci95'])} | "
                    f"{_interval(stats['ci90'])} | {stats['n']} | {d['decision'] if d else '–'} | "
                    f"{('yes' if d['robust'] else 'no') if d else '–'} |"
                )
            removal = part["decisions"].get(condition, {}).get("dvp_removal")
            if removal:
                out.append(
                    f"| {condition} | DVP removal (Study 2's rule) | | | | | {removal['decision']} | "
                    f"{'yes' if removal['robust'] else 'no'} |"
                )
        for name, stats in part["slopes"].items():
            d = part["decisions"]["dose"][name]
            out.append(
                f"| dose | slope of {name} per decade of k3 | {stats['mean']:+.4f} | "
                f"{_interval(stats['ci95'])} | {_interval(stats['ci90'])} | {stats['n']} | {d['decision']} | "
                f"{'yes' if d['robust'] else 'no'} |"
            )
        out += [
            "",
            "Primary family (Bonferroni over five, 99 % intervals):",
            "",
            "| condition | estimand | 99 % | decision (95 %) | decision (Bonferroni) |",
            "|---|---|---|---|---|",
        ]
        for condition, name in PRIMARY:
            stats = part["slopes"].get(name) if condition == "dose" else part["estimands"].get(condition, {}).get(name)
            d = part["decisions"].get(condition, {}).get(name)
            if stats is None or d is None:
                out.append(f"| {condition} | {name} | – | not run | not run |")
                continue
            out.append(
                f"| {condition} | {name} | {_interval(bonferroni(stats))} | {d['decision']} | {d['bonferroni']} |"
            )
        out.append("")
    out += [
        "**Mechanism** (descriptive): the mismatch each arm's trainer logged, mean over steps, then over seeds.",
        "",
        "| condition | arm | k3 KL(μ ‖ π) | log μ − log π | n |",
        "|---|---|---:|---:|---:|",
    ]
    for condition, per_arm in report.get("mechanism", {}).items():
        for arm, entry in per_arm.items():
            k3, gap = (("–" if entry[k] is None else f"{entry[k]:.3g}") for k in MECHANISM)
            out.append(f"| {condition} | {arm} | {k3} | {gap} | {entry['n']} |")
    out.append("")
    return "\n".join(out) + "\n"


def plot(report: dict, path: Path) -> None:
    """A forest plot, one panel per scoring: every condition's harm, DVP − TIS and DVP against the clean control
    (mean, 95 % interval), the margin as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        (c, n)
        for c in report["rule"]["estimands"]
        for n in ("harm", "dvp_minus_tis", "dvp_residual_clean")
        if n in report["rule"]["estimands"][c]
    ]
    fig, axes = plt.subplots(1, len(SCORINGS), figsize=(5.6 * len(SCORINGS), 0.32 * len(rows) + 1.6), sharey=True)
    for ax, (scoring, title) in zip(axes, TITLES.items()):
        found = report[scoring]["estimands"]
        for y, (condition, name) in enumerate(reversed(rows)):
            stats = found.get(condition, {}).get(name)
            if stats is None or stats["mean"] is None:
                continue
            if stats["ci95"] is not None:
                ax.plot(stats["ci95"], [y, y], color=f"C{ESTIMANDS.index(name) % 10}", lw=3, solid_capstyle="butt")
            ax.plot([stats["mean"]], [y], "o", color="k", ms=3)
        ax.axvspan(-report["margin"], report["margin"], color="C2", alpha=0.12, lw=0)
        ax.axvline(0.0, color="k", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("paired difference of late held-out reward")
    axes[0].set_yticks(range(len(rows)), [f"{c}: {n}" for c, n in reversed(rows)], fontsize=7)
    fig.suptitle("Study 3: estimands (mean and 95 % interval; green: the margin)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def analyse(trunc: dict | None, bf16: dict | None, tails: list[dict]) -> dict:
    """Every estimand, slope and decision of both scorings."""
    studies = conditions(trunc, bf16, tails)
    report: dict = {"margin": MARGIN, "dose_k3": {f"{k:g}": v for k, v in DOSE_K3.items()}}
    report["mechanism"] = mechanism(studies)
    for scoring, key in SCORINGS.items():
        found = estimands(studies, key)
        slopes = dose_slopes(found)
        report[scoring] = {"estimands": found, "slopes": slopes, "decisions": decisions(found, slopes)}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trunc", type=Path, help="the trunc study's results.json")
    parser.add_argument("--bf16", type=Path, help="the bf16 study's results.json (with the min_p=0.01 controls)")
    parser.add_argument("--tail", type=Path, nargs="+", default=[], help="the tail studies' results.json, any order")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--markdown", type=Path, help="write the outcome's tables here (Markdown)")
    parser.add_argument("--plot", type=Path, help="draw the forest plot here (PNG; needs matplotlib)")
    add_code_version_flags(parser)
    args = parser.parse_args(argv)
    if args.trunc is None and args.bf16 is None and not args.tail:
        parser.error("give at least one of --trunc, --bf16, --tail")
    trunc = json.loads(args.trunc.read_text()) if args.trunc else None
    bf16 = json.loads(args.bf16.read_text()) if args.bf16 else None
    tails = [json.loads(p.read_text()) for p in args.tail]
    studies = [(name, s) for name, s in (("trunc", trunc), ("bf16", bf16)) if s is not None]
    studies += [(str(p), s) for p, s in zip(args.tail, tails)]
    try:
        code = check_code_versions(studies, allow_mixed_commits=args.allow_mixed_commits, allow_dirty=args.allow_dirty)
        report = analyse(trunc, bf16, tails)
    except ValueError as err:
        print(f"study3_analysis: {err}", file=sys.stderr)
        return 2
    report["code"] = code
    text = markdown(report)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    if args.markdown is not None:
        args.markdown.write_text(text)
    if args.plot is not None:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
