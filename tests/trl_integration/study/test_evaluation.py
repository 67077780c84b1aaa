"""``safevocab study`` for a study of DVP under a mismatch where DVP acts (issue 33): the ``tail`` noise kind, the
``dvp_no_mismatch`` arm, the evaluation over several evaluation seeds on the full distribution and on the rule's
support (``--eval_seeds``, ``--eval_on_rule``, ``--eval_steps``), the contrasts, the pruned mass, and a study written
before all this (a real ``results.json`` of the previous code, ``data/study_results_before_issue33.json``) that must
still aggregate and resume. Real trainers on the bundled testbed and tiny models, a few steps each."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from test_run import assert_png, table_rows

from trl_integration.commands import main as safevocab_main
from trl_integration.grpo.config import SafeVocabGRPOConfig
from trl_integration.study import StudySettings, arm_overrides, render_report, summarize
from trl_integration.study.aggregate import t_quantile_975
from trl_integration.study.arms import shared_config
from trl_integration.study.contrasts import contrasts

OLD_RESULTS = Path(__file__).parent / "data" / "study_results_before_issue33.json"

#: Every arm a DVP study needs, under the tail, with the new evaluation: 1 seed, 3 steps, evaluations at 0 and 2.
TAIL_STUDY = [
    "--task", "freetext", "--noise", "1.07", "--noise_kind", "tail",
    "--arms", "no_remedy", "dvp", "no_mismatch", "dvp_no_mismatch", "--seeds", "0", "--steps", "3",
    "--eval_steps", "0", "2", "--eval_seeds", "0", "1", "--eval_on_rule", "--eval_num_prompts", "8",
    "--num_prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "8",
    "--train_num_prompts", "16", "--quiet",
]  # fmt: skip


@pytest.fixture(scope="module")
def tail_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("tail-study")
    assert safevocab_main(["study", *TAIL_STUDY, "--output_dir", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text(encoding="utf-8"))


def test_help_lists_the_tail_the_new_arm_and_the_evaluation_flags(capsys):
    with pytest.raises(SystemExit):
        safevocab_main(["study", "--help"])
    text = capsys.readouterr().out
    for flag in ("tail", "dvp_no_mismatch", "--eval_seeds", "--eval_on_rule", "--eval_steps"):
        assert flag in text, flag


def test_the_arms_and_the_tail_are_the_configs_they_name(tmp_path):
    s = StudySettings(noise=1.07, noise_kind="tail", dvp_rule="min_p=0.02", max_completion_length=8)

    def config(arm):
        return SafeVocabGRPOConfig(**{**shared_config(s, 0, str(tmp_path)), **arm_overrides(arm, s)})

    remedy, dvp, control, dvp_control = (config(a) for a in ("no_remedy", "dvp", "no_mismatch", "dvp_no_mismatch"))
    # the tail acts in every arm with the mismatch, on the dvp arms' rule, whatever the arm's own rule
    for cfg in (remedy, dvp):
        assert (cfg.rollout_logit_noise, cfg.rollout_logit_noise_kind, cfg.rollout_tail_rule) == (
            1.07,
            "tail",
            "min_p=0.02",
        )
    assert remedy.safe_vocab_rule == "none" and dvp.safe_vocab_effective_rule == "min_p=0.02"
    # dvp_no_mismatch: no_mismatch's switches, dvp's rule in the sampler and the trainer
    assert arm_overrides("dvp_no_mismatch", s) == {
        **arm_overrides("no_mismatch", s),
        "safe_vocab_rule": "min_p=0.02",
        "safe_vocab_in_sampler": True,
    }
    assert (dvp_control.rollout_logit_noise, dvp_control.rollout_mantissa_bits) == (0.0, None)
    assert dvp_control.safe_vocab_effective_rule == dvp.safe_vocab_effective_rule and dvp_control.min_p == dvp.min_p
    assert control.safe_vocab_effective_rule == "none" and control.seed == dvp_control.seed == remedy.seed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--noise", "1", "--noise_kind", "tail", "--dvp_rule", "none"], "--noise_kind tail lifts the tokens --dvp_rule"),
        (["--eval_seeds", "0", "1"], "--eval_seeds needs a held-out metric that takes seed="),  # arithmetic: greedy
        (["--eval_on_rule"], "--eval_on_rule needs a held-out metric that takes min_p="),
        (["--task", "freetext", "--eval_on_rule", "--dvp_rule", "top_k=5"], "accepted a --dvp_rule min_p=RHO or top_p=P"),
        (["--eval_on_rule", "--dvp_rule", "top_p=0.9"], "--eval_on_rule needs a held-out metric that takes top_p="),
        (["--eval_steps", "0", "200"], "--eval_steps [0, 200] is not accepted: accepted increasing steps"),
        (["--eval_steps", "5", "3"], "--eval_steps [5, 3] is not accepted"),
        (["--eval_seeds", "1", "1"], "--eval_seeds [1, 1] is not accepted: accepted distinct integers"),
    ],
)  # fmt: skip
def test_bad_new_flags_exit_2_in_one_line_before_any_work(argv, message, tmp_path, capsys):
    assert safevocab_main(["study", "--steps", "150", *argv, "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_top_p_rule_is_scored_on_its_nucleus():
    """--eval_on_rule with --dvp_rule top_p=P samples the held-out metric under top_p (Study 4's top_p condition)."""
    from trl_integration.demo.freetext import held_out_dataset, held_out_reward
    from trl_integration.demo.testbed import load_testbed_model, load_testbed_tokenizer
    from trl_integration.study.arms import rule_sampling

    assert rule_sampling(StudySettings(dvp_rule="top_p=0.9")) == {"top_p": 0.9}
    assert rule_sampling(StudySettings(dvp_rule="min_p=0.05")) == {"min_p": 0.05}
    model, tok = load_testbed_model(dtype=torch.float32), load_testbed_tokenizer()
    data = held_out_dataset(8)
    full = held_out_reward(model, tok, data, seed=0)
    nucleus = held_out_reward(model, tok, data, seed=0, top_p=0.9)
    assert nucleus != full and nucleus == held_out_reward(model, tok, data, seed=0, top_p=0.9)
    with pytest.raises(ValueError, match="accepted at most one of them"):
        held_out_reward(model, tok, data, min_p=0.1, top_p=0.9)
    with pytest.raises(ValueError, match="top_p"):
        held_out_reward(model, tok, data, top_p=1.5)


def test_each_evaluation_seed_and_the_rule_are_recorded_from_the_same_runs(tail_study):
    """At step 0 (the testbed itself), each recorded value equals the task's metric called with that seed, on the full
    distribution and under the rule's min_p; the recorded metric is their mean; the steps are --eval_steps."""
    import torch

    from trl_integration.demo.freetext import held_out_dataset, held_out_reward
    from trl_integration.demo.testbed import load_testbed_model, load_testbed_tokenizer

    out, results = tail_study
    model, tok = load_testbed_model(dtype=torch.float32), load_testbed_tokenizer()
    data = held_out_dataset(8)
    full = [held_out_reward(model, tok, data, seed=s) for s in (0, 1)]
    rule = [held_out_reward(model, tok, data, seed=s, min_p=0.01) for s in (0, 1)]
    assert full != rule and full[0] != full[1]
    for run in results["runs"]:
        ev = run["eval"]
        assert ev["step"] == [0, 2] and ev["eval_seeds"] == [0, 1] and ev["rule_min_p"] == 0.01
        assert ev["reward_by_seed"][0] == full and ev["reward_rule_by_seed"][0] == rule
        for name in ("reward", "reward_rule"):
            assert len(ev[name]) == len(ev[f"{name}_by_seed"]) == 2
            for mean, values in zip(ev[name], ev[f"{name}_by_seed"]):
                assert mean == pytest.approx(sum(values) / 2, rel=1e-12)
    report = (out / "report.md").read_text(encoding="utf-8")
    rows = table_rows(report.split("## Held-out reward on the rule's support")[1], "| arm | runs ok | final reward")
    assert list(rows) == ["no_remedy", "dvp", "no_mismatch", "dvp_no_mismatch"]
    assert "evaluation seeds 0, 1 (the metric is their mean)" in report and "at steps 0, 2;" in report
    assert_png(out / "heldout_reward_rule.png") and "](heldout_reward_rule.png)" in report
    seed_rows = table_rows(report, "| arm | vs | scoring | eval seed 0 | eval seed 1 |")
    assert "dvp_no_mismatch" in seed_rows


def test_contrasts_pair_the_arms_by_seed(tail_study):
    """The report's contrasts are the arms' late metrics combined by hand (one seed: the value itself), for each
    scoring and each evaluation seed; the tail costs in the arms it acts in only."""
    out, results = tail_study
    late = {r["arm"]: r["eval"] for r in results["runs"]}
    c = results["contrasts"]
    # issue 42 added dvp_residual_clean (dvp − no_mismatch); the tis / dvp_tis contrasts need arms not run here
    assert set(c) == {"harm", "dvp_cost", "dvp_residual_harm", "dvp_interaction", "dvp_gain", "dvp_residual_clean"}
    for suffix in ("", "_rule"):
        value = {arm: ev[f"reward{suffix}"][-1] for arm, ev in late.items()}  # late = the step-2 evaluation
        expected = (value["dvp"] - value["dvp_no_mismatch"]) - (value["no_remedy"] - value["no_mismatch"])
        assert c["dvp_interaction"][f"late_metric{suffix}"]["diffs"] == [pytest.approx(expected, abs=1e-15)]
        assert c["dvp_cost"][f"late_metric{suffix}"]["mean"] == pytest.approx(
            value["dvp_no_mismatch"] - value["no_mismatch"], abs=1e-15
        )
        assert c["dvp_residual_clean"][f"late_metric{suffix}"]["mean"] == pytest.approx(
            value["dvp"] - value["no_mismatch"], abs=1e-15
        )
        for j in (0, 1):
            seed_value = {arm: ev[f"reward{suffix}_by_seed"][-1][j] for arm, ev in late.items()}
            assert c["harm"][f"late_metric{suffix}_by_eval_seed"][j]["mean"] == pytest.approx(
                seed_value["no_remedy"] - seed_value["no_mismatch"], abs=1e-15
            )
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "| `dvp_interaction` | (dvp − dvp_no_mismatch) − (no_remedy − no_mismatch)" in report
    summary = results["summary"]
    assert summary["no_remedy"]["k3_kl"]["mean"] > 1e-2 and summary["dvp"]["k3_kl"]["mean"] > 1e-3
    assert summary["no_mismatch"]["k3_kl"]["mean"] < 1e-6 and summary["dvp_no_mismatch"]["k3_kl"]["mean"] < 1e-6


def test_the_pruned_mass_dvp_saw_is_kept(tail_study):
    """What safevocab.bounds needs to bound DVP's cost: the pruned mass and the sequence TV it implies, per step in
    results.json and averaged per arm (0 for the arms without a rule)."""
    _, results = tail_study
    for run in results["runs"]:
        series = run["series"]
        for key in ("safevocab/pruned_mass_mean", "safevocab/seq_tv_estimate", "safevocab/seq_kl_estimate"):
            assert len(series[key]) == 3 and all(v is not None for v in series[key]), (run["arm"], key)
        mean = sum(series["safevocab/pruned_mass_mean"]) / 3
        assert results["summary"][run["arm"]]["pruned_mass"]["mean"] == pytest.approx(mean, rel=1e-12)
        assert (mean > 0.05) == run["arm"].startswith("dvp"), (run["arm"], mean)
        assert 0.0 <= results["summary"][run["arm"]]["seq_tv"]["mean"] <= 1.0


def test_the_new_evaluation_does_not_change_training(tail_study, tmp_path):
    """The same arm and seed evaluated the old way (one draw, every step: more evaluations, at other steps) trains
    identically, and its draws at the common steps are the evaluation seed 0's of the new way."""
    _, results = tail_study
    argv = list(TAIL_STUDY)
    for flag, n in (("--eval_steps", 2), ("--eval_seeds", 2), ("--eval_on_rule", 0)):
        i = argv.index(flag)
        del argv[i : i + 1 + n]
    argv[argv.index("--arms") + 1 : argv.index("--seeds")] = ["no_remedy"]
    assert safevocab_main(["study", *argv, "--eval_every", "1", "--no_plots", "--output_dir", str(tmp_path)]) == 0
    (old_way,) = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))["runs"]
    new_way = next(r for r in results["runs"] if r["arm"] == "no_remedy")
    keys = set(new_way["series"]) - {"step_time"}
    assert keys == set(old_way["series"]) - {"step_time"}
    assert all(old_way["series"][k] == new_way["series"][k] for k in keys)
    assert set(old_way["eval"]) == {"step", "reward"} and old_way["eval"]["step"] == [0, 1, 2, 3]
    assert old_way["eval"]["reward"][0:3:2] == [row[0] for row in new_way["eval"]["reward_by_seed"]]


def test_paired_differences_per_evaluation_seed_by_hand():
    """Two arms x 3 seeds x 2 evaluation seeds, evaluated at steps 0, 2, 4 (late: the step-4 evaluation, the only
    one after half the last step). Arm a's late metric minus no_mismatch's, for evaluation seed 7: +0.1, +0.3, +0.2
    (mean 0.2, sd 0.1); for evaluation seed 9: 0, 0, +0.3 (mean 0.1, sd 0.1732); for their mean (the metric):
    +0.05, +0.15, +0.25."""

    def run(arm, seed, late_by_eval_seed):
        rows = [[0.0, 0.0], [0.0, 0.0], list(late_by_eval_seed)]
        return {"arm": arm, "seed": seed, "status": "ok", "series": {}, "wall_time_s": 1.0,
                "eval": {"step": [0, 2, 4], "eval_seeds": [7, 9], "reward": [sum(r) / 2 for r in rows],
                         "reward_by_seed": rows}}  # fmt: skip

    runs = []
    for seed, (d0, d1) in enumerate([(0.1, 0.0), (0.3, 0.0), (0.2, 0.3)]):
        runs.append(run("no_mismatch", seed, [0.5, 0.4]))
        runs.append(run("a", seed, [0.5 + d0, 0.4 + d1]))
    results = {"arms": {"no_mismatch": {}, "a": {}}, "runs": runs, "task": {"metric_name": "reward"}}
    by_seed = summarize(results)["a"]["late_metric_vs_no_mismatch_by_eval_seed"]
    assert [x["mean"] for x in by_seed] == [pytest.approx(0.2), pytest.approx(0.1)]
    sd1 = math.sqrt(((0 - 0.1) ** 2 * 2 + (0.3 - 0.1) ** 2) / 2)
    assert by_seed[1]["ci95"] == pytest.approx(
        [0.1 - t_quantile_975(2) * sd1 / math.sqrt(3), 0.1 + t_quantile_975(2) * sd1 / math.sqrt(3)]
    )
    assert by_seed[0]["diffs"] == pytest.approx([0.1, 0.3, 0.2]) and by_seed[0]["seeds"] == [0, 1, 2]
    # the 90 % interval of an equivalence test (TOST): t_{0.95, 2} = 2.920 (a t table), sd 0.1, n 3
    assert by_seed[0]["ci90"] == pytest.approx([0.2 - 2.920 * 0.1 / math.sqrt(3), 0.2 + 2.920 * 0.1 / math.sqrt(3)])
    pooled = summarize(results)["a"]["late_metric_vs_no_mismatch"]
    assert pooled["diffs"] == pytest.approx([0.05, 0.15, 0.25])  # the metric itself is the mean over eval seeds
    assert contrasts(results) == {}  # no contrast has all its arms here


def test_a_study_written_before_issue_33_aggregates_and_resumes(tmp_path, capsys):
    """A real results.json of the previous code (2 arms, 1 seed, 2 steps on the tiny model): it aggregates and
    renders, resumes with one more arm (only that arm trains, the old runs are kept as they were), and refuses a
    resume with a new evaluation setting."""
    old = json.loads(OLD_RESULTS.read_text(encoding="utf-8"))
    assert "contrasts" not in old and "eval_seeds" not in old["settings"]  # written before issue 33
    summary = summarize(old)
    assert summary["dvp"]["final_metric"]["mean"] == old["summary"]["dvp"]["final_metric"]["mean"]
    assert summary["dvp"]["late_metric_rule"]["n"] == 0 and "late_metric_rule_vs_no_remedy" not in summary["dvp"]
    assert "## Contrasts" in render_report({**old, "summary": summary}, plots=False)  # dvp_gain: dvp − no_remedy

    out = tmp_path / "study"
    out.mkdir()
    shutil.copy(OLD_RESULTS, out / "results.json")
    argv = ["study", "--arms", "no_remedy", "dvp", "dvp_no_mismatch", "--seeds", "0", "--steps", "2",
            "--eval_every", "2", "--eval_num_prompts", "8", "--num_prompts_per_step", "2", "--num_generations", "4",
            "--train_num_prompts", "16", "--quiet", "--no_plots", "--resume", "--output_dir", str(out)]  # fmt: skip
    assert safevocab_main(argv) == 0
    assert "2 finished runs kept" in capsys.readouterr().out
    resumed = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert (resumed["runs_trained"], resumed["runs_resumed"]) == (1, 2)
    assert resumed["runs"][:2] == old["runs"] and resumed["runs"][2]["arm"] == "dvp_no_mismatch"
    assert resumed["arms"]["dvp_no_mismatch"]["safe_vocab_rule"] == "min_p=0.01"
    assert list(table_rows((out / "report.md").read_text(encoding="utf-8"), "| arm | runs ok | final accuracy")) == [
        "no_remedy",
        "dvp",
        "dvp_no_mismatch",
    ]
    assert safevocab_main([*argv[:-3], "--eval_steps", "0", "2", "--resume", "--output_dir", str(out)]) == 2
    assert "--resume: --eval_steps is [0, 2] but the runs in" in capsys.readouterr().err
