"""The bundled tiny arithmetic model and its task: loading offline, tokenizer, reward, datasets, accuracy band.

The accuracy checks are measured here on the shipped weights (nothing is hard-coded from the training log):
the model must be partly right, which is what makes it a useful GRPO starting point.
"""

from __future__ import annotations

import pytest
import torch

from trl_integration.demo import model as model_module
from trl_integration.demo.arithmetic import (
    MAX_ANSWER_CHARS,
    OPERATIONS,
    accuracy,
    arithmetic_reward,
    is_test_problem,
    make_dataset,
    parse_answer,
)
from trl_integration.demo.model import tiny_model_path

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(tiny_model_path(), local_files_only=True)


@pytest.fixture(scope="module")
def model():
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path(), local_files_only=True)
    return model.eval()


# --- assets -------------------------------------------------------------------------------------------------


def test_bundled_model_loads_offline(model, tokenizer):
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.config.vocab_size == len(tokenizer)
    assert model.get_output_embeddings().weight.shape[0] == len(tokenizer)
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>" and tokenizer.bos_token == "<bos>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert (tiny_model_path() / "model.safetensors").is_file()


def test_total_asset_size_at_most_10_mb():
    files = [f for f in tiny_model_path().rglob("*") if f.is_file()]
    assert files
    total = sum(f.stat().st_size for f in files)
    assert total <= 10 * 2**20, f"bundled model is {total / 2**20:.2f} MiB"


def test_missing_weights_raise_a_helpful_error(monkeypatch, tmp_path):
    monkeypatch.setattr(model_module, "TINY_MODEL_DIR", tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="scripts/train_tiny_model.py"):
        tiny_model_path()


def test_the_model_ships_as_package_data_of_the_demo():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[3]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    folder = Path(model_module.__file__).parent
    shipped = {p for pattern in package_data["trl_integration.demo"] for p in folder.glob(pattern)}
    assert {tiny_model_path() / name for name in model_module.TINY_MODEL_FILES} <= shipped


def test_the_tokenizer_built_in_code_is_the_shipped_one(tokenizer):
    from trl_integration.demo.tokenizer import build_tokenizer

    built = build_tokenizer()
    assert built.get_vocab() == tokenizer.get_vocab()
    text = "587-926=-339"
    assert built(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (built.pad_token, built.bos_token, built.eos_token) == (
        tokenizer.pad_token,
        tokenizer.bos_token,
        tokenizer.eos_token,
    )


def test_training_script_runs_and_writes_where_the_package_reads(tmp_path):
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "scripts" / "train_tiny_model.py"
    # -I: neither PYTHONPATH nor the script's folder is on sys.path, and the working directory is elsewhere; the
    # script finds its checkout's package and its sibling modules by itself
    proc = subprocess.run(
        [sys.executable, "-I", str(script), "--help"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "--stop-at" in proc.stdout and "--output-dir" in proc.stdout
    spec = importlib.util.spec_from_file_location("train_tiny_model", script)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    assert train.DEFAULT_OUTPUT == tiny_model_path()  # it writes where the package reads


# --- tokenizer ----------------------------------------------------------------------------------------------


def test_tokenizer_round_trips_task_strings_one_token_per_character(tokenizer):
    rows = make_dataset(50, seed=3, split="train", operations="+-*")
    for prompt, answer in zip(rows["prompt"], rows["answer"]):
        text = prompt + answer
        ids = tokenizer(text)["input_ids"]  # default add_special_tokens=True, as trl calls it
        assert len(ids) == len(text), "no BOS/EOS is added and every character is one token"
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text
        with_eos = ids + [tokenizer.eos_token_id]
        assert tokenizer.decode(with_eos, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer(" 12 = 3 ")["input_ids"]) == " 12 = 3 "


def test_tokenizer_left_pads_batches(tokenizer):
    enc = tokenizer(["1+1=", "123-45="], padding=True, return_tensors="pt")
    assert enc["input_ids"][0, :3].tolist() == [tokenizer.pad_token_id] * 3
    assert enc["attention_mask"][0].tolist() == [0, 0, 0, 1, 1, 1, 1]


# --- reward -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("85", "85", 1.0),
        ("85<eos>", "85", 1.0),  # a decoded special token is trailing junk
        ("85 junk 12", "85", 1.0),
        ("85=85", "85", 1.0),
        ("85+", "85", 1.0),
        ("  85", "85", 1.0),  # leading whitespace is skipped
        ("-12", "-12", 1.0),
        ("0", "0", 1.0),
        (" 85\n", 85, 1.0),  # int answers are accepted
        ("851", "85", 0.0),  # digits continue the number
        ("8", "85", 0.0),
        ("085", "85", 0.0),  # not canonical
        ("+85", "85", 0.0),
        ("-0", "0", 0.0),
        ("12", "-12", 0.0),
        ("=85", "85", 0.0),
        ("x85", "85", 0.0),
        ("", "85", 0.0),
        ("-", "85", 0.0),
    ],
)
def test_reward_scores_as_documented(completion, answer, reward):
    assert arithmetic_reward(["37+48="], [completion], [answer]) == [reward]


def test_reward_accepts_conversational_completions_and_checks_lengths():
    completions = [[{"role": "assistant", "content": "85 and more"}], [{"role": "assistant", "content": "84"}]]
    assert arithmetic_reward(["a", "b"], completions, answer=["85", "85"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="same length"):
        arithmetic_reward(["a"], ["1", "2"], answer=["1"])


def test_parse_answer():
    assert parse_answer(" -42xyz") == "-42"
    assert parse_answer("abc") is None


# --- datasets -----------------------------------------------------------------------------------------------


def test_datasets_are_deterministic_and_answers_correct():
    a = make_dataset(200, seed=7, split="train")
    b = make_dataset(200, seed=7, split="train")
    assert a.column_names == ["prompt", "answer"]
    prompts, answers = list(a["prompt"]), list(a["answer"])
    assert len(prompts) == 200
    assert list(b["prompt"]) == prompts and list(b["answer"]) == answers
    assert list(make_dataset(300, seed=7)["prompt"])[:200] == prompts  # a larger n extends a smaller one
    assert list(make_dataset(200, seed=8)["prompt"]) != prompts
    assert list(make_dataset(200, seed=7, split="test")["prompt"]) != prompts
    for prompt, answer in zip(prompts, answers):
        assert prompt.endswith("=") and all(isinstance(x, str) for x in (prompt, answer))
        op = next(c for c in prompt[1:] if c in OPERATIONS)
        left, right = prompt[:-1].split(op, 1)
        assert answer == str(OPERATIONS[op](int(left), int(right)))
        assert len(answer) <= MAX_ANSWER_CHARS


def test_train_and_test_splits_are_disjoint():
    train = make_dataset(5000, seed=0, split="train")
    test = make_dataset(1000, seed=0, split="test")
    assert not set(train["prompt"]) & set(test["prompt"])
    assert all(is_test_problem(p) for p in test["prompt"])
    assert not any(is_test_problem(p) for p in train["prompt"])
    # The test split is a real sample of the task (about 10% of problems), not a corner of it.
    assert len(set(test["prompt"])) > 800 and len(set(train["prompt"])) > 4000
    assert {p for p in test["prompt"] if "-" in p} and {p for p in test["prompt"] if "+" in p}


def test_dataset_rejects_bad_options():
    with pytest.raises(ValueError, match="split"):
        make_dataset(4, split="validation")
    with pytest.raises(ValueError, match="operations"):
        make_dataset(4, operations="/")
    with pytest.raises(ValueError, match="max_digits"):
        make_dataset(4, min_digits=3, max_digits=2)


# --- the model is partly right -------------------------------------------------------------------------------


def test_greedy_accuracy_is_in_an_informative_band(model, tokenizer):
    test = make_dataset(100, seed=123, split="test")
    acc = accuracy(model, tokenizer, test)
    assert 0.05 < acc < 0.95, acc


def test_sampled_accuracy_is_nonzero(model, tokenizer):
    test = make_dataset(100, seed=321, split="test")
    acc = accuracy(model, tokenizer, test, do_sample=True, temperature=1.0, seed=0)
    assert 0.0 < acc < 0.95, acc
    assert acc == accuracy(model, tokenizer, test, do_sample=True, temperature=1.0, seed=0)  # seeded


def test_untrained_model_of_the_same_shape_scores_about_zero(model, tokenizer):
    """The accuracy band above is informative: the same architecture, untrained, gets (almost) nothing right."""
    torch.manual_seed(0)
    untrained = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    assert accuracy(untrained, tokenizer, make_dataset(100, seed=123, split="test")) < 0.05


def test_left_padding_does_not_change_greedy_completions(model, tokenizer):
    """GRPO batches prompts of different lengths with left padding; the completions must not depend on it."""
    prompts = ["4+7=", "37+48=", "587-926=", "9-42="]
    batched = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batched, max_new_tokens=MAX_ANSWER_CHARS + 1, do_sample=False)
    texts = tokenizer.batch_decode(out[:, batched["input_ids"].shape[1] :], skip_special_tokens=True)
    for prompt, text in zip(prompts, texts):
        single = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            alone = model.generate(**single, max_new_tokens=MAX_ANSWER_CHARS + 1, do_sample=False)
        assert tokenizer.decode(alone[0, single["input_ids"].shape[1] :], skip_special_tokens=True) == text
