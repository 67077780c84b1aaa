"""The pre-registered analysis of Study 2 (docs/results.md, "Study 2: pre-registration"): every estimand, its
intervals and the decision the plan attaches to it, from the two ``results.json`` files the study commands write.

    python scripts/study2_analysis.py runs/study2/tail/results.json runs/study2/lift2/results.json \
        [--check runs/study2/lift2-check/results.json] [--json out.json] [--plot estimands.png] [--markdown tables.md]
        [--allow_mixed_commits] [--allow_dirty]

Before any figure, the runs' code versions are checked (:func:`trl_integration.study.provenance.check_code_versions`):
records from more than one commit, or from a tree with uncommitted changes, are refused (exit 2, one line) unless
``--allow_mixed_commits`` / ``--allow_dirty``; records written before the commit was recorded count as one version,
"not recorded" (Study 2's own records).

Conditions: ``none`` (the controls ``no_mismatch`` = no remedy and ``dvp_no_mismatch`` = DVP, trained once, in the
tail study's folder), ``tail`` and ``lift2``. Every estimand pairs runs by training seed; with ``d_s`` the paired
difference at seed ``s`` (n seeds), the interval is ``mean(d) ± t_{q, n-1} · sd(d) / √n`` (Student's t):

- E1 harm: ``nr(tail) − nr(none)``;
- E2 residual harm: ``dvp(tail) − dvp(none)``;
- E3 interaction: ``E2 − E1`` (the part of the harm DVP removes);
- E4 cost: ``dvp(none) − nr(none)``;
- E5 specificity: ``E3(tail) − E3(lift2)``, the interaction's difference between the conditions, paired by seed.

Decisions (primary scoring: the late held-out reward on the rule's support; the same computed for the full
distribution as the key secondary): premise ⇔ E1's 95 % interval < 0; "removes" ⇔ E3's 95 % interval > 0 and E2's
90 % interval ⊂ (−δ, δ) (two one-sided 5 % tests); "reduces, does not remove" ⇔ E3 > 0 but E2 not equivalent;
"does not reduce" ⇔ E3's 95 % interval not > 0; specificity ⇔ E5's 95 % interval > 0. Each decision is repeated for
each evaluation seed alone (robust when every seed gives the same one) and with a Bonferroni correction over the five
primary estimands (99 % intervals, t_{0.995, 4} = 4.604 for five seeds).

The cost against the bound: for each seed, the late-step mean of ``dvp_no_mismatch``'s logged sequence TV
(``safevocab/seq_tv_estimate``) gives ``safevocab.bounds.objective_bias_bound(TV, 0, 1)`` (the free-text reward
lies in [0, 1]), beside that seed's E4 and the same policy's full-minus-rule held-out reward at the late evaluations
(the quantity the bound covers exactly: one policy, pruned against unpruned).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from safevocab.bounds import objective_bias_bound
from trl_integration.study.aggregate import metric_name, paired_stats
from trl_integration.study.contrasts import contrasts
from trl_integration.study.provenance import add_code_version_flags, check_code_versions

#: The equivalence margin of E2 (late held-out reward), fixed in the pre-registration.
MARGIN = 0.005
#: The controls of condition `none`, trained in the tail study's folder.
CONTROLS = ("no_mismatch", "dvp_no_mismatch")
#: Two-sided 99 % t quantiles (Bonferroni over five tests at 5 %: 1 − 0.05/5 = 0.99) for 1..10 degrees of freedom.
T995 = (63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169)
#: The scorings: the primary (the rule's support) first.
SCORINGS = {"rule": "late_metric_rule", "full": "late_metric"}
#: Each scoring's title in the tables and the plot.
TITLES = {"rule": "on the rule's support (primary)", "full": "on the full distribution"}


def with_controls(study: dict, controls_from: dict) -> dict:
    """``study`` with the control arms and runs of ``controls_from`` (the tail study's) appended."""
    runs = [r for r in study["runs"] if r["arm"] not in CONTROLS]
    runs += [r for r in controls_from["runs"] if r["arm"] in CONTROLS]
    arms = {a: v for a, v in study["arms"].items() if a not in CONTROLS}
    arms.update({a: controls_from["arms"][a] for a in CONTROLS})
    return {**study, "arms": arms, "runs": runs}


def bonferroni(stats: dict) -> list[float] | None:
    """The 99 % t-interval of ``paired_stats`` output (``None`` below two values)."""
    n, std, mean = stats["n"], stats["std"], stats["mean"]
    if std is None or n < 2:
        return None
    half = T995[min(n - 1, len(T995)) - 1] * std / math.sqrt(n)
    return [mean - half, mean + half]


def below(ci: list[float] | None) -> bool:
    return ci is not None and ci[1] < 0


def above(ci: list[float] | None) -> bool:
    return ci is not None and ci[0] > 0


def within(ci: list[float] | None, margin: float) -> bool:
    return ci is not None and -margin < ci[0] and ci[1] < margin


def difference_by_seed(a: dict, b: dict) -> dict:
    """``paired_stats`` of ``a − b``, two paired-difference records, over the seeds both have."""
    b_by_seed = dict(zip(b["seeds"], b["diffs"]))
    pairs = [(s, d - b_by_seed[s]) for s, d in zip(a["seeds"], a["diffs"]) if s in b_by_seed]
    return paired_stats([d for _, d in pairs], [s for s, _ in pairs])


def estimands(tail: dict, lift: dict, key: str) -> dict[str, dict]:
    """E1–E5 and the secondary contrasts of one outcome ``key`` (a ``late_metric*`` key of ``contrasts``)."""
    found = {"tail": contrasts(tail), "lift2": contrasts(lift)}
    out = {
        "E1_harm": found["tail"]["harm"][key],
        "E2_residual_harm": found["tail"]["dvp_residual_harm"][key],
        "E3_interaction": found["tail"]["dvp_interaction"][key],
        "E4_cost": found["tail"]["dvp_cost"][key],
        "E5_specificity": difference_by_seed(
            found["tail"]["dvp_interaction"][key], found["lift2"]["dvp_interaction"][key]
        ),
    }
    for condition in ("tail", "lift2"):
        for name in ("harm", "dvp_residual_harm", "dvp_interaction", "dvp_gain", "tis_gain", "tis_residual_harm"):
            if name in found[condition] and not (
                condition == "tail" and name in ("harm", "dvp_residual_harm", "dvp_interaction")
            ):
                out[f"{condition}:{name}"] = found[condition][name][key]
    return out


def per_eval_seed(tail: dict, lift: dict, key: str) -> list[dict[str, dict]]:
    """E1–E5 for each evaluation seed alone."""
    found = {"tail": contrasts(tail), "lift2": contrasts(lift)}
    seeds = found["tail"]["harm"].get(f"{key}_by_eval_seed") or []
    out = []
    for j in range(len(seeds)):

        def at(condition: str, name: str, j: int = j) -> dict:
            return found[condition][name][f"{key}_by_eval_seed"][j]

        out.append(
            {
                "E1_harm": at("tail", "harm"),
                "E2_residual_harm": at("tail", "dvp_residual_harm"),
                "E3_interaction": at("tail", "dvp_interaction"),
                "E4_cost": at("tail", "dvp_cost"),
                "E5_specificity": difference_by_seed(at("tail", "dvp_interaction"), at("lift2", "dvp_interaction")),
            }
        )
    return out


def decide(e: dict[str, dict], margin: float = MARGIN, interval: str = "ci95") -> dict[str, str]:
    """The plan's decisions from E1–E5 (``interval``: ``"ci95"``, or ``"bonferroni"`` for the 99 % intervals; the
    equivalence test always uses the 90 % interval, two one-sided tests at 5 %)."""

    def ci(name: str) -> list[float] | None:
        stats = e[name]
        return bonferroni(stats) if interval == "bonferroni" else stats["ci95"]

    premise = "harm detected" if below(ci("E1_harm")) else "no harm detected (against the premise at this scale)"
    if not above(ci("E3_interaction")):
        dvp = "DVP does not reduce the tail's harm"
    elif within(e["E2_residual_harm"]["ci90"], margin):
        dvp = "DVP removes the tail's harm"
    else:
        dvp = "DVP reduces the tail's harm but does not remove it"
    cost = (
        "cost detected negative"
        if below(ci("E4_cost"))
        else "cost detected positive"
        if above(ci("E4_cost"))
        else "no cost detected"
    )
    specificity = "specific to the tail" if above(ci("E5_specificity")) else "specificity not shown"
    return {"premise": premise, "dvp": dvp, "cost": cost, "specificity": specificity}


def cost_against_bound(tail: dict, key: str) -> list[dict]:
    """Per ``dvp_no_mismatch`` seed: late sequence TV, its bound, E4 at that seed, and the same policy's full − rule
    held-out reward at the late evaluations."""
    cost = contrasts(tail)["dvp_cost"][key]
    cost_by_seed = dict(zip(cost["seeds"], cost["diffs"]))
    half = tail["settings"]["steps"] / 2
    metric = metric_name(tail)
    rows = []
    for run in tail["runs"]:
        if run["arm"] != "dvp_no_mismatch" or run["status"] != "ok":
            continue
        series = run["series"]
        late = [i for i, step in enumerate(series["step"]) if step > half]
        tv = statistics.mean(series["safevocab/seq_tv_estimate"][i] for i in late)
        mass = statistics.mean(series["safevocab/pruned_mass_mean"][i] for i in late)
        ev = run["eval"]
        same_policy = [f - q for step, f, q in zip(ev["step"], ev[metric], ev[f"{metric}_rule"]) if step > half]
        rows.append(
            {
                "seed": run["seed"],
                "pruned_mass": mass,
                "seq_tv": tv,
                "bound": objective_bias_bound(tv, 0.0, 1.0),
                "cost": cost_by_seed.get(run["seed"]),
                "same_policy_full_minus_rule": statistics.mean(same_policy),
            }
        )
    return rows


def determinism(tail: dict, check: dict) -> list[str]:
    """The controls of ``check`` against the tail study's, seed by seed: everything but the wall-clock step time."""

    def controls(results: dict) -> dict:
        return {(r["arm"], r["seed"]): r for r in results["runs"] if r["arm"] in CONTROLS and r["status"] == "ok"}

    mine, theirs = controls(check), controls(tail)
    lines = []
    for key, run in sorted(mine.items()):
        other = theirs.get(key)
        keys = (set(run["series"]) | set((other or {}).get("series", {}))) - {"step_time"}
        same = (
            other is not None
            and run["eval"] == other["eval"]
            and all(run["series"].get(k) == other["series"].get(k) for k in keys)
        )
        lines.append(f"{key[0]} seed {key[1]}: {'identical' if same else 'DIFFERENT'}")
    return lines


def fmt(stats: dict, bonf: bool = False) -> str:
    if stats["mean"] is None:
        return "n/a"
    parts = [f"{stats['mean']:+.4f}"]
    for name in ("ci95", "ci90"):
        if stats[name] is not None:
            lo, hi = stats[name]
            parts.append(f"{name[2:]} % [{lo:+.4f}, {hi:+.4f}]")
    if bonf and (b := bonferroni(stats)) is not None:
        parts.append(f"99 % [{b[0]:+.4f}, {b[1]:+.4f}]")
    return ", ".join(parts) + f" (n={stats['n']})"


PRIMARY = ("E1_harm", "E2_residual_harm", "E3_interaction", "E4_cost", "E5_specificity")


def plot(report: dict, path: Path) -> None:
    """A forest plot of E1–E5, one panel per scoring: each estimand's mean with its 95 % interval (thick), the
    Bonferroni 99 % interval (thin), each evaluation seed's mean alone (dots), and E2's equivalence margin (band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCORINGS), figsize=(5.2 * len(SCORINGS), 3.6), sharey=True)
    for ax, (scoring, title) in zip(axes, TITLES.items()):
        found = report[scoring]["estimands"]
        for y, name in enumerate(reversed(PRIMARY)):
            stats = found[name]
            if stats["mean"] is None:
                continue
            if (wide := bonferroni(stats)) is not None:
                ax.plot(wide, [y, y], color="0.6", lw=1)
            if stats["ci95"] is not None:
                ax.plot(stats["ci95"], [y, y], color="C0", lw=3.5, solid_capstyle="butt")
            ax.plot([stats["mean"]], [y], "o", color="C0")
            by_seed = [seed[name]["mean"] for seed in report[scoring]["by_eval_seed"] if seed[name]["mean"] is not None]
            ax.plot(by_seed, [y - 0.22] * len(by_seed), ".", color="C3", ms=4)
        e2 = len(PRIMARY) - 1 - PRIMARY.index("E2_residual_harm")
        ax.fill_betweenx([e2 - 0.4, e2 + 0.4], -report["margin"], report["margin"], color="C2", alpha=0.2, lw=0)
        ax.axvline(0.0, color="k", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("paired difference of late held-out reward")
    axes[0].set_yticks(range(len(PRIMARY)), [n.replace("_", " ", 1).replace("_", " ") for n in reversed(PRIMARY)])
    fig.suptitle(
        "Study 2: estimands (mean, 95 % and Bonferroni 99 % intervals; red: each evaluation seed; green: E2's margin)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _interval(ci: list[float] | None) -> str:
    return "–" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def _cell(stats: dict) -> str:
    return "n/a" if stats["mean"] is None else f"{stats['mean']:+.4f} {_interval(stats['ci95'])}"


def markdown(report: dict) -> str:
    """The outcome's tables: E1–E5 per scoring (mean, 95 %, 90 % and Bonferroni 99 % intervals, n), the decisions
    (all seeds, Bonferroni, each evaluation seed), the secondary contrasts, the cost against the bound, determinism."""
    out: list[str] = []
    for scoring, title in TITLES.items():
        part = report[scoring]
        out += [
            f"**Late held-out reward {title}**: paired differences over training seeds (mean, intervals).",
            "",
            "| estimand | mean | 95 % | 90 % | 99 % (Bonferroni) | n |",
            "|---|---:|---|---|---|---:|",
        ]
        for name in PRIMARY:
            stats = part["estimands"][name]
            mean = "n/a" if stats["mean"] is None else f"{stats['mean']:+.4f}"
            out.append(
                f"| {name} | {mean} | {_interval(stats['ci95'])} | {_interval(stats['ci90'])} | "
                f"{_interval(bonferroni(stats))} | {stats['n']} |"
            )
        out += [
            "",
            "| decision | 95 % | Bonferroni | "
            + " | ".join(f"eval seed #{j}" for j in range(len(part["decisions_by_eval_seed"])))
            + " | robust |",
            "|---|---|---|" + "---|" * len(part["decisions_by_eval_seed"]) + "---|",
        ]
        for key, value in part["decisions"].items():
            by_seed = [d[key] for d in part["decisions_by_eval_seed"]]
            robust = "yes" if by_seed and all(v == value for v in by_seed) else "no"
            out.append(
                f"| {key} | {value} | {part['decisions_bonferroni'][key]} | " + " | ".join(by_seed) + f" | {robust} |"
            )
        out += [
            "",
            "Each evaluation seed alone (mean and 95 % interval):",
            "",
            "| estimand | " + " | ".join(f"eval seed #{j}" for j in range(len(part["by_eval_seed"]))) + " |",
            "|---|" + "---|" * len(part["by_eval_seed"]),
        ]
        for name in PRIMARY:
            out.append(f"| {name} | " + " | ".join(_cell(seed[name]) for seed in part["by_eval_seed"]) + " |")
        out.append(
            "| E2_residual_harm, 90 % (equivalence) | "
            + " | ".join(_interval(seed["E2_residual_harm"]["ci90"]) for seed in part["by_eval_seed"])
            + " |"
        )
        secondary = [name for name in part["estimands"] if name not in PRIMARY]
        out += [
            "",
            "Secondary contrasts (descriptive; mean and 95 % interval):",
            "",
            "| contrast | mean [95 %] | n |",
            "|---|---|---:|",
        ]
        out += [f"| {name} | {_cell(part['estimands'][name])} | {part['estimands'][name]['n']} |" for name in secondary]
        out.append("")
    out += [
        "**DVP's cost against the bound** (`dvp_no_mismatch`, steps after 150; cost: that seed's E4 on each "
        "scoring; same policy: its full − rule late held-out reward):",
        "",
        "| seed | pruned mass | sequence TV | bound TV·(r_max − r_min) | E4 cost (rule) | E4 cost (full) "
        "| same policy full − rule |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    full_cost = {row["seed"]: row["cost"] for row in report["cost_against_bound"]["full"]}
    for row in report["cost_against_bound"]["rule"]:
        costs = ["n/a" if c is None else f"{c:+.4f}" for c in (row["cost"], full_cost.get(row["seed"]))]
        out.append(
            f"| {row['seed']} | {row['pruned_mass']:.4f} | {row['seq_tv']:.4f} | {row['bound']:.4f} | "
            f"{costs[0]} | {costs[1]} | {row['same_policy_full_minus_rule']:+.4f} |"
        )
    if "determinism" in report:
        out += [
            "",
            "**Determinism check** (seed 1's controls trained again with the `lift2` flags): "
            + "; ".join(report["determinism"])
            + ".",
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tail", type=Path, help="the tail study's results.json (with the none controls)")
    parser.add_argument("lift2", type=Path, help="the lift2 study's results.json")
    parser.add_argument("--check", type=Path, help="the determinism check's results.json")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--plot", type=Path, help="draw the estimands' forest plot here (PNG; needs matplotlib)")
    parser.add_argument("--markdown", type=Path, help="write the outcome's tables here (Markdown)")
    add_code_version_flags(parser)
    args = parser.parse_args(argv)
    tail = json.loads(args.tail.read_text())
    lift_alone = json.loads(args.lift2.read_text())
    check = json.loads(args.check.read_text()) if args.check is not None else None
    studies = [("tail", tail), ("lift2", lift_alone)] + ([("check", check)] if check is not None else [])
    try:
        code = check_code_versions(studies, allow_mixed_commits=args.allow_mixed_commits, allow_dirty=args.allow_dirty)
    except ValueError as err:
        print(f"study2_analysis: {err}", file=sys.stderr)
        return 2
    lift = with_controls(lift_alone, tail)
    report: dict = {"margin": MARGIN, "code": code}
    for scoring, key in SCORINGS.items():
        found = estimands(tail, lift, key)
        seeds = per_eval_seed(tail, lift, key)
        report[scoring] = {
            "estimands": found,
            "decisions": decide(found),
            "decisions_bonferroni": decide(found, interval="bonferroni"),
            "decisions_by_eval_seed": [decide(e) for e in seeds],
            "by_eval_seed": seeds,
        }
        title = "PRIMARY: the rule's support" if scoring == "rule" else "key secondary: the full distribution"
        print(f"\n## late held-out reward, {title}")
        for name, stats in found.items():
            print(f"{name:28} {fmt(stats, bonf=name.startswith('E'))}")
        print("decisions:", report[scoring]["decisions"])
        print("with Bonferroni:", report[scoring]["decisions_bonferroni"])
        for j, d in enumerate(report[scoring]["decisions_by_eval_seed"]):
            print(f"evaluation seed index {j}:", d)
    report["cost_against_bound"] = {s: cost_against_bound(tail, k) for s, k in SCORINGS.items()}
    print("\n## DVP's cost against the bound (rule-support cost)")
    for row in report["cost_against_bound"]["rule"]:
        print(row)
    if check is not None:
        report["determinism"] = determinism(tail, check)
        print("\n## determinism check\n" + "\n".join(report["determinism"]))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot is not None:
        plot(report, args.plot)
    if args.markdown is not None:
        args.markdown.write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
