"""The pre-registered analysis of Study 4 (docs/results.md, "Study 4: pre-registration"): the collapse screen, the
`top_p` condition and, if the screen finds a mismatch-specific collapse, the confirmatory arm set, from the
``results.json`` files the study commands write.

    python scripts/study4_analysis.py --screen runs/study4/screen-*/results.json --top_p runs/study4/top_p/results.json \
        [--confirm runs/study4/confirm-*/results.json] [--json out.json] [--markdown tables.md] [--plot forest.png]
        [--allow_mixed_commits] [--allow_dirty]

**(a) The screen.** Every run's collapse (:func:`trl_integration.study.collapse.collapse_of_run`, the registered
criterion). A study's condition is ``trunc`` when it samples with a truncated sampler (``--sampler_rule``), else
``tail@EPS``; its learning rate is its ``--learning_rate``. For each learning rate and mismatch condition:
*mismatch-specific collapse* when both seeds of its ``no_remedy`` arm collapse and no seed of the ``no_mismatch``
arm at that learning rate does; *collapse, not mismatch-specific* when both collapse and a clean seed does too; *no
collapse* when neither seed collapses; otherwise *one seed of two*. The confirmatory configuration is the first
mismatch-specific one in the order: lower learning rate first, ``trunc`` before ``tail``.

**(b) top_p.** Paired by training seed, on both scorings (the rule's support, primary, and the full distribution), at
two times: *early*, the held-out reward at step 150, and *late*, the mean of the evaluations after step 300
(``late_metric``: 400, 500, 600). Estimands: ``harm`` (no_remedy − no_mismatch), ``dvp_minus_tis``,
``dvp_residual_clean`` (dvp − no_mismatch), ``tis_residual_harm`` (tis − no_mismatch), ``tis_gain`` and ``dvp_gain``
(each − no_remedy). Decisions as Study 3's (margin 0.005), each also per evaluation seed. The registered question:
*DVP's early lead* is ``dvp_minus_tis`` early above 0 on the rule's support; it *persists* when late is also above 0,
*TIS caught up* when late is not (equivalent or not distinguished), and there is *no early lead* otherwise.

**(c) Confirmatory** (only when run): collapse incidence of ``dvp`` against ``tis`` (two-sided Fisher exact test),
time to collapse of ``dvp`` against ``tis`` (two-sided log-rank test, censored at the last step), each also against
``no_remedy``; late held-out reward ``dvp − tis`` on both scorings over the seeds where both finished.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # study3_analysis: the decision rules

from study3_analysis import MARGIN, decide_clean, decide_harm, decide_versus

from trl_integration.study.aggregate import paired_stats
from trl_integration.study.collapse import collapse_of_run
from trl_integration.study.provenance import add_code_version_flags, check_code_versions

#: (b)'s estimands: name -> (arm, baseline arm).
PAIRS = {
    "harm": ("no_remedy", "no_mismatch"),
    "dvp_minus_tis": ("dvp", "tis"),
    "dvp_residual_clean": ("dvp", "no_mismatch"),
    "tis_residual_harm": ("tis", "no_mismatch"),
    "tis_gain": ("tis", "no_remedy"),
    "dvp_gain": ("dvp", "no_remedy"),
}
#: estimand -> decision rule (the others are descriptive).
DECISIONS = {
    "harm": decide_harm,
    "dvp_minus_tis": decide_versus,
    "dvp_residual_clean": decide_clean,
    "tis_residual_harm": decide_clean,
}
#: The scorings: name -> the held-out series' suffix.
SCORINGS = {"rule": "_rule", "full": ""}
TITLES = {"rule": "on the rule's support (primary)", "full": "on the full distribution"}
#: (b)'s early evaluation step; late: the evaluations after LATE_AFTER.
EARLY_STEP = 150
LATE_AFTER = 300
#: The screen's order of configurations for the confirmatory choice.
CONDITION_ORDER = ("trunc", "tail")


# ----------------------------------------------------------------------------------------------------------------
# (a) the screen


def condition_of(results: dict) -> str:
    s = results["settings"]
    return "trunc" if s.get("sampler_rule") else f"tail@{float(s['noise']):g}"


def _trained(results: dict, arm: str) -> list[dict]:
    return [r for r in results["runs"] if r["arm"] == arm and r["status"] in ("ok", "failed")]


def screen(studies: list[dict]) -> dict:
    """Every screen run's collapse, and the decision per (learning rate, mismatch condition)."""
    rows: list[dict] = []
    for results in studies:
        lr, condition = float(results["settings"]["learning_rate"]), condition_of(results)
        for run in results["runs"]:
            if run["status"] not in ("ok", "failed"):
                continue
            c = collapse_of_run(run)
            rows.append({"learning_rate": lr, "condition": "clean" if run["arm"] == "no_mismatch" else condition,
                         "arm": run["arm"], "seed": run["seed"], "status": run["status"], **c.to_dict()})  # fmt: skip
    decisions: list[dict] = []
    for lr in sorted({r["learning_rate"] for r in rows}):
        clean = [r for r in rows if r["learning_rate"] == lr and r["arm"] == "no_mismatch"]
        conditions = sorted(
            {r["condition"] for r in rows if r["learning_rate"] == lr and r["arm"] == "no_remedy"},
            key=lambda c: (CONDITION_ORDER.index(c.split("@")[0]), c),
        )
        for condition in conditions:
            runs = [r for r in rows if r["learning_rate"] == lr and r["condition"] == condition]
            decisions.append({"learning_rate": lr, "condition": condition,
                              "decision": decide_screen(runs, clean), "mismatch_collapsed": sum(r["collapsed"] for r in runs),
                              "mismatch_runs": len(runs), "clean_collapsed": sum(r["collapsed"] for r in clean),
                              "clean_runs": len(clean)})  # fmt: skip
    chosen = next((d for d in decisions if d["decision"] == "mismatch-specific collapse"), None)
    return {"runs": rows, "decisions": decisions, "confirmatory": chosen}


def decide_screen(mismatch_runs: list[dict], clean_runs: list[dict]) -> str:
    """The screen's decision for one configuration (the module docstring); refused without two seeds of each."""
    if len(mismatch_runs) < 2 or len(clean_runs) < 2:
        return "incomplete"
    collapsed = sum(r["collapsed"] for r in mismatch_runs)
    if collapsed == len(mismatch_runs):
        if any(r["collapsed"] for r in clean_runs):
            return "collapse, not mismatch-specific"
        return "mismatch-specific collapse"
    return "no collapse" if collapsed == 0 else "one seed of two"


# ----------------------------------------------------------------------------------------------------------------
# (b) the top_p condition


def _value_at(run: dict, suffix: str, when: str, eval_seed: int | None = None) -> float | None:
    """A run's held-out reward at step EARLY_STEP (``when="early"``) or its mean after LATE_AFTER (``"late"``);
    one evaluation seed's with ``eval_seed`` (its index)."""
    ev = run.get("eval") or {}
    steps = ev.get("step") or []
    key = f"reward{suffix}" if eval_seed is None else f"reward{suffix}_by_seed"
    values = ev.get(key) or []
    if eval_seed is not None:
        values = [v[eval_seed] if v is not None else None for v in values]
    picked = [v for s, v in zip(steps, values) if (s == EARLY_STEP if when == "early" else s > LATE_AFTER)]
    if not picked or any(v is None for v in picked):
        return None
    return sum(picked) / len(picked)


def paired(results: dict, arm: str, base: str, suffix: str, when: str, eval_seed: int | None = None) -> dict:
    """``paired_stats`` of ``arm − base`` over the training seeds where both finished."""
    by_arm = {a: {r["seed"]: r for r in results["runs"] if r["arm"] == a and r["status"] == "ok"} for a in (arm, base)}
    seeds = sorted(set(by_arm[arm]) & set(by_arm[base]))
    diffs, used = [], []
    for seed in seeds:
        a = _value_at(by_arm[arm][seed], suffix, when, eval_seed)
        b = _value_at(by_arm[base][seed], suffix, when, eval_seed)
        if a is not None and b is not None:
            diffs.append(a - b)
            used.append(seed)
    return paired_stats(diffs, used)


def top_p(results: dict) -> dict:
    """(b)'s estimands and decisions, per scoring and time, with the early-lead reading."""
    n_eval = len(results["settings"].get("eval_seeds") or [])
    out: dict = {}
    for scoring, suffix in SCORINGS.items():
        out[scoring] = {}
        for when in ("early", "late"):
            part: dict = {}
            for name, (arm, base) in PAIRS.items():
                if arm not in results["arms"] or base not in results["arms"]:
                    continue
                stats = paired(results, arm, base, suffix, when)
                stats["by_eval_seed"] = [paired(results, arm, base, suffix, when, j) for j in range(n_eval)]
                if name in DECISIONS and stats["mean"] is not None:
                    decide = DECISIONS[name]
                    stats["decision"] = decide(stats)
                    by_seed = [decide(s) for s in stats["by_eval_seed"] if s["mean"] is not None]
                    stats["decisions_by_eval_seed"] = by_seed
                    stats["robust"] = bool(by_seed) and all(d == stats["decision"] for d in by_seed)
                part[name] = stats
            out[scoring][when] = part
        out[scoring]["early_lead"] = early_lead(out[scoring])
    return out


def early_lead(scoring: dict) -> str:
    """The registered reading of DVP − TIS early against late (the module docstring)."""
    early, late = scoring["early"].get("dvp_minus_tis"), scoring["late"].get("dvp_minus_tis")
    if not early or not late or early.get("mean") is None or late.get("mean") is None:
        return "not computed"
    if early["decision"].startswith("DVP above TIS"):
        return "DVP's early lead persists" if late["decision"].startswith("DVP above TIS") else "TIS caught up"
    return "no early lead"


# ----------------------------------------------------------------------------------------------------------------
# (c) the confirmatory arm set


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p of Fisher's exact test on the table ``[[a, b], [c, d]]`` (rows: arms; columns: collapsed or not):
    the total probability of the tables with the same margins that are no more probable than this one."""
    row1, col1, n = a + b, a + c, a + b + c + d

    def prob(x: int) -> float:
        return math.comb(col1, x) * math.comb(n - col1, row1 - x) / math.comb(n, row1)

    observed = prob(a)
    lo, hi = max(0, row1 + col1 - n), min(row1, col1)
    return min(1.0, sum(p for x in range(lo, hi + 1) if (p := prob(x)) <= observed * (1 + 1e-9)))


def log_rank(times_a: list[tuple[int, bool]], times_b: list[tuple[int, bool]]) -> dict:
    """Two-sided log-rank test of two groups of ``(time, collapsed)`` (``False``: censored at that time):
    ``chi2 = (O_a - E_a)^2 / V`` on one degree of freedom."""
    events = sorted({t for t, e in times_a + times_b if e})
    observed = expected = variance = 0.0
    for t in events:
        at_risk_a = sum(1 for s, _ in times_a if s >= t)
        at_risk_b = sum(1 for s, _ in times_b if s >= t)
        d_a = sum(1 for s, e in times_a if e and s == t)
        d = d_a + sum(1 for s, e in times_b if e and s == t)
        n = at_risk_a + at_risk_b
        observed += d_a
        expected += d * at_risk_a / n
        if n > 1:
            variance += d * (at_risk_a / n) * (at_risk_b / n) * (n - d) / (n - 1)
    if variance == 0:
        return {"chi2": None, "p": None, "observed_a": observed, "expected_a": expected}
    chi2 = (observed - expected) ** 2 / variance
    return {"chi2": chi2, "p": math.erfc(math.sqrt(chi2 / 2)), "observed_a": observed, "expected_a": expected}


def _merge(studies: list[dict]) -> dict:
    """One study of several folders' runs (the confirmatory set may run in pieces)."""
    arms: dict = {}
    for s in studies:
        arms.update(s["arms"])
    return {**studies[0], "arms": arms, "runs": [r for s in studies for r in s["runs"]]}


def confirm(studies: list[dict]) -> dict:
    """(c)'s incidence, time and late-reward comparisons (the module docstring)."""
    results = _merge(studies)
    collapse = {arm: {r["seed"]: collapse_of_run(r) for r in _trained(results, arm)} for arm in results["arms"]}
    incidence = {arm: {"collapsed": sum(c.collapsed for c in by.values()), "runs": len(by)}
                 for arm, by in collapse.items()}  # fmt: skip
    tests: dict = {}
    for arm, base in (("dvp", "tis"), ("dvp", "no_remedy"), ("tis", "no_remedy")):
        if arm not in collapse or base not in collapse:
            continue
        a, b = incidence[arm], incidence[base]
        times = {x: [((c.step if c.collapsed else c.censored_at), c.collapsed) for c in collapse[x].values()]
                 for x in (arm, base)}  # fmt: skip
        tests[f"{arm}_vs_{base}"] = {
            "fisher_p": fisher_exact(a["collapsed"], a["runs"] - a["collapsed"], b["collapsed"], b["runs"] - b["collapsed"]),
            "log_rank": log_rank(times[arm], times[base]),
        }  # fmt: skip
    late = {
        scoring: paired(results, "dvp", "tis", suffix, "late") if {"dvp", "tis"} <= set(results["arms"]) else None
        for scoring, suffix in SCORINGS.items()
    }
    for stats in late.values():
        if stats is not None and stats["mean"] is not None:
            stats["decision"] = decide_versus(stats)
    onsets = {arm: {str(s): c.step for s, c in by.items()} for arm, by in collapse.items()}
    return {"incidence": incidence, "tests": tests, "late_dvp_minus_tis": late, "onsets": onsets}


# ----------------------------------------------------------------------------------------------------------------
# report


def _interval(ci: list[float] | None) -> str:
    return "–" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def _p(p: float | None) -> str:
    return "–" if p is None else f"{p:.3g}"


def markdown(report: dict) -> str:
    out: list[str] = []
    if report.get("screen"):
        sc = report["screen"]
        out += ["**(a) Collapse screen**: every run (collapse: the registered criterion; onset and which condition).", "",
                "| lr | condition | arm | seed | status | collapsed | onset | criterion |", "|---|---|---|---:|---|---|---:|---|"]  # fmt: skip
        for r in sc["runs"]:
            out.append(f"| {r['learning_rate']:g} | {r['condition']} | {r['arm']} | {r['seed']} | {r['status']} | "
                       f"{'yes' if r['collapsed'] else 'no'} | {r['step'] if r['collapsed'] else '–'} | "
                       f"{r['criterion'] or '–'} |")  # fmt: skip
        out += ["", "| lr | condition | mismatch arm collapsed | clean collapsed | decision |", "|---|---|---|---|---|"]
        for d in sc["decisions"]:
            out.append(f"| {d['learning_rate']:g} | {d['condition']} | {d['mismatch_collapsed']} of {d['mismatch_runs']} | "
                       f"{d['clean_collapsed']} of {d['clean_runs']} | {d['decision']} |")  # fmt: skip
        chosen = sc["confirmatory"]
        out += ["", "Confirmatory configuration: " + (
            f"lr {chosen['learning_rate']:g}, {chosen['condition']}." if chosen else "none (no mismatch-specific collapse)."), ""]  # fmt: skip
    if report.get("top_p"):
        for scoring, title in TITLES.items():
            part = report["top_p"][scoring]
            out += [f"**(b) top_p=0.9, held-out reward {title}**: paired differences over training seeds; early = step "
                    f"{EARLY_STEP}, late = the mean after step {LATE_AFTER}.", "",
                    "| time | estimand | mean | 95 % | 90 % | n | decision | robust |", "|---|---|---:|---|---|---:|---|---|"]  # fmt: skip
            for when in ("early", "late"):
                for name, s in part[when].items():
                    mean = "n/a" if s["mean"] is None else f"{s['mean']:+.4f}"
                    robust = "–" if "robust" not in s else ("yes" if s["robust"] else "no")
                    out.append(f"| {when} | {name} | {mean} | {_interval(s['ci95'])} | {_interval(s['ci90'])} | "
                               f"{s['n']} | {s.get('decision', '–')} | {robust} |")  # fmt: skip
            out += ["", f"DVP's early lead over TIS {title}: **{part['early_lead']}**.", ""]
    if report.get("confirm"):
        c = report["confirm"]
        out += ["**(c) Confirmatory**: collapse incidence and tests.", "", "| arm | collapsed |", "|---|---|"]
        out += [f"| {arm} | {v['collapsed']} of {v['runs']} |" for arm, v in c["incidence"].items()]
        out += ["", "| comparison | Fisher exact p | log-rank χ² | log-rank p |", "|---|---|---|---|"]
        for name, t in c["tests"].items():
            lr = t["log_rank"]
            chi2 = "–" if lr["chi2"] is None else f"{lr['chi2']:.3g}"
            out.append(f"| {name} | {_p(t['fisher_p'])} | {chi2} | {_p(lr['p'])} |")
        out += ["", "| late dvp − tis | mean | 95 % | n | decision |", "|---|---:|---|---:|---|"]
        for scoring, s in c["late_dvp_minus_tis"].items():
            if s is None or s["mean"] is None:
                out.append(f"| {scoring} | n/a | – | 0 | – |")
                continue
            out.append(f"| {scoring} | {s['mean']:+.4f} | {_interval(s['ci95'])} | {s['n']} | {s['decision']} |")
        out.append("")
    return "\n".join(out) + "\n"


def plot(report: dict, path: Path) -> None:
    """(b)'s forest plot: every estimand early and late, one panel per scoring, the margin as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(when, name) for when in ("early", "late") for name in PAIRS]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.32 * len(rows) + 1.6), sharey=True)
    for ax, (scoring, title) in zip(axes, TITLES.items()):
        part = report["top_p"][scoring]
        for y, (when, name) in enumerate(reversed(rows)):
            s = part[when].get(name)
            if not s or s["mean"] is None:
                continue
            if s["ci95"] is not None:
                ax.plot(s["ci95"], [y, y], color=f"C{list(PAIRS).index(name)}", lw=3, solid_capstyle="butt")
            ax.plot([s["mean"]], [y], "o", color="k", ms=3)
        ax.axvspan(-MARGIN, MARGIN, color="C2", alpha=0.12, lw=0)
        ax.axvline(0.0, color="k", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("paired difference of held-out reward")
    axes[0].set_yticks(range(len(rows)), [f"{w}: {n}" for w, n in reversed(rows)], fontsize=7)
    fig.suptitle("Study 4 (b), top_p=0.9: estimands (mean and 95 % interval; green: the margin)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def analyse(screen_studies: list[dict], top_p_study: dict | None, confirm_studies: list[dict]) -> dict:
    report: dict = {"margin": MARGIN}
    if screen_studies:
        report["screen"] = screen(screen_studies)
    if top_p_study is not None:
        rule = top_p_study["settings"].get("sampler_rule")
        if not (rule or "").startswith("top_p"):
            raise ValueError(f"--top_p: the study samples with --sampler_rule {rule!r}: accepted a top_p rule")
        report["top_p"] = top_p(top_p_study)
    if confirm_studies:
        report["confirm"] = confirm(confirm_studies)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--screen", type=Path, nargs="+", default=[], help="the screen studies' results.json")
    parser.add_argument("--top_p", type=Path, help="the top_p study's results.json")
    parser.add_argument("--confirm", type=Path, nargs="+", default=[], help="the confirmatory studies' results.json")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--markdown", type=Path, help="write the outcome's tables here (Markdown)")
    parser.add_argument("--plot", type=Path, help="draw (b)'s forest plot here (PNG)")
    add_code_version_flags(parser)
    args = parser.parse_args(argv)
    if not args.screen and args.top_p is None and not args.confirm:
        parser.error("give at least one of --screen, --top_p, --confirm")
    load = lambda p: json.loads(p.read_text())  # noqa: E731
    screen_studies = [load(p) for p in args.screen]
    top_p_study = load(args.top_p) if args.top_p else None
    confirm_studies = [load(p) for p in args.confirm]
    labelled = [(str(p), s) for p, s in zip(args.screen, screen_studies)] + [
        (str(p), s) for p, s in zip(args.confirm, confirm_studies)
    ]
    if top_p_study is not None:
        labelled.append((str(args.top_p), top_p_study))
    try:
        code = check_code_versions(labelled, allow_mixed_commits=args.allow_mixed_commits, allow_dirty=args.allow_dirty)
        report = analyse(screen_studies, top_p_study, confirm_studies)
    except ValueError as err:
        print(f"study4_analysis: {err}", file=sys.stderr)
        return 2
    report["code"] = code
    text = markdown(report)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    if args.markdown is not None:
        args.markdown.write_text(text)
    if args.plot is not None and "top_p" in report:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
