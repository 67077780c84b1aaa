"""Resuming from a checkpoint that does not match the run (issue 37: N12 foreign weights, N6 changed settings, N6b a
bad trainer_state.json) and a checkpoint save that runs out of disk space. Real trainers on the tiny model, real
checkpoints; only the files are edited (and, for the full disk, torch.save raises the error a full disk gives)."""

from __future__ import annotations

import errno
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from kill_during_save import make_trainer
from safetensors.torch import load_file, save_file

from trl_integration.harness.resume_settings import SETTINGS_NAME


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def saved_run(tiny_model_dir, tmp_path_factory):
    """A run of 4 steps (linear schedule, learning_rate 1e-2) that kept every checkpoint."""
    out = tmp_path_factory.mktemp("saved")
    trainer = make_trainer(tiny_model_dir, out, save_total_limit=None)
    trainer.train()
    return out, trainer.state.log_history


def checkpoint_copy(saved_run, tmp_path, step: int = 2) -> Path:
    target = tmp_path / "run" / f"checkpoint-{step}"
    shutil.copytree(saved_run[0] / f"checkpoint-{step}", target)
    return target


def refusal(model_dir, tmp_path, checkpoint, **overrides) -> str:
    trainer = make_trainer(model_dir, tmp_path / "run", **overrides)
    with pytest.raises(ValueError) as info:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 0  # refused before anything was trained
    message = str(info.value)
    assert "\n" not in message
    return message


def resumed(model_dir, tmp_path, checkpoint, **overrides):
    """The resumed trainer and the warnings that name ``checkpoint``."""
    trainer = make_trainer(model_dir, tmp_path / "run", **overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(checkpoint))
    return trainer, [str(w.message) for w in caught if str(checkpoint) in str(w.message)]


def logged_lrs(trainer) -> dict[int, float]:
    return {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}


# ----------------------------------------------------------------------------------------------------------------
# N12: weights of another model


def test_weights_with_other_names_are_refused(tiny_model_dir, tmp_path, saved_run):
    """Old code: transformers logs the missing key and trains from the untrained tensor, exit 0."""
    checkpoint = checkpoint_copy(saved_run, tmp_path)
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.mlp.up.weight"] = tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    message = refusal(tiny_model_dir, tmp_path, checkpoint)
    assert message == (
        f"resume_from_checkpoint='{checkpoint}': {checkpoint / 'model.safetensors'} does not hold this model's "
        "weights: 1 of the model's tensors missing (first 'model.layers.0.mlp.up_proj.weight' [64, 32]); 1 unknown to "
        "the model (first 'model.layers.0.mlp.up.weight' [64, 32]); resume from a checkpoint of this model "
        "(LlamaForCausalLM), or load the model it was trained from"
    )


def test_weights_of_another_shape_are_refused(tiny_model_dir, tmp_path, saved_run):
    """Old code: a multi-line RuntimeError from load_state_dict ("size mismatch for ...")."""
    checkpoint = checkpoint_copy(saved_run, tmp_path)
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["lm_head.weight"] = torch.zeros(64, 32)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    message = refusal(tiny_model_dir, tmp_path, checkpoint)
    assert message.startswith(f"resume_from_checkpoint='{checkpoint}': {checkpoint / 'model.safetensors'} does not "
                              "hold this model's weights: 1 of another shape (first 'lm_head.weight': [64, 32] in the "
                              "file, [49, 32] in the model); ")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# N6b: trainer_state.json


@pytest.mark.parametrize("step", [-3, None])
def test_a_bad_global_step_is_one_line_naming_the_file(tiny_model_dir, tmp_path, saved_run, step):
    """Old code: global_step -3 was accepted (and trained); ``{}`` raised a TypeError naming nothing."""
    checkpoint = checkpoint_copy(saved_run, tmp_path)
    path = checkpoint / "trainer_state.json"
    path.write_text("{}" if step is None else json.dumps({**json.loads(path.read_text()), "global_step": step}))
    message = refusal(tiny_model_dir, tmp_path, checkpoint)
    problem = " has no global_step" if step is None else ": global_step=-3 is out of range"
    assert message == f"resume_from_checkpoint='{checkpoint}': {path}{problem}: expected an integer >= 0"


# ----------------------------------------------------------------------------------------------------------------
# N6: settings


def test_a_changed_rule_is_refused_unless_allowed(tiny_model_dir, tmp_path, saved_run):
    """Old code: resumed under the other rule, exit 0, no word."""
    checkpoint = checkpoint_copy(saved_run, tmp_path)
    message = refusal(tiny_model_dir, tmp_path, checkpoint, safe_vocab_rule="top_k=5")
    assert message.startswith(
        f"resume_from_checkpoint='{checkpoint}' was trained with other settings (safevocab_settings.json): "
        "safe_vocab_rule 'min_p=0.001' -> 'top_k=5', safe_vocab_effective_rule 'min_p=0.001' -> 'top_k=5'; "
    )
    assert message.endswith(
        "resume_allow_changed_settings=['safe_vocab_rule', 'safe_vocab_effective_rule'] "
        "(--resume_allow_changed_settings safe_vocab_rule safe_vocab_effective_rule)"
    )
    allowed = ["safe_vocab_rule", "safe_vocab_effective_rule"]
    trainer, messages = resumed(tiny_model_dir, tmp_path, checkpoint, safe_vocab_rule="top_k=5",
                                resume_allow_changed_settings=allowed)  # fmt: skip
    assert trainer.state.global_step == 4
    assert len(messages) == 1 and "safe_vocab_rule 'min_p=0.001' -> 'top_k=5'" in messages[0], messages
    assert messages[0].endswith(f"resume_allow_changed_settings accepts {allowed}")


def test_a_changed_learning_rate_is_honoured_with_a_warning(tiny_model_dir, tmp_path, saved_run):
    """scheduler.pt restores the old base LR: the old code trained steps 3 and 4 at 0.005 and 0.0025 (the linear
    schedule of learning_rate=1e-2) whatever --learning_rate said. Now they train at the new rate's schedule."""
    checkpoint = checkpoint_copy(saved_run, tmp_path)
    assert logged_lrs_of(saved_run[1]) == {1: 0.01, 2: 0.0075, 3: 0.005, 4: 0.0025}
    trainer, messages = resumed(tiny_model_dir, tmp_path, checkpoint, learning_rate=1e-3)
    lrs = logged_lrs(trainer)
    assert lrs[3] == pytest.approx(0.0005, rel=1e-6) and lrs[4] == pytest.approx(0.00025, rel=1e-6), lrs
    assert len(messages) == 1 and messages[0].startswith(
        f"resuming from {checkpoint} with changed settings: learning_rate 0.01 -> 0.001 "
    ), messages
    assert trainer.optimizer.param_groups[0]["initial_lr"] == pytest.approx(1e-3)


def logged_lrs_of(history) -> dict[int, float]:
    return {h["step"]: h["learning_rate"] for h in history if "learning_rate" in h}


def test_max_steps_below_the_checkpoint_step_is_refused(tiny_model_dir, tmp_path, saved_run):
    """Old code: trained one more step (step 3 of max_steps=1), exit 0."""
    checkpoint = checkpoint_copy(saved_run, tmp_path)
    message = refusal(tiny_model_dir, tmp_path, checkpoint, max_steps=1)
    assert message == (
        f"max_steps=1 is below the step of resume_from_checkpoint='{checkpoint}' (global_step=2): accepted "
        "max_steps >= 2, or resume from an earlier checkpoint"
    )


def test_a_checkpoint_without_settings_resumes_with_one_warning(tiny_model_dir, tmp_path, saved_run):
    checkpoint = checkpoint_copy(saved_run, tmp_path)
    (checkpoint / SETTINGS_NAME).unlink()
    trainer, messages = resumed(tiny_model_dir, tmp_path, checkpoint, safe_vocab_rule="top_k=5")
    assert trainer.state.global_step == 4
    assert messages == [
        f"resuming from {checkpoint}, which has no {SETTINGS_NAME} (written by plain trl or an earlier release): its "
        "rule, learning-rate schedule and model cannot be checked against this run's"
    ]


def test_each_checkpoint_stores_its_settings(saved_run):
    settings = json.loads((saved_run[0] / "checkpoint-2" / SETTINGS_NAME).read_text())["settings"]
    assert settings["safe_vocab_rule"] == "min_p=0.001" and settings["rule_engine"] == "hf"
    assert settings["learning_rate"] == 0.01 and settings["lr_scheduler_type"] == "linear"
    assert settings["max_steps"] == 4 and settings["length_decay"] is False
    assert settings["model_config_class"] == "LlamaConfig" and settings["model_hidden_size"] == 32
    assert settings["model_vocab_size"] == 49 and settings["model_num_parameters"] > 0


def test_an_unknown_allowed_setting_is_refused_by_the_config(tmp_path):
    from trl_helpers import grpo_kwargs

    from trl_integration import SafeVocabGRPOConfig

    with pytest.raises(ValueError, match=r"^resume_allow_changed_settings holds 'learning_rate': accepted names of "):
        SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, resume_allow_changed_settings=["learning_rate"]))


# ----------------------------------------------------------------------------------------------------------------
# disk full while saving


TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 1536 vs 1459"


@pytest.mark.parametrize("error", [RuntimeError(TORCH_FULL_DISK), OSError(errno.ENOSPC, "No space left on device")],
                         ids=["torch-writer", "oserror"])  # fmt: skip
@pytest.mark.parametrize("atomic", [True, False])
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tiny_model_dir, tmp_path, monkeypatch, error, atomic):
    """torch.save of step 2's optimizer.pt fails as on a full disk. Old code: torch's RuntimeError (naming neither
    ENOSPC nor the folder) and a staging folder left behind."""
    save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("checkpoint-2/optimizer.pt"):
            raise error
        return save(obj, f, *args, **kwargs)

    out = tmp_path / "run"
    switch = {} if atomic else {"safe_vocab_atomic_checkpoints": False}  # the default: atomic
    trainer = make_trainer(tiny_model_dir, out, max_steps=2, **switch)
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError) as info:
        trainer.train()
    message = str(info.value)
    folder = out / ("_incomplete-checkpoint-2" if atomic else "checkpoint-2")
    assert info.value.errno == errno.ENOSPC and "\n" not in message
    assert message.startswith(f"[Errno 28] saving checkpoint-2 failed in {folder}: ")
    assert "no space left on device (ENOSPC)" in message
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()  # the newest complete checkpoint is untouched
    left = sorted(p.name for p in out.iterdir() if p.is_dir())
    # atomic: nothing of the failed save stays; in place: transformers' partial checkpoint-2 stays, as it leaves it
    assert left == (["checkpoint-1"] if atomic else ["checkpoint-1", "checkpoint-2"]), left


def test_the_command_refuses_a_changed_rule_and_accepts_it_with_the_flag(tiny_model_dir, tmp_path, saved_run, capsys):
    from trl_integration.commands.grpo import main

    checkpoint = checkpoint_copy(saved_run, tmp_path)
    argv = [
        "--model_name_or_path", tiny_model_dir, "--dataset_name", "synthetic", "--output_dir", str(tmp_path / "run"),
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
        "--max_steps", "3", "--report_to", "none", "--save_strategy", "no", "--use_cpu", "true", "--bf16", "false",
        "--no_gradient_checkpointing", "--disable_tqdm", "true", "--resume_from_checkpoint", str(checkpoint),
        "--learning_rate", "0.01", "--safe_vocab_rule", "top_k=5",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"safevocab-grpo: error: resume_from_checkpoint='{checkpoint}' was trained with other "
                           "settings (safevocab_settings.json): safe_vocab_rule 'min_p=0.001' -> 'top_k=5', ")  # fmt: skip
    assert "(--resume_allow_changed_settings safe_vocab_rule safe_vocab_effective_rule)" in last
    with pytest.warns(UserWarning, match="with changed settings: .*safe_vocab_rule 'min_p=0.001' -> 'top_k=5'"):
        assert main(argv + ["--resume_allow_changed_settings", "safe_vocab_rule", "safe_vocab_effective_rule"]) == 0
