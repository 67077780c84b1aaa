"""The bundled testbed model and its free-text task: tokenizer, model, reward, splits, metric, build script, tail.

Everything is measured on the shipped files with transformers and ``generate`` themselves; the reward is checked
against values worked out by hand in the test.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_integration.demo import freetext, testbed
from trl_integration.demo.freetext import (
    MAX_COMPLETION_LENGTH,
    freetext_reward,
    freetext_task,
    held_out_dataset,
    held_out_reward,
    load_task_texts,
    split_text,
    train_dataset,
    unigram_f1,
)
from trl_integration.demo.stdlib_text import is_held_out

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]


def _stdlib_dir() -> Path:
    """The folder the build reads (``stdlib_dir`` of scripts/stdlib_corpus.py, loaded by path)."""
    spec = importlib.util.spec_from_file_location("stdlib_corpus", ROOT / "scripts" / "stdlib_corpus.py")
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    return corpus.stdlib_dir()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(testbed.testbed_model_path(), local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(testbed.testbed_model_path(), local_files_only=True).eval()


# --- tokenizer ----------------------------------------------------------------------------------------------


def test_vocabulary_has_4096_ids_and_grpo_special_tokens(tokenizer, model):
    from trl_integration.grpo.trainer_checks import check_tokenizer

    assert len(tokenizer) >= 4096 and model.config.vocab_size == len(tokenizer) == 4096
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"
    check_tokenizer(tokenizer)  # the project's GRPO checks
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert (
        tokenizer("Return the value")["input_ids"]
        == tokenizer("Return the value", add_special_tokens=False)["input_ids"]
    ), "no BOS/EOS is added when encoding"
    enc = tokenizer(["a", "Return the value of x"], padding=True)
    assert enc["input_ids"][0][0] == tokenizer.pad_token_id and enc["attention_mask"][0][0] == 0


def test_digits_are_split_into_single_digit_tokens(tokenizer):
    text = "In 2024, 12345 users paid $3.50 for version 3.11.7 (x86_64, 0x1F, 1e-10)."
    pieces = [tokenizer.decode([i]) for i in tokenizer(text)["input_ids"]]
    with_digits = [p for p in pieces if any(c.isdigit() for c in p)]
    assert with_digits and all(len(p) == 1 for p in with_digits), with_digits
    assert "".join(pieces) == text


@pytest.mark.parametrize("module", ["textwrap.py", "json/__init__.py", "argparse.py"])
def test_tokenizer_round_trips_stdlib_source(tokenizer, module):
    text = (_stdlib_dir() / module).read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2.5  # merges were learned: BPE, not bytes


def test_tokenizer_round_trips_any_unicode(tokenizer):
    text = "naïve café — ∑ x² ≤ 10⁻³, 日本語, emoji 🙂\ttab\n  indented"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


# --- model --------------------------------------------------------------------------------------------------


def test_model_is_a_1_5m_parameter_llama_with_an_untied_head(model):
    assert isinstance(model, transformers.LlamaForCausalLM)
    n = sum(p.numel() for p in model.parameters())
    assert 1_400_000 <= n <= 1_600_000, n
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 128
    assert model.config.tie_word_embeddings is False
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() != embed.data_ptr() and not torch.equal(head, embed)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_log_probs_are_finite_and_the_model_learned_the_text(model, tokenizer):
    texts = list(load_task_texts()["held_out"][:16])  # never trained on
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logp = model(**enc).logits.float().log_softmax(-1)
    assert torch.isfinite(logp).all()
    targets = enc["input_ids"][:, 1:]
    mask = enc["attention_mask"][:, 1:].bool() & enc["attention_mask"][:, :-1].bool()
    nll = -logp[:, :-1].gather(-1, targets[..., None])[..., 0][mask].mean()
    assert float(nll) < 6.0, f"held-out loss {float(nll):.2f} nats; uniform would be log(4096) = 8.32"


def test_bundle_is_package_data_at_most_8_mb_with_its_build_info():
    folder = testbed.testbed_model_path()
    files = [f for f in folder.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 8 * 2**20
    tomllib = pytest.importorskip("tomllib")
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p for pattern in package_data["trl_integration.demo"] for p in folder.parent.parent.glob(pattern)}
    assert set(files) <= shipped
    info = json.loads((folder / testbed.BUILD_INFO_FILE).read_text())
    for key in (
        "python",
        "corpus_sha256",
        "corpus_texts",
        "corpus_characters",
        "seed",
        "steps",
        "wall_seconds",
        "final_train_loss_ema",
        "held_out_loss",
    ):
        assert key in info, key
    assert info["vocab_size"] == 4096 and info["stopped_by"] == "steps"


def test_missing_files_raise_a_helpful_error(monkeypatch, tmp_path):
    monkeypatch.setattr(testbed, "TESTBED_DIR", tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="scripts/train_testbed_model.py"):
        testbed.testbed_model_path()


# --- reward -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "reference", "reward"),
    [
        ("the cat sat", " the cat sat", 1.0),
        ("The CAT, sat!", "the cat sat", 1.0),  # case and punctuation do not count
        ("the the the", "the cat", 2 * 1 / (3 + 2)),  # clipped: "the" earns once; |c| = 3, |r| = 2
        ("cat sat", "the cat sat on the mat", 2 * 2 / (2 + 6)),  # P = 1, R = 1/3
        ("the mat the mat the", "the cat sat on the mat", 2 * 3 / (5 + 6)),  # the x2 + mat x1 overlap
        ("x_y z", "x_y", 2 * 1 / (2 + 1)),  # an underscore is part of a word
        ("foo.bar", "foo bar", 1.0),  # punctuation separates words
        ("dog", "cat", 0.0),
        ("", "cat sat", 0.0),
        ("   \n", "cat sat", 0.0),
    ],
)
def test_reward_is_rouge1_f1_worked_by_hand(completion, reference, reward):
    assert unigram_f1(completion, reference) == pytest.approx(reward, abs=1e-12)
    assert freetext_reward(["p"], [completion], continuation=[reference]) == [pytest.approx(reward, abs=1e-12)]


def test_reward_takes_conversational_completions_and_checks_lengths():
    chat = [[{"role": "assistant", "content": "cat sat"}]]
    assert freetext_reward(["p"], chat, continuation=["cat sat"]) == [1.0]
    with pytest.raises(ValueError, match="same length"):
        freetext_reward(["p"], ["a", "b"], continuation=["a"])


# --- splits and datasets ------------------------------------------------------------------------------------


def test_split_text_cuts_after_six_words_and_keeps_sixteen():
    text = "Return a random int in the range [0,n).  Defined for n > 0."
    assert split_text(text) == ("Return a random int in the", " range [0,n).  Defined for n > 0.")
    words = " ".join(f"w{i}" for i in range(30))
    prompt, continuation = split_text(words)
    assert prompt == "w0 w1 w2 w3 w4 w5" and continuation == " " + " ".join(f"w{i}" for i in range(6, 22))
    assert split_text("one two three four five six seven eight nine ten eleven") is None  # 11 words


def test_held_out_and_training_prompts_are_disjoint():
    texts = load_task_texts()
    held, train = texts["held_out"], texts["train"]
    assert len(held) >= 200 and len(train) > 5000
    assert all(is_held_out(t) for t in held) and not any(is_held_out(t) for t in train)
    held_prompts = [split_text(t)[0] for t in held]
    assert len(set(held_prompts)) == len(held_prompts)
    assert not set(held_prompts) & {split_text(t)[0] for t in train}
    assert not set(held_out_dataset(len(held))["prompt"]) & set(train_dataset(20_000, seed=3)["prompt"])


def test_datasets_are_fixed_and_seeded():
    held = held_out_dataset(256)
    assert held.column_names == ["prompt", "continuation"] and len(held) == 256
    assert list(held_out_dataset(300)["prompt"])[:256] == list(held["prompt"])
    a, b = train_dataset(100, seed=1), train_dataset(100, seed=1)
    assert list(a["prompt"]) == list(b["prompt"]) and list(a["continuation"]) == list(b["continuation"])
    assert list(train_dataset(300, seed=1)["prompt"])[:100] == list(a["prompt"])
    assert list(train_dataset(100, seed=2)["prompt"]) != list(a["prompt"])
    with pytest.raises(ValueError, match="num_prompts=100000"):
        held_out_dataset(100_000)


# --- the held-out metric and the study task -----------------------------------------------------------------


def _greedy_by_hand(model, tokenizer, prompt: str) -> str:
    """Greedy decoding without ``generate``, padding or a KV cache: argmax, append, repeat."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(MAX_COMPLETION_LENGTH):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_held_out_metric_scores_completions_and_keeps_the_rng(model, tokenizer):
    data = held_out_dataset(8)
    expected = sum(unigram_f1(_greedy_by_hand(model, tokenizer, r["prompt"]), r["continuation"]) for r in data) / 8
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    greedy = held_out_reward(model, tokenizer, data, do_sample=False, batch_size=8)  # left-padded batch, KV cache
    assert greedy == pytest.approx(expected, abs=1e-9)
    sampled = held_out_reward(model, tokenizer, data, seed=5)  # the task's metric: sampled at T = 1, seeded
    assert torch.equal(torch.random.get_rng_state(), state)
    assert sampled == held_out_reward(model, tokenizer, data, seed=5) != held_out_reward(model, tokenizer, data, seed=6)
    assert 0.0 < sampled < 1.0 and 0.0 < greedy < 1.0
    # min_p samples from the rule's safe vocabulary: min_p=1 keeps only the most probable token (greedy), a small
    # min_p changes some completions but not the RNG state
    assert held_out_reward(model, tokenizer, data, seed=5, min_p=1.0) == pytest.approx(greedy, abs=1e-9)
    assert held_out_reward(model, tokenizer, data, seed=5, min_p=0.05) != sampled
    assert torch.equal(torch.random.get_rng_state(), state)
    model.train()
    for bad in (0.0, 1.5, float("nan")):  # one line naming min_p; the model is left as it was
        with pytest.raises(ValueError, match=r"min_p=.* is out of range: accepted a float in \(0, 1\]"):
            held_out_reward(model, tokenizer, data, min_p=bad)
        assert model.training
    for bad in ("0.01", True):  # not a number (True would mean 1.0, greedy): the project's TypeError line
        with pytest.raises(TypeError, match=r"min_p must be a real number"):
            held_out_reward(model, tokenizer, data, min_p=bad)
        assert model.training
    with pytest.raises(ValueError, match=r"min_p=0\.01 needs do_sample=True"):
        held_out_reward(model, tokenizer, data, min_p=0.01, do_sample=False)
    assert model.training
    model.eval()


def test_freetext_task_is_a_study_task():
    from trl_integration.task import StudyTask

    task = freetext_task()
    assert isinstance(task, StudyTask) and task.name == "freetext" and task.metric_name == "reward"
    assert Path(task.model_path) == testbed.testbed_model_path() and task.max_completion_length == MAX_COMPLETION_LENGTH
    rows = task.train_dataset(4, 0)
    assert rows.column_names == ["prompt", "continuation"]
    rewards = task.reward_funcs[0](
        prompts=rows["prompt"],
        completions=list(rows["continuation"]),
        continuation=rows["continuation"],
        completion_ids=None,
        trainer_state=None,
    )
    assert rewards == [1.0] * 4
    assert task.held_out_metric is held_out_reward and len(task.held_out_dataset(200)) == 200


def test_arithmetic_task_is_a_study_task():
    from trl_integration.demo.arithmetic import accuracy, arithmetic_reward, make_dataset
    from trl_integration.demo.arithmetic_task import arithmetic_task
    from trl_integration.demo.model import tiny_model_path

    task = arithmetic_task()
    assert task.name == "arithmetic" and Path(task.model_path) == tiny_model_path()
    assert list(task.train_dataset(50, 3)["prompt"]) == list(make_dataset(50, seed=3, split="train")["prompt"])
    assert list(task.held_out_dataset(50)["prompt"]) == list(make_dataset(50, seed=1, split="test")["prompt"])
    assert list(task.reward_funcs) == [arithmetic_reward] and task.held_out_metric is accuracy
    assert task.metric_name == "accuracy" and task.max_completion_length is None  # the study's default (8) applies


# --- the build script ---------------------------------------------------------------------------------------


def _build(out: Path, seed: int) -> dict:
    args = [
        "--max-files",
        "25",
        "--vocab-size",
        "300",
        "--steps",
        "3",
        "--batch-tokens",
        "512",
        "--threads",
        "1",
        "--seed",
        str(seed),
        "--output",
        str(out),
        "--no-progress",
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_testbed_model.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in out.iterdir() if f.is_file()}


def test_build_script_starts_from_its_checkout(tmp_path):
    """-I: neither PYTHONPATH nor the script's folder is on sys.path, and the working directory is elsewhere; the
    script finds its checkout's package and its sibling modules (scripts/bpe_tokenizer.py, ...) by itself."""
    proc = subprocess.run(
        [sys.executable, "-I", str(ROOT / "scripts" / "train_testbed_model.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--steps" in proc.stdout and "--output" in proc.stdout


@pytest.mark.slow
def test_build_script_runs_end_to_end_and_is_bit_reproducible(tmp_path):
    first, again, other = (_build(tmp_path / name, seed) for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    same = set(testbed.TESTBED_MODEL_FILES) | {"config.json", "generation_config.json", freetext.TASK_TEXTS_FILE}
    assert same <= set(first)
    assert {k: first[k] for k in same} == {k: again[k] for k in same}
    assert first["model.safetensors"] != other["model.safetensors"]  # the seed matters
    assert first["tokenizer.json"] == other["tokenizer.json"]  # the tokenizer does not depend on it
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tokenizer) == 300 == model.config.vocab_size
    info = json.loads((tmp_path / "a" / testbed.BUILD_INFO_FILE).read_text())
    assert info["steps"] == 3 and info["seed"] == 0 and info["python"] == sys.version.split()[0]
    assert info["corpus_texts"] > 0 and len(info["corpus_sha256"]) == 64


# --- the tail -----------------------------------------------------------------------------------------------


def _sample_with_noise(model, tokenizer, prompts, eps: float, seed: int):
    """log pi(y) and log mu(y) of tokens sampled from mu = softmax(z + delta), delta ~ U[-eps, eps], by hand."""
    gen = torch.Generator().manual_seed(seed)
    log_pi, log_mu = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            for _ in range(MAX_COMPLETION_LENGTH):
                z = model(input_ids=ids).logits[0, -1].float()
                noisy = (z + (torch.rand(z.shape, generator=gen) * 2 - 1) * eps).log_softmax(-1)
                token = int(torch.multinomial(noisy.exp(), 1, generator=gen))
                log_pi.append(float(z.log_softmax(-1)[token]))
                log_mu.append(float(noisy[token]))
                if token == tokenizer.eos_token_id:
                    break
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return torch.tensor(log_pi), torch.tensor(log_mu)


def test_the_free_text_task_keeps_the_policy_in_the_tail(model, tokenizer):
    prompts = list(held_out_dataset(64)["prompt"])
    log_pi, _ = _sample_with_noise(model, tokenizer, prompts, eps=0.0, seed=0)
    assert float((log_pi.exp() < 0.01).float().mean()) > 0.25  # a quarter of the sampled tokens or more
    log_pi, log_mu = _sample_with_noise(model, tokenizer, prompts, eps=1.0, seed=0)
    p, diff = log_pi.exp(), log_mu - log_pi
    tail, head = diff[p < 1e-2], diff[p >= 0.5]
    assert tail.numel() > 300 and head.numel() >= 15
    assert 0.05 < float(tail.mean()) < 0.35  # positive: the noisy sampler over-weights the tail tokens it drew
    assert abs(float(head.mean())) < 0.2  # and hardly the head (where mu ~ pi); few tokens, hence the margin


def test_rule_eval_example_task_scores_on_the_rules_support(model, tokenizer):
    """examples/study_task_rule_eval.py loads through ``--task``'s loader and samples its held-out completions
    under min_p=0.01 (the same numbers as `held_out_reward` with that rule, not the full distribution's)."""
    from trl_integration.study.tasks import load_task

    task = load_task("examples.study_task_rule_eval:freetext_rule_eval_task")
    assert task.name == "freetext_rule_eval" and task.metric_name == "reward_min_p"
    data = held_out_dataset(8)
    ruled = task.held_out_metric(model, tokenizer, data)
    assert ruled == held_out_reward(model, tokenizer, data, min_p=0.01)
    assert ruled != held_out_reward(model, tokenizer, data)
