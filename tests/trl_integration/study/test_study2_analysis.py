"""scripts/study2_analysis.py, the pre-registered analysis of Study 2, on hand-made results with known answers."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "study2_analysis.py"


@pytest.fixture(scope="module")
def analysis():
    spec = importlib.util.spec_from_file_location("study2_analysis", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEPS = [0, 150, 200, 250, 300]


def _run(arm: str, seed: int, late: float, late_rule: float, tv: float = 0.5) -> dict:
    """A finished run whose late held-out reward (mean of steps 200, 250, 300) is ``late`` (``late_rule`` on the
    rule's support); two evaluation seeds that differ by ±0.001 around it."""
    full = [0.05, late - 0.01, late - 0.001, late, late + 0.001]
    rule = [0.06, late_rule - 0.01, late_rule, late_rule, late_rule]
    return {
        "arm": arm,
        "seed": seed,
        "status": "ok",
        "eval": {
            "step": STEPS,
            "reward": full,
            "reward_rule": rule,
            "eval_seeds": [0, 1],
            "reward_by_seed": [[v - 0.001, v + 0.001] for v in full],
            "reward_rule_by_seed": [[v - 0.001, v + 0.001] for v in rule],
        },
        "series": {
            "step": [100, 200, 300],
            "safevocab/seq_tv_estimate": [0.9, tv, tv],
            "safevocab/pruned_mass_mean": [0.3, 0.2, 0.2],
            "reward": [0.1, 0.1, 0.1],
        },
    }


def _results(runs: list[dict]) -> dict:
    arms = {r["arm"]: {} for r in runs}
    return {"arms": arms, "runs": runs, "settings": {"steps": 300}, "task": {"metric_name": "reward"}}


# late rule-support reward per (arm, seed): the tail harms no remedy by 0.02 (seed-dependent), DVP's residual harm
# is tiny, DVP costs 0.003, and under lift2 DVP removes nothing.
SEEDS = (1, 2, 3, 4, 5)
JITTER = (0.0, 0.001, -0.001, 0.002, -0.002)
TAIL_VALUES = {
    "no_mismatch": [0.120 + j for j in JITTER],
    "dvp_no_mismatch": [0.117 + j for j in JITTER],
    "no_remedy": [0.100 + j + 0.5 * j for j in JITTER],
    "dvp": [0.117 + j + 0.1 * j for j in JITTER],
    "tis": [0.115 + j for j in JITTER],
}
LIFT_VALUES = {"no_remedy": [0.100 + j for j in JITTER], "dvp": [0.098 + j for j in JITTER]}


@pytest.fixture()
def studies(tmp_path):
    tail = _results([_run(a, s, v, v) for a, vs in TAIL_VALUES.items() for s, v in zip(SEEDS, vs)])
    lift = _results([_run(a, s, v, v) for a, vs in LIFT_VALUES.items() for s, v in zip(SEEDS, vs)])
    paths = tmp_path / "tail.json", tmp_path / "lift2.json"
    for path, results in zip(paths, (tail, lift)):
        path.write_text(json.dumps(results))
    return tail, lift, paths


def test_estimands_equal_the_hand_computed_contrasts(analysis, studies):
    tail, lift, _ = studies
    e = analysis.estimands(tail, analysis.with_controls(lift, tail), "late_metric_rule")
    expected = {
        "E1_harm": [TAIL_VALUES["no_remedy"][i] - TAIL_VALUES["no_mismatch"][i] for i in range(5)],
        "E2_residual_harm": [TAIL_VALUES["dvp"][i] - TAIL_VALUES["dvp_no_mismatch"][i] for i in range(5)],
        "E4_cost": [TAIL_VALUES["dvp_no_mismatch"][i] - TAIL_VALUES["no_mismatch"][i] for i in range(5)],
    }
    expected["E3_interaction"] = [r - h for r, h in zip(expected["E2_residual_harm"], expected["E1_harm"])]
    lift_interaction = [
        (LIFT_VALUES["dvp"][i] - TAIL_VALUES["dvp_no_mismatch"][i])
        - (LIFT_VALUES["no_remedy"][i] - TAIL_VALUES["no_mismatch"][i])
        for i in range(5)
    ]
    expected["E5_specificity"] = [t - x for t, x in zip(expected["E3_interaction"], lift_interaction)]
    for name, diffs in expected.items():
        assert e[name]["seeds"] == list(SEEDS), name
        assert e[name]["diffs"] == pytest.approx(diffs, abs=1e-12), name
        mean = sum(diffs) / 5
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4)
        assert e[name]["ci95"] == pytest.approx(
            [mean - 2.776 * sd / math.sqrt(5), mean + 2.776 * sd / math.sqrt(5)], abs=1e-4
        ), name


def test_decisions_follow_the_plan(analysis, studies):
    tail, lift, _ = studies
    e = analysis.estimands(tail, analysis.with_controls(lift, tail), "late_metric_rule")
    assert analysis.decide(e) == {
        "premise": "harm detected",
        "dvp": "DVP removes the tail's harm",
        "cost": "cost detected negative",
        "specificity": "specific to the tail",
    }
    # a residual harm beyond the margin: reduces, does not remove
    assert analysis.decide(e, margin=0.0001)["dvp"] == "DVP reduces the tail's harm but does not remove it"


def test_decision_branches_on_intervals(analysis):
    def stats(ci95, ci90=None):
        lo, hi = ci95
        return {"mean": (lo + hi) / 2, "std": 1.0, "n": 5, "ci95": ci95, "ci90": ci90 or ci95}

    base = {
        "E1_harm": stats([0.001, 0.01]),
        "E2_residual_harm": stats([-0.1, 0.1]),
        "E3_interaction": stats([-0.01, 0.02]),
        "E4_cost": stats([-0.01, 0.01]),
        "E5_specificity": stats([-1, 1]),
    }
    assert analysis.decide(base) == {
        "premise": "no harm detected (against the premise at this scale)",
        "dvp": "DVP does not reduce the tail's harm",
        "cost": "no cost detected",
        "specificity": "specificity not shown",
    }
    assert analysis.decide({**base, "E4_cost": stats([0.001, 0.002])})["cost"] == "cost detected positive"


def test_bonferroni_interval_uses_t_0995(analysis):
    stats = {"mean": 0.0, "std": 1.0, "n": 5}
    lo, hi = analysis.bonferroni(stats)
    assert hi == pytest.approx(4.604 / math.sqrt(5))


def test_per_evaluation_seed_and_cost_against_bound(analysis, studies):
    tail, lift, _ = studies
    seeds = analysis.per_eval_seed(tail, analysis.with_controls(lift, tail), "late_metric_rule")
    assert len(seeds) == 2  # two evaluation seeds, each shifted by the same ±0.001 in every arm: same contrasts
    assert seeds[0]["E1_harm"]["diffs"] == pytest.approx(seeds[1]["E1_harm"]["diffs"], abs=1e-12)
    rows = analysis.cost_against_bound(tail, "late_metric_rule")
    assert [r["seed"] for r in rows] == list(SEEDS)
    assert all(r["seq_tv"] == pytest.approx(0.5) and r["bound"] == pytest.approx(0.5) for r in rows)  # late steps only


def test_main_prints_every_estimand_and_checks_determinism(analysis, studies, tmp_path, capsys):
    tail, _, (tail_path, lift_path) = studies
    check = _results([r for r in tail["runs"] if r["arm"] in ("no_mismatch", "dvp_no_mismatch") and r["seed"] == 1])
    check["runs"][0]["eval"]["reward"][-1] += 1e-9  # one evaluation differs: the check must say so
    check_path = tmp_path / "check.json"
    check_path.write_text(json.dumps(check))
    out_json = tmp_path / "out.json"
    assert analysis.main([str(tail_path), str(lift_path), "--check", str(check_path), "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    for name in ("E1_harm", "E2_residual_harm", "E3_interaction", "E4_cost", "E5_specificity"):
        assert printed.count(name) == 2  # both scorings
    report = json.loads(out_json.read_text())
    assert report["determinism"] == ["dvp_no_mismatch seed 1: identical", "no_mismatch seed 1: DIFFERENT"]
    assert report["rule"]["decisions"]["dvp"] == "DVP removes the tail's harm"


def test_plot_draws_every_estimand_of_both_scorings(analysis, studies, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, (tail_path, lift_path) = studies
    png = tmp_path / "estimands.png"
    assert analysis.main([str(tail_path), str(lift_path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_markdown_tables_carry_every_estimand_decision_and_bound_row(analysis, studies, tmp_path):
    tail, _, (tail_path, lift_path) = studies
    md = tmp_path / "tables.md"
    assert analysis.main([str(tail_path), str(lift_path), "--markdown", str(md)]) == 0
    text = md.read_text()
    for name in ("E1_harm", "E2_residual_harm", "E3_interaction", "E4_cost", "E5_specificity"):
        assert text.count(f"| {name} |") == 4  # both scorings: the estimand table and the per-evaluation-seed table
    assert text.count("| dvp | DVP removes the tail's harm | DVP removes the tail's harm |") == 2
    assert "| robust |" in text and "| yes |" in text
    e1 = analysis.estimands(tail, analysis.with_controls(json.loads(lift_path.read_text()), tail), "late_metric_rule")[
        "E1_harm"
    ]
    assert f"| E1_harm | {e1['mean']:+.4f} | [{e1['ci95'][0]:+.4f}, {e1['ci95'][1]:+.4f}] |" in text
    bound_rows = [
        line
        for line in text.splitlines()
        if line.startswith("| ") and line.count("|") == 8 and line.split("|")[1].strip().isdigit()
    ]
    assert [int(r.split("|")[1]) for r in bound_rows] == list(SEEDS)
    assert all("| 0.5000 | 0.5000 |" in r for r in bound_rows)  # the late TV and its bound (reward in [0, 1])
    assert text.count("| E2_residual_harm, 90 % (equivalence) |") == 2  # the per-evaluation-seed equivalence test


def _with_code(results: dict, commits: dict[tuple[str, int], str], clean: bool = True) -> dict:
    """``results`` whose runs carry the ``code`` record run_study writes (``commits``: per (arm, seed), else "aaa")."""
    for run in results["runs"]:
        run["code"] = {"commit": commits.get((run["arm"], run["seed"]), "a" * 40), "clean": clean}
    return results


def test_records_from_different_commits_are_refused_unless_told(analysis, studies, tmp_path, capsys):
    """Issue 42: the runs' code version is recorded, and the analysis refuses records from two commits."""
    tail, lift, (tail_path, lift_path) = studies
    tail_path.write_text(json.dumps(_with_code(tail, {})))
    lift_path.write_text(json.dumps(_with_code(lift, {("dvp", 3): "b" * 40})))
    assert analysis.main([str(tail_path), str(lift_path)]) == 2
    err = capsys.readouterr().err
    assert (
        "the records come from 2 code versions" in err
        and "lift2: dvp seed 3" in err
        and "--allow_mixed_commits" in err
        and len(err.strip().splitlines()) == 1
    )
    out_json = tmp_path / "out.json"
    assert analysis.main([str(tail_path), str(lift_path), "--allow_mixed_commits", "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["code"]["commits"] == {"a" * 40: 34, "b" * 40: 1}


def test_records_without_a_commit_mixed_with_recorded_ones_are_refused(analysis, studies, capsys):
    tail, lift, (tail_path, lift_path) = studies
    tail_path.write_text(json.dumps(_with_code(tail, {})))  # the lift2 file has no code record (Study 2's files)
    assert analysis.main([str(tail_path), str(lift_path)]) == 2
    assert "not recorded: 10 runs" in capsys.readouterr().err


def test_records_from_a_dirty_tree_are_refused_unless_told(analysis, studies, capsys):
    tail, lift, (tail_path, lift_path) = studies
    tail_path.write_text(json.dumps(_with_code(tail, {})))
    lift_path.write_text(json.dumps(_with_code(lift, {}, clean=False)))
    assert analysis.main([str(tail_path), str(lift_path)]) == 2
    assert "10 runs were trained from a tree with uncommitted changes" in capsys.readouterr().err
    assert analysis.main([str(tail_path), str(lift_path), "--allow_dirty"]) == 0


def test_study2s_own_records_without_code_still_analyse(analysis, studies, tmp_path):
    _, _, (tail_path, lift_path) = studies
    out_json = tmp_path / "out.json"
    assert analysis.main([str(tail_path), str(lift_path), "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["code"] == {
        "commits": {"not recorded": 35},
        "dirty_runs": [],
        "mixed": False,
    }
