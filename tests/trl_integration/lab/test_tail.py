"""The tail diagnostic (``safevocab diagnose``'s first output): sampled tokens, their recorded rollout
log-probabilities against independent recomputations, the signed per-bucket mismatch against numpy, and the command
(``--noise_kind lift``, ``--rollout_mantissa_bits``, ``--task``, ``--input`` as free text)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from trl_helpers import build_model, build_tokenizer

from trl_integration.commands import main
from trl_integration.lab import tail_buckets, tail_mismatch
from trl_integration.lab.tail import sample_tokens

PROMPTS = ["hello world.", "the cat sat on", "1+1=2, 2+2=", "abc", "go", "once upon a time"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return build_model(tok, head_scale=4.0).eval(), tok


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("tail-model")
    tiny[0].save_pretrained(path)
    tiny[1].save_pretrained(path)
    return str(path)


def full_forward_logits(model, sampled):
    attn = torch.cat([torch.ones(sampled.sequences.shape[0], sampled.prompt_length, dtype=torch.bool), sampled.mask], 1)
    attn[:, : sampled.prompt_length] = sampled.sequences[:, : sampled.prompt_length] != 0  # left padding (pad id 0)
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=sampled.sequences, attention_mask=attn.long(), position_ids=pos).logits
    return logits[:, sampled.prompt_length - 1 : -1].double()


def test_lift_tokens_are_recorded_under_the_lifted_distribution(tiny):
    """log mu of each sampled token is the lifted softmax of the clean model's logits (numpy's lift), log pi the
    clean one; the tokens the lift favours (the tail) have log mu > log pi."""
    model, tok = tiny
    temperature = 0.9
    sampled = sample_tokens(
        model,
        model,
        tok,
        PROMPTS,
        max_new_tokens=8,
        num_samples=4,
        temperature=temperature,
        noise=1.0,
        noise_kind="lift",
        seed=3,
    )
    z = full_forward_logits(model, sampled) / temperature
    zn = z.numpy()
    lifted = zn + 1.0 * np.minimum(1.0, (zn.max(-1, keepdims=True) - zn) / 10.0)
    new = sampled.sequences[:, sampled.prompt_length :].numpy()
    pick = lambda a: np.take_along_axis(a, new[..., None], -1)[..., 0]  # noqa: E731
    log_softmax = lambda a: a - np.logaddexp.reduce(a, axis=-1, keepdims=True)  # noqa: E731
    m = sampled.mask.numpy()
    np.testing.assert_allclose(sampled.rollout_logp.numpy()[m], pick(log_softmax(lifted))[m], atol=2e-5)
    np.testing.assert_allclose(sampled.train_logp.numpy()[m], pick(log_softmax(zn))[m], atol=2e-5)
    # the top token loses probability, and the further a token lies below the top, the more it gains
    signed = (sampled.rollout_logp - sampled.train_logp).numpy()[m]
    gap = (zn.max(-1) - pick(zn))[m]
    assert signed[gap == 0].max() <= 1e-6 and (gap == 0).any()
    assert signed[gap > np.median(gap)].mean() > signed[gap <= np.median(gap)].mean() + 0.05


def test_mantissa_bits_sample_from_the_rounded_model(tiny):
    model, tok = tiny
    result = {}
    for bits in (7, None):
        cache_model = model
        if bits is not None:  # independent reference: torch's bfloat16 conversion of every weight
            cache_model = copy.deepcopy(model)
            with torch.no_grad():
                for p in cache_model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        result[bits] = sample_tokens(model, cache_model, tok, PROMPTS, max_new_tokens=6, num_samples=2, seed=1)
    via_lab = tail_mismatch(
        model,
        tok,
        {"task": PROMPTS},
        mantissa_bits=7,
        max_new_tokens=6,
        num_samples=2,
        seed=1,
        batch_size=len(PROMPTS),
        progress=False,
    )
    reference = tail_buckets(
        result[7].train_logp[result[7].mask], result[7].rollout_logp[result[7].mask], [0.001, 0.01, 0.1, 0.5]
    )
    assert via_lab["sources"]["task"]["buckets"] == reference["buckets"]  # the lab's rounding is bf16's at k=7
    assert (result[7].rollout_logp - result[7].train_logp)[result[7].mask].abs().max() > 1e-4
    assert (result[None].rollout_logp - result[None].train_logp)[result[None].mask].abs().max() < 1e-5


def test_no_mismatch_gives_zero_within_float_rounding(tiny):
    model, tok = tiny
    out = tail_mismatch(
        model, tok, {"task": PROMPTS, "free_text": PROMPTS[::-1]}, max_new_tokens=8, num_samples=4, progress=False
    )
    for source in ("task", "free_text"):
        data = out["sources"][source]
        assert data["n_tokens"] > 50 and abs(data["signed_mean"]) < 1e-6
        for row in data["buckets"]:
            assert row["n"] == 0 or abs(row["signed_mean"]) < 1e-5, row
        assert sum(r["n"] for r in data["buckets"]) == data["n_tokens"]


def test_zero_mean_noise_still_shows_a_positive_mean_on_sampled_tokens(tiny):
    """On tokens sampled from mu, mean(log mu - log pi) estimates KL(mu || pi) > 0, even for zero-mean noise."""
    model, tok = tiny
    out = tail_mismatch(
        model,
        tok,
        {"task": PROMPTS * 4},
        noise=1.0,
        noise_kind="uniform",
        max_new_tokens=8,
        num_samples=4,
        progress=False,
    )
    data = out["sources"]["task"]
    assert data["signed_mean"] > 5 * max(r["signed_se"] or 0 for r in data["buckets"] if r["n"] > 100)


def test_tail_buckets_match_numpy():
    g = np.random.default_rng(0)
    train = np.log(g.uniform(1e-5, 1.0, 3000))
    rollout = train + g.normal(0.1, 0.3, 3000)
    edges = [0.001, 0.01, 0.1, 0.5]
    out = tail_buckets(torch.tensor(train), torch.tensor(rollout), edges)
    which = np.digitize(np.exp(train), edges, right=False)  # bucket j: edges[j-1] <= p < edges[j]
    for j, row in enumerate(out["buckets"]):
        values = (rollout - train)[which == j]
        assert row["n"] == values.size and row["frac"] == pytest.approx(values.size / 3000)
        assert row["signed_mean"] == pytest.approx(values.mean(), rel=1e-9)
        assert row["signed_se"] == pytest.approx(values.std(ddof=1) / np.sqrt(values.size), rel=1e-9)
    assert out["signed_mean"] == pytest.approx((rollout - train).mean())


def run(argv, out):
    assert (
        main(
            [
                "diagnose",
                *argv,
                "--output_dir",
                str(out),
                "--quiet",
                "--tail_prompts",
                "8",
                "--tail_samples",
                "2",
                "--tail_new_tokens",
                "6",
            ]
        )
        == 0
    )
    return json.loads((out / "summary.json").read_text())


def test_command_writes_the_tail_first(tmp_path):
    """The bundled model (a fixed, trained model with a real tail) under the lift: the signed mismatch of the
    sampled tokens is positive in every bucket below p = 0.1 and negative above 0.5, on both sources."""
    from trl_integration.demo.model import tiny_model_path

    try:
        tiny_model_path()
    except FileNotFoundError:
        pytest.skip("the bundled tiny model is not built in this checkout")
    texts = tmp_path / "free.txt"
    texts.write_text("the quick brown fox\njumps over the lazy dog\n12+7=19, 5*5=25\n", encoding="utf-8")
    s = run(["--noise", "1", "--noise_kind", "lift", "--input", str(texts)], tmp_path)
    assert list(s)[0] == "tail" and s["files"][:2] == ["summary.json", "tail_mismatch.png"]
    tail = s["tail"]
    assert set(tail["sources"]) == {"task", "free_text"}
    assert tail["labels"] == {"task": "arithmetic prompts", "free_text": "free text (free.txt)"}
    assert tail["sources"]["free_text"]["n_prompts"] == 3 and tail["sources"]["task"]["n_prompts"] == 8
    for data in tail["sources"].values():
        low = [r for r in data["buckets"] if r["hi"] <= 0.1 and r["n"]]
        assert low and all(r["signed_mean"] > 0 for r in low)  # the lift over-samples the tail ...
        top = data["buckets"][-1]
        assert top["n"] and top["signed_mean"] < 0  # ... and under-samples the confident tokens
    data = (tmp_path / "tail_mismatch.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert (s["train_dtype"], s["rollout_dtype"], s["noise_kind"]) == ("float32", "float32", "lift")


def test_command_mantissa_bits_task_and_errors(model_dir, tmp_path, capsys):
    s = run(
        [
            "--model",
            model_dir,
            "--rollout_mantissa_bits",
            "3",
            "--task",
            "study_plugins:exact_match_task",
            "--no_plots",
        ],
        tmp_path,
    )
    assert s["rollout_mantissa_bits"] == 3 and s["rollout_dtype"] == "float32" and s["eps_max"] > 0
    assert s["tail"]["labels"]["task"] == "arith-em prompts"
    assert s["tail"]["labels"]["free_text"] == "free text (stdlib docstrings)"
    assert any(abs(r["signed_mean"]) > 1e-3 for r in s["tail"]["sources"]["task"]["buckets"] if r["n"])
    s = run(["--model", model_dir, "--no_tail", "--no_plots"], tmp_path / "no-tail")
    assert "tail" not in s
    for argv, message in (
        (
            ["--rollout_mantissa_bits", "30"],
            "--rollout_mantissa_bits 30 is not accepted: accepted an integer in [1, 23]",
        ),
        (["--rollout_mantissa_bits", "3", "--compare", "float32:float64"], "not a float64 rollout side"),
        (["--task", "nope"], "--task='nope' is not accepted"),
        (["--tail_samples", "0"], "--tail_samples"),
    ):
        assert main(["diagnose", "--model", model_dir, *argv, "--output_dir", str(tmp_path / "bad")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_help_lists_the_new_flags(capsys):
    with pytest.raises(SystemExit):
        main(["diagnose", "--help"])
    text = capsys.readouterr().out
    for flag in ("--rollout_mantissa_bits", "--task", "--tail_prompts", "--no_tail", "lift"):
        assert flag in text, flag
