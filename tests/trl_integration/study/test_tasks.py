"""``safevocab study`` beyond the bundled study: tasks (``--task``), the new arms (``dvp_mis``, ``no_mismatch``),
the new mismatch sources (``--rollout_mantissa_bits``, ``--noise_kind lift``, ``--rollout_perturbation``) and
``--resume``, through the real command and real trl trainers on the bundled tiny model."""

from __future__ import annotations

import importlib.util
import json

import pytest
import rollout_plugins
import study_plugins
from test_run import assert_png, table_rows

from trl_integration.commands import main as safevocab_main
from trl_integration.demo import arithmetic
from trl_integration.demo.model import TINY_MODEL_DIR
from trl_integration.grpo.config import SafeVocabGRPOConfig
from trl_integration.grpo.trainer import SafeVocabGRPOTrainer
from trl_integration.study import StudySettings, StudyTask, arm_overrides, load_task, run_study
from trl_integration.study.arms import shared_config


def test_the_arithmetic_task_is_the_bundled_study():
    task = load_task("arithmetic")
    assert isinstance(task, StudyTask) and task.name == "arithmetic" and task.metric_name == "accuracy"
    assert task.model_path == str(TINY_MODEL_DIR)
    assert list(task.reward_funcs) == [arithmetic.arithmetic_reward] and task.held_out_metric is arithmetic.accuracy
    train, held_out = task.train_dataset(32, 0), task.held_out_dataset(16)
    assert train["prompt"] == arithmetic.make_dataset(32, seed=0, split="train")["prompt"]
    assert held_out["answer"] == arithmetic.make_dataset(16, seed=1, split="test")["answer"]
    assert not set(train["prompt"]) & set(held_out["prompt"])
    assert load_task(task) is task


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nonsense", "--task='nonsense' is not accepted: accepted 'arithmetic', 'freetext' or 'module:function'"),
        ("no_such_module_xyz:make", "--task='no_such_module_xyz:make': cannot import module 'no_such_module_xyz'"),
        ("study_plugins:missing", "--task='study_plugins:missing': module 'study_plugins' has no attribute 'missing'"),
        ("study_plugins:not_a_task", "study_plugins:not_a_task() returned dict, not a StudyTask"),
        ("study_plugins:broken_task", "study_plugins:broken_task() raised RuntimeError: no data today"),
    ],
)
def test_task_errors_are_one_line_naming_the_flag(spec, message, tmp_path, capsys):
    with pytest.raises(ValueError) as err:
        load_task(spec)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert safevocab_main(["study", "--task", spec, "--output_dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_freetext_resolves_lazily():
    if importlib.util.find_spec("trl_integration.demo.freetext") is None:
        with pytest.raises(
            ValueError,
            match=r"^--task='freetext' is not available in this install: "
            r"trl_integration.demo.freetext is missing$",
        ):
            load_task("freetext")
    else:  # the free-text testbed is installed: it must be a StudyTask of its own
        task = load_task("freetext")
        assert isinstance(task, StudyTask) and task.name == "freetext"


def test_new_arms_are_the_configs_they_name(tmp_path):
    s = StudySettings(
        noise=0.5,
        noise_kind="lift",
        rollout_mantissa_bits=3,
        rollout_perturbation="rollout_plugins:lift_half",
        max_completion_length=8,
    )

    def config(arm):
        return SafeVocabGRPOConfig(**{**shared_config(s, 0, str(tmp_path)), **arm_overrides(arm, s)})

    dvp, mis, dvp_mis = config("dvp"), config("mis"), config("dvp_mis")
    assert dvp_mis.safe_vocab_effective_rule == dvp.safe_vocab_effective_rule == "min_p=0.01"
    assert dvp_mis.generate_path_importance_sampling and not dvp.generate_path_importance_sampling
    for key in (
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
    ):
        assert getattr(dvp_mis, key) == getattr(mis, key), key
    remedy, control = config("no_remedy"), config("no_mismatch")
    assert (remedy.rollout_logit_noise, remedy.rollout_mantissa_bits, remedy.rollout_perturbation) == (
        0.5,
        3,
        "rollout_plugins:lift_half",
    )
    assert (control.rollout_logit_noise, control.rollout_mantissa_bits, control.rollout_perturbation) == (
        0.0,
        None,
        None,
    )
    assert control.rollout_dtype == "auto" and control.safe_vocab_effective_rule == "none"
    assert not control.generate_path_importance_sampling and control.seed == remedy.seed


def test_a_task_of_your_own_from_python(tmp_path):
    """run_study(settings, task=...) trains on the task's data with its completion length and reports its metric."""
    settings = StudySettings(
        arms=["no_remedy"],
        seeds=[0],
        steps=2,
        eval_every=1,
        eval_num_prompts=8,
        num_prompts_per_step=2,
        num_generations=4,
        train_num_prompts=16,
        output_dir=str(tmp_path),
    )
    results = run_study(settings, task=study_plugins.exact_match_task(), progress=False, plots=True)
    (run,) = results["runs"]
    assert run["status"] == "ok" and run["eval"]["step"] == [0, 1, 2] and len(run["eval"]["exact_match"]) == 3
    assert results["settings"]["max_completion_length"] == 6  # the task's, as the study sets none
    assert max(run["series"]["completions/max_length"]) <= 6
    assert results["task"]["name"] == "arith-em" and results["task"]["metric_name"] == "exact_match"
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    rows = table_rows(report, "| arm | runs ok | final exact_match | late exact_match | best exact_match")
    assert list(rows) == ["no_remedy"] and 0.0 <= float(rows["no_remedy"][1]) <= 1.0
    assert "](heldout_exact_match.png)" in report and "## Held-out exact_match" in report
    assert_png(tmp_path / "heldout_exact_match.png")
    assert not (tmp_path / "heldout_accuracy.png").exists()


def test_a_study_from_python_leaves_the_callers_logging_and_progress_bars_as_they_were(tmp_path):
    """The study quiets transformers and datasets while it runs; a caller's later trainer keeps its progress bar
    (transformers sets ``disable_tqdm`` from the logging level: once left at "error", every later run had none)."""
    import datasets
    from transformers import TrainingArguments
    from transformers.utils import logging as hf_logging

    settings = StudySettings(
        arms=["no_remedy"],
        seeds=[0],
        steps=1,
        eval_every=1,
        eval_num_prompts=4,
        num_prompts_per_step=2,
        num_generations=2,
        train_num_prompts=8,
        output_dir=str(tmp_path),
    )
    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())
    run_study(settings, task="arithmetic", progress=False, plots=False)
    after = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())
    assert after == before
    if before[0] <= hf_logging.WARNING:
        assert TrainingArguments(output_dir=str(tmp_path / "later"), report_to="none").disable_tqdm is False


#: The CI smoke run: every new option at once, 1 seed, 2 steps (the arms are given per invocation).
SMOKE = [
    "--task", "arithmetic", "--noise", "0.5", "--noise_kind", "lift", "--rollout_mantissa_bits", "3",
    "--rollout_perturbation", "rollout_plugins:lift_half", "--seeds", "0", "--steps", "2", "--eval_every", "2",
    "--eval_num_prompts", "8", "--num_prompts_per_step", "2", "--num_generations", "4", "--train_num_prompts", "16",
    "--quiet",
]  # fmt: skip


def test_smoke_every_new_option_and_resume(tmp_path, monkeypatch, capsys):
    trained = []
    real_train = SafeVocabGRPOTrainer.train

    def counting_train(self, *args, **kwargs):
        trained.append(self.args.safe_vocab_rule)
        return real_train(self, *args, **kwargs)

    monkeypatch.setattr(SafeVocabGRPOTrainer, "train", counting_train)
    out = str(tmp_path / "study")
    rollout_plugins.SEEDS_SEEN.clear()
    assert safevocab_main(["study", *SMOKE, "--arms", "no_remedy", "dvp_mis", "--output_dir", out]) == 0
    first = json.loads((tmp_path / "study" / "results.json").read_text(encoding="utf-8"))
    assert len(trained) == 2 and rollout_plugins.SEEDS_SEEN == [0, 0]
    assert [(r["arm"], r["status"]) for r in first["runs"]] == [("no_remedy", "ok"), ("dvp_mis", "ok")]
    assert first["task"]["spec"] == "arithmetic"  # what --task said (was "arithmetic (a StudyTask object)")

    # The same study with one more arm, resumed: only the new arm trains; the finished runs are kept as they were.
    assert (
        safevocab_main(
            ["study", *SMOKE, "--arms", "no_remedy", "dvp_mis", "no_mismatch", "--resume", "--output_dir", out]
        )
        == 0
    )
    assert "2 finished runs kept" in capsys.readouterr().out
    second = json.loads((tmp_path / "study" / "results.json").read_text(encoding="utf-8"))
    assert len(trained) == 3 and trained[-1] == "none" and rollout_plugins.SEEDS_SEEN == [0, 0]  # no_mismatch: none
    assert (second["runs_trained"], second["runs_resumed"]) == (1, 2)
    assert second["runs"][:2] == first["runs"] and second["started"] == first["started"]
    assert second["wall_time_s"] > first["wall_time_s"]
    summary = second["summary"]
    assert summary["no_remedy"]["log_ppl_gap"]["mean"] > 1e-2  # 3 mantissa bits + lift + the plug-in's lift
    assert summary["no_mismatch"]["log_ppl_gap"]["mean"] < 1e-4  # the matched control: fp32 engines only
    assert summary["dvp_mis"]["is_clipped_frac"]["mean"] is not None
    report = (tmp_path / "study" / "report.md").read_text(encoding="utf-8")
    assert list(table_rows(report, "| arm | runs ok | final accuracy")) == ["no_remedy", "dvp_mis", "no_mismatch"]
    assert "rounded to 3 mantissa bits" in report and "rollout perturbation rollout_plugins:lift_half" in report

    # Resumed again with a different setting, or without a finished run: refused in one line, nothing trained.
    for change, message in (
        (["--noise", "0.4"], "--resume: --noise is 0.4 but the runs in"),
        (["--rollout_mantissa_bits", "4"], "--resume: --rollout_mantissa_bits is 4"),
    ):
        argv = [*SMOKE, *change, "--arms", "no_remedy", "dvp_mis", "no_mismatch", "--resume", "--output_dir", out]
        assert safevocab_main(["study", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert safevocab_main(["study", *SMOKE, "--arms", "no_remedy", "--resume", "--output_dir", out]) == 2
    assert "holds the finished run of arm 'dvp_mis' seed 0" in capsys.readouterr().err
    assert len(trained) == 3
    assert json.loads((tmp_path / "study" / "results.json").read_text(encoding="utf-8")) == second


def test_help_lists_the_new_flags(capsys):
    with pytest.raises(SystemExit):
        safevocab_main(["study", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--task",
        "--rollout_perturbation",
        "--rollout_mantissa_bits",
        "--resume",
        "dvp_mis",
        "no_mismatch",
        "lift",
    ):
        assert flag in text, flag
