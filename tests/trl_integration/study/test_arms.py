"""``safevocab study`` for Study 3 (issue 42): the truncated sampler (``--sampler_rule``), real bf16 rollouts
(``--rollout_dtype bfloat16``), the ``dvp_tis`` arm, the new contrasts and the code version every record carries;
short runs on the bundled tiny model through real trl trainers, each proving a condition or arm does what it says."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from trl_integration.commands import main as safevocab_main
from trl_integration.grpo.config import SafeVocabGRPOConfig
from trl_integration.grpo.trainer import SafeVocabGRPOTrainer
from trl_integration.study import ARM_NAMES, StudySettings, arm_overrides, run_study
from trl_integration.study.arms import shared_config
from trl_integration.study.contrasts import CONTRASTS
from trl_integration.study.provenance import check_code_versions, code_version

REPO = Path(__file__).resolve().parents[3]

#: A one-step study on the bundled tiny arithmetic model (1 seed, 2 prompts x 4 completions).
TINY = {
    "task": "arithmetic",
    "seeds": [0],
    "steps": 1,
    "eval_every": 1,
    "eval_num_prompts": 4,
    "num_prompts_per_step": 2,
    "num_generations": 4,
    "train_num_prompts": 8,
    "noise": 0.0,
}


def _config(arm: str, settings: StudySettings, tmp_path) -> SafeVocabGRPOConfig:
    return SafeVocabGRPOConfig(**{**shared_config(settings, 0, str(tmp_path)), **arm_overrides(arm, settings)})


def test_trunc_arms_sample_with_the_rule_and_only_dvp_trains_on_it(tmp_path):
    """The stock arms (no_remedy, tis) sample under the rule but score the full softmax (trl with vLLM's min_p); the
    dvp arms sample and score under it; the no-mismatch controls sample from the full distribution."""
    s = StudySettings(sampler_rule="min_p=0.05", dvp_rule="min_p=0.05", max_completion_length=8)
    for arm in ("no_remedy", "tis", "mis"):
        config = _config(arm, s, tmp_path)
        assert str(config.sampler_rule) == "min_p=0.05" and config.safe_vocab_effective_rule == "none", arm
        assert config.rollout_logprobs and not config.safe_vocab_in_sampler, arm
    assert _config("tis", s, tmp_path).generate_path_importance_sampling
    for arm in ("dvp", "dvp_tis", "dvp_no_mismatch"):
        config = _config(arm, s, tmp_path)
        assert str(config.sampler_rule) == config.safe_vocab_effective_rule == "min_p=0.05", arm
    dvp_tis, tis = _config("dvp_tis", s, tmp_path), _config("tis", s, tmp_path)
    assert dvp_tis.generate_path_importance_sampling
    for key in (
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
    ):
        assert getattr(dvp_tis, key) == getattr(tis, key), key
    control = _config("no_mismatch", s, tmp_path)
    assert str(control.sampler_rule) == control.safe_vocab_effective_rule == "none"
    # without --sampler_rule the arms are what Study 2 trained (a resumed Study 2 folder still matches)
    plain = StudySettings()
    assert arm_overrides("no_remedy", plain) == {
        "safe_vocab_rule": "none",
        "vllm_importance_sampling_correction": False,
    }
    assert "top_p" not in arm_overrides("no_mismatch", plain) and "min_p" not in shared_config(plain, 0, "x")


def test_dvp_tis_arm_and_the_registered_contrasts_exist():
    assert "dvp_tis" in ARM_NAMES
    assert CONTRASTS["dvp_minus_tis"][0] == {"dvp": 1, "tis": -1}
    assert CONTRASTS["dvp_residual_clean"][0] == {"dvp": 1, "no_mismatch": -1}
    assert CONTRASTS["dvp_tis_minus_dvp"][0] == {"dvp_tis": 1, "dvp": -1}


@pytest.mark.parametrize(
    "rule, message",
    [
        ("none", "--sampler_rule 'none' is not accepted: accepted a rule a sampler applies that prunes"),
        ("min_prob=0.001", "--sampler_rule 'min_prob=0.001' is not accepted: accepted a rule a sampler applies"),
        ("top_p=2", "top_p"),
    ],
)
def test_sampler_rule_errors_are_one_line_naming_the_flag(rule, message, tmp_path, capsys):
    with pytest.raises(ValueError) as err:
        StudySettings(sampler_rule=rule).validate()
    assert message in str(err.value) and "\n" not in str(err.value)
    assert safevocab_main(["study", "--sampler_rule", rule, "--output_dir", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def _last(run: dict, key: str) -> float:
    return run["series"][key][-1]


def test_trunc_short_run_stock_scores_full_softmax_dvp_none_and_records_carry_the_commit(tmp_path):
    """One step each: under tis the recorded rollout log-prob of every token is above the trainer's (log mu - log pi
    = -log Z >= 0, the kept mass, so the mean signed gap equals the mean absolute gap and every IS ratio is below 1);
    under dvp_tis the two agree to float precision. results.json records git's HEAD and whether the tree was clean."""
    settings = StudySettings(
        **TINY, arms=["tis", "dvp_tis"], sampler_rule="min_p=0.05", dvp_rule="min_p=0.05", output_dir=str(tmp_path)
    )
    results = run_study(settings, progress=False, plots=False)
    tis, dvp_tis = results["runs"]
    assert tis["status"] == dvp_tis["status"] == "ok"
    gap, abs_gap = _last(tis, "mismatch/kl"), _last(tis, "mismatch/abs_logp_diff_mean")
    assert gap > 1e-3 and abs_gap == pytest.approx(gap, rel=1e-6)  # every token: log mu >= log pi
    assert _last(tis, "sampling/importance_sampling_ratio/max") < 1.0  # the ratio reads the kept mass
    assert abs(_last(dvp_tis, "mismatch/abs_logp_diff_mean")) < 1e-5
    assert _last(dvp_tis, "sampling/importance_sampling_ratio/min") > 1 - 1e-5
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    clean = (
        subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        == ""
    )
    assert results["code"]["commit"] == head and results["code"]["clean"] is clean
    assert all(run["code"] == results["code"] for run in results["runs"])
    assert "rollouts sampled with min_p=0.05" in (tmp_path / "report.md").read_text(encoding="utf-8")
    assert f"git {head[:12]}" in (tmp_path / "report.md").read_text(encoding="utf-8")


def test_bf16_short_run_rolls_out_in_bf16_against_the_fp32_trainer(tmp_path, monkeypatch):
    """``--rollout_dtype bfloat16``: the rollout's logits come out of a bf16 forward (no_grad, generation) while every
    forward the trainer differentiates is fp32, and the logged gap is bf16-sized; the no_mismatch control is fp32
    throughout and has no gap."""
    seen: dict[str, set] = {}
    real_train = SafeVocabGRPOTrainer.train

    def spying_train(self, *args, **kwargs):
        arm = "no_mismatch" if self.args.rollout_dtype == "auto" else "no_remedy"

        def hook(module, inputs, output):
            seen.setdefault(arm, set()).add((torch.is_grad_enabled(), output.dtype))

        # the LM head (the rollout's logits; the trainer's fused scoring reads its weight without calling it) and the
        # first projection of the first block (called by the rollout and by the trainer's differentiated forward)
        head = self.model.get_output_embeddings()
        first = next(m for m in self.model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
        handles = [module.register_forward_hook(hook) for module in (head, first)]
        try:
            return real_train(self, *args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

    monkeypatch.setattr(SafeVocabGRPOTrainer, "train", spying_train)
    settings = StudySettings(
        **TINY, arms=["no_remedy", "no_mismatch"], rollout_dtype="bfloat16", output_dir=str(tmp_path)
    )
    stock, control = run_study(settings, progress=False, plots=False)["runs"]
    assert (False, torch.bfloat16) in seen["no_remedy"]  # the rollout
    assert {dtype for grad, dtype in seen["no_remedy"] if grad} == {torch.float32}  # the trainer
    assert {dtype for _, dtype in seen["no_mismatch"]} == {torch.float32}
    assert _last(stock, "mismatch/abs_logp_diff_mean") > 1e-4
    assert _last(control, "mismatch/abs_logp_diff_mean") < 1e-5


def test_code_version_of_a_checkout_and_of_no_checkout(tmp_path):
    version = code_version(REPO)
    assert len(version["commit"]) == 40 and isinstance(version["clean"], bool)
    assert code_version(tmp_path) == {"commit": None, "clean": None, "dirty": [], "root": str(tmp_path)}
    (tmp_path / "f").write_text("x")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(
        ["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"],
        cwd=tmp_path,
        check=True,
    )
    dirty = code_version(tmp_path)
    assert dirty["clean"] is False and dirty["dirty"] == ["?? f"]


def test_check_code_versions_counts_runs_per_commit():
    def study(*commits):
        return {
            "runs": [
                {"arm": "a", "seed": i, "status": "ok", "code": {"commit": c, "clean": True}}
                for i, c in enumerate(commits)
            ]
            + [{"arm": "a", "seed": 9, "status": "failed"}]
        }

    assert check_code_versions([("x", study("c1", "c1"))]) == {"commits": {"c1": 2}, "dirty_runs": [], "mixed": False}
    with pytest.raises(ValueError, match=r"^the records come from 2 code versions .*y: a seed 0"):
        check_code_versions([("x", study("c1")), ("y", study("c2"))])
    assert check_code_versions([("x", study("c1")), ("y", study("c2"))], allow_mixed_commits=True)["mixed"]


def test_the_figures_subtitle_names_the_truncated_sampler():
    """A ``trunc`` study's figures say what its mismatch is: the subtitle once read "no injected noise, rollout auto"
    under ``--sampler_rule min_p=0.05``, as if the stock arms had none."""
    from trl_integration.study.plots import mismatch_label

    trunc = {"noise": 0.0, "noise_kind": "uniform", "rollout_dtype": "auto", "sampler_rule": "min_p=0.05"}
    assert mismatch_label(trunc) == "no injected noise, rollouts sampled with min_p=0.05, rollout auto"
    for untruncated in ({**trunc, "sampler_rule": None}, {**trunc, "sampler_rule": "none"}):
        assert mismatch_label(untruncated) == "no injected noise, rollout auto"
