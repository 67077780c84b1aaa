"""Study 4's registered analysis (scripts/study4_analysis.py) on hand-made records with known answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

import study4_analysis as s4  # noqa: E402


def run(arm, seed, collapse_at=None, steps=600, rewards=None, status="ok"):
    """A run whose reward collapses (falls to 0.05 from 0.4) at ``collapse_at``, with held-out rewards ``rewards``
    at steps 0, 150, 300, 400, 500, 600 (four evaluation seeds, all equal to the step's value)."""
    reward = [0.4] * steps if collapse_at is None else [0.4] * (collapse_at - 1) + [0.05] * (steps - collapse_at + 1)
    rewards = rewards or [0.1] * 6
    ev_steps = [0, 150, 300, 400, 500, 600]
    ev = {"step": ev_steps, "reward": rewards, "reward_rule": [r + 0.01 for r in rewards],
          "reward_by_seed": [[r] * 4 for r in rewards], "reward_rule_by_seed": [[r + 0.01] * 4 for r in rewards]}  # fmt: skip
    series = {"step": list(range(1, steps + 1)), "reward": reward, "grad_norm": [0.5] * steps,
              "safevocab/entropy_full": [3.0] * steps, "loss": [0.0] * steps}  # fmt: skip
    return {"arm": arm, "seed": seed, "status": status, "series": series, "eval": ev, "nonfinite": {},
            "stopped_non_finite": False, "code": {"commit": "abc", "clean": True}}  # fmt: skip


def study(runs, lr=1e-3, sampler_rule="min_p=0.05", noise=0.0, eval_seeds=(0, 1, 2, 3)):
    arms = {r["arm"]: {} for r in runs}
    settings = {"learning_rate": lr, "sampler_rule": sampler_rule, "noise": noise, "eval_seeds": list(eval_seeds)}
    return {"settings": settings, "arms": arms, "runs": runs, "code": {"commit": "abc", "clean": True}}


def test_the_screen_finds_a_mismatch_specific_collapse_and_picks_the_first_configuration():
    trunc_1e3 = study(
        [run("no_remedy", 14, 200), run("no_remedy", 15, 300), run("no_mismatch", 14), run("no_mismatch", 15)]
    )
    tail_1e3 = study([run("no_remedy", 14, 250), run("no_remedy", 15)], sampler_rule=None, noise=1.07)
    trunc_3e3 = study([run("no_remedy", 14, 150), run("no_remedy", 15, 150), run("no_mismatch", 14, 400),
                       run("no_mismatch", 15)], lr=3e-3)  # fmt: skip
    tail_3e3 = study([run("no_remedy", 14), run("no_remedy", 15)], lr=3e-3, sampler_rule=None, noise=1.07)
    report = s4.screen([tail_3e3, trunc_3e3, tail_1e3, trunc_1e3])
    decisions = {(d["learning_rate"], d["condition"]): d["decision"] for d in report["decisions"]}
    assert decisions == {
        (1e-3, "trunc"): "mismatch-specific collapse",
        (1e-3, "tail@1.07"): "one seed of two",
        (3e-3, "trunc"): "collapse, not mismatch-specific",
        (3e-3, "tail@1.07"): "no collapse",
    }
    assert (report["confirmatory"]["learning_rate"], report["confirmatory"]["condition"]) == (1e-3, "trunc")
    onsets = {(r["learning_rate"], r["condition"], r["seed"]): r["step"] for r in report["runs"] if r["collapsed"]}
    # 0.05 from step 200: the 10-step mean holds six low values at step 205, (4 x 0.4 + 6 x 0.05) / 10 = 0.19 < 0.2
    assert onsets[(1e-3, "trunc", 14)] == 205


def test_a_screen_without_mismatch_specific_collapse_picks_nothing():
    trunc = study(
        [run("no_remedy", 14, 200), run("no_remedy", 15, 200), run("no_mismatch", 14, 200), run("no_mismatch", 15)]
    )
    report = s4.screen([trunc])
    assert report["decisions"][0]["decision"] == "collapse, not mismatch-specific" and report["confirmatory"] is None


def top_p_study(dvp_rewards, tis_rewards, seeds=range(16, 22)):
    runs = []
    for i, seed in enumerate(seeds):
        noise = 0.001 * (i % 3 - 1)  # a little seed-to-seed spread around the arm's curve
        runs += [run("dvp", seed, rewards=[r + noise for r in dvp_rewards]),
                 run("tis", seed, rewards=tis_rewards),
                 run("no_remedy", seed, rewards=[r - 0.01 for r in tis_rewards]),
                 run("no_mismatch", seed, rewards=tis_rewards)]  # fmt: skip
    return study(runs, lr=1e-4, sampler_rule="top_p=0.9")


def test_top_p_reads_an_early_lead_that_tis_catches_up():
    report = s4.top_p(top_p_study([0.1, 0.15, 0.17, 0.18, 0.18, 0.18], [0.1, 0.12, 0.16, 0.18, 0.18, 0.18]))
    rule = report["rule"]
    assert rule["early"]["dvp_minus_tis"]["mean"] == pytest.approx(0.03)
    assert rule["early"]["dvp_minus_tis"]["decision"].startswith("DVP above TIS")
    assert rule["late"]["dvp_minus_tis"]["mean"] == pytest.approx(0.0, abs=1e-12)  # late = steps 400, 500, 600
    assert rule["late"]["dvp_minus_tis"]["decision"] == "DVP and TIS equivalent"
    assert rule["early_lead"] == "TIS caught up"
    assert rule["late"]["harm"]["decision"].startswith("harm detected")
    assert rule["late"]["harm"]["robust"] and len(rule["late"]["harm"]["by_eval_seed"]) == 4


def test_top_p_reads_a_persisting_lead():
    report = s4.top_p(top_p_study([0.1, 0.15, 0.17, 0.2, 0.2, 0.2], [0.1, 0.12, 0.16, 0.18, 0.18, 0.18]))
    assert report["full"]["early_lead"] == "DVP's early lead persists"


def test_fisher_exact_matches_known_tables():
    assert s4.fisher_exact(8, 0, 0, 8) == pytest.approx(2 / 12870)
    assert s4.fisher_exact(3, 1, 1, 3) == pytest.approx(0.4857, abs=1e-4)
    assert s4.fisher_exact(4, 4, 4, 4) == pytest.approx(1.0)


def test_log_rank_matches_the_leukaemia_textbook_example():
    """Freireich et al. (1963), 6-MP against placebo: the log-rank chi-square is 16.79 (Kleinbaum & Klein)."""
    drug = [(6, True)] * 3 + [(6, False), (7, True), (9, False), (10, True), (10, False), (11, False), (13, True), (16, True),
            (17, False), (19, False), (20, False), (22, True), (23, True), (25, False), (32, False), (32, False),
            (34, False), (35, False)]  # fmt: skip
    placebo = [(t, True) for t in (1, 1, 2, 2, 3, 4, 4, 5, 5, 8, 8, 8, 8, 11, 11, 12, 12, 15, 17, 22, 23)]
    result = s4.log_rank(drug, placebo)
    assert result["chi2"] == pytest.approx(16.79, abs=0.01)
    assert result["p"] == pytest.approx(4.17e-5, rel=0.02)


def test_the_confirmatory_set_merges_its_pieces(tmp_path):
    first = study([run("dvp", s) for s in (22, 23, 24, 25)] + [run("tis", s, 150) for s in (22, 23, 24, 25)])
    second = study([run("dvp", s) for s in (26, 27, 28, 29)] + [run("tis", s, 150) for s in (26, 27, 28, 29)])
    report = s4.confirm([first, second])
    assert report["incidence"] == {"dvp": {"collapsed": 0, "runs": 8}, "tis": {"collapsed": 8, "runs": 8}}
    assert report["tests"]["dvp_vs_tis"]["fisher_p"] == pytest.approx(2 / 12870)
    assert report["tests"]["dvp_vs_tis"]["log_rank"]["p"] < 1e-3


def test_the_command_refuses_mixed_commits_and_writes_its_tables(tmp_path, capsys):
    trunc = study(
        [run("no_remedy", 14, 200), run("no_remedy", 15, 300), run("no_mismatch", 14), run("no_mismatch", 15)]
    )
    path = tmp_path / "trunc.json"
    path.write_text(json.dumps(trunc))
    assert s4.main(["--screen", str(path), "--markdown", str(tmp_path / "t.md")]) == 0
    assert "mismatch-specific collapse" in (tmp_path / "t.md").read_text()
    trunc["runs"][0]["code"] = {"commit": "def", "clean": True}
    path.write_text(json.dumps(trunc))
    assert s4.main(["--screen", str(path)]) == 2
    assert "code versions" in capsys.readouterr().err
