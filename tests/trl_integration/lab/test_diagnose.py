"""``safevocab diagnose`` on a tiny model built in the test: summary.json, PNG plots, numbers against direct
computations, the noise bound (100% for injected noise), sampling mode and errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from trl_helpers import build_model, build_tokenizer

from safevocab.bounds import logprob_mismatch_bound
from trl_integration.commands import main
from trl_integration.lab import parse_compare, run_diagnose

TEXTS = ["hello world.", "the cat sat on the mat", "1+1=2, 2+2=4", "abc", "go!"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("diag-model")
    tok = build_tokenizer()
    build_model(tok, head_scale=4.0).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("diag-texts") / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n\n", encoding="utf-8")  # a blank line is skipped
    return str(path)


def run(argv, out):
    rc = main(["diagnose", *argv, "--output_dir", str(out), "--quiet"])
    assert rc == 0
    return json.loads((out / "summary.json").read_text())


def n_scored_tokens(texts):
    tok = build_tokenizer()
    return sum(len(tok(t)["input_ids"]) - 1 for t in texts)


def test_noise_summary_and_plots(model_dir, texts_file, tmp_path):
    eps = 0.1
    s = run(
        ["--model", model_dir, "--input", texts_file, "--noise", str(eps), "--noise_kind", "uniform",
         "--rule", "min_p=0.05", "--batch_size", "2"],
        tmp_path,
    )  # fmt: skip
    for key in ("eps_max", "frac_within_bound", "n_tokens", "buckets", "rule", "sequence_metrics"):
        assert key in s, key
    assert s["n_tokens"] == n_scored_tokens(TEXTS)
    assert s["n_sequences"] == len(TEXTS)
    assert (s["train_dtype"], s["rollout_dtype"]) == ("float32", "float32")  # noise alone by default
    # injected noise: |delta| <= eps, every token within the tight bound at that eps
    assert 0 < s["eps_max"] <= eps and s["eps_raw_max"] <= eps
    assert s["eps_ref"] == eps and s["frac_within_bound"] == 1.0 and s["frac_within_local_bound"] == 1.0
    assert 0 < s["abs_diff_max"] <= logprob_mismatch_bound(0.0, eps)
    assert sum(b["n"] for b in s["buckets"]) == s["n_tokens"]
    assert [b["name"] for b in s["buckets"]] == ["p=0-0.001", "p=0.001-0.01", "p=0.01-0.1", "p=0.1-0.5", "p=0.5-1"]
    for b in s["buckets"]:
        if b["n"]:
            assert 0 <= b["abs_diff_mean"] <= b["abs_diff_max"] <= b["bound_at_lo"] + 1e-9
    rule = s["rule"]
    assert rule["rule"] == "min_p=0.05" and 0 < rule["kept_frac"] <= 1 and 0 <= rule["set_differ_frac"] <= 1
    assert rule["frac_within_pruned_bound"] == 1.0
    # issue 19: the tail diagnostic's figure comes first (tests/trl_integration/lab/test_tail.py); issue 54: the
    # batch-shape control's last (tests/trl_integration/lab/test_batch_shape.py)
    figures = ["tail_mismatch.png", "mismatch_vs_p.png", "bucket_means.png", "batch_shape.png"]
    assert s["files"] == ["summary.json", *figures]
    import matplotlib.image

    for name in ("mismatch_vs_p.png", "bucket_means.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
        h, w = matplotlib.image.imread(tmp_path / name).shape[:2]
        assert h > 300 and w > 500


def test_bound_check_fails_when_the_assumed_eps_is_too_small(model_dir, tmp_path):
    s = run(["--model", model_dir, "--prompts", *TEXTS, "--noise", "0.2", "--eps", "0.01", "--no_plots"], tmp_path)
    assert s["eps_ref"] == 0.01
    assert s["frac_within_bound"] < 0.9
    assert s["frac_within_local_bound"] == 1.0  # the bound at each position's own measured eps always holds
    assert not (tmp_path / "mismatch_vs_p.png").exists()


def test_per_token_values_match_a_direct_computation(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    res = run_diagnose(
        model,
        tok,
        TEXTS[:2],
        compare=(torch.float32, torch.bfloat16),
        rule="none",
        temperature=0.7,
        batch_size=1,
        progress=False,
    )
    assert res.summary["rule"] is None
    expected_train, expected_rollout = [], []
    model_bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    for text in TEXTS[:2]:
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            for m, acc in ((model, expected_train), (model_bf16, expected_rollout)):
                logits = m(ids).logits[0, :-1].double() / 0.7
                acc.extend(logits.log_softmax(-1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]].tolist())
    torch.testing.assert_close(
        res.tokens["train_logp"], torch.tensor(expected_train, dtype=torch.float64), atol=1e-6, rtol=1e-6
    )
    torch.testing.assert_close(
        res.tokens["rollout_logp"], torch.tensor(expected_rollout, dtype=torch.float64), atol=1e-6, rtol=1e-6
    )
    # padded batches keep every token in order (fp32 is insensitive to the padding up to rounding)
    batched = run_diagnose(
        model,
        tok,
        TEXTS[:2],
        compare=(torch.float32, torch.float32),
        noise=0.01,
        rule="none",
        temperature=0.7,
        batch_size=2,
        progress=False,
    )
    torch.testing.assert_close(batched.tokens["train_logp"], res.tokens["train_logp"], atol=1e-5, rtol=1e-5)
    s = res.summary
    # in float64, as the summary: float32 differences of values near -2 carry ~1e-7 each, 1e-5 of this mean
    log_r = torch.tensor(expected_train, dtype=torch.float64) - torch.tensor(expected_rollout, dtype=torch.float64)
    assert s["abs_diff_mean"] == pytest.approx(log_r.abs().mean().item(), rel=1e-6)
    assert s["eps_max"] > 0 and s["eps_ref_source"] == "measured eps_max"
    # with the measured eps the bound is a theorem: 100%, and it is not vacuous (some token gets close)
    assert s["frac_within_bound"] == 1.0
    assert s["sequence_metrics"]["k3_kl"] > 0
    assert model.dtype == torch.float32  # the caller's model is not converted


def test_sampling_mode_scores_the_sampled_tokens(model_dir, tmp_path):
    s = run(
        ["--model", model_dir, "--prompts", "abc", "hello", "--max_new_tokens", "5", "--num_samples", "3",
         "--compare", "float32:float16", "--no_plots", "--seed", "1"],
        tmp_path,
    )  # fmt: skip
    assert s["mode"] == "sample" and s["n_sequences"] == 6
    assert 6 <= s["n_tokens"] <= 6 * 5
    assert s["rollout_dtype"] == "float16" and s["frac_within_bound"] == 1.0
    again = run(
        ["--model", model_dir, "--prompts", "abc", "hello", "--max_new_tokens", "5", "--num_samples", "3",
         "--compare", "float32:float16", "--no_plots", "--seed", "1"],
        tmp_path / "again",
    )  # fmt: skip
    assert again["abs_diff_mean"] == s["abs_diff_mean"] and again["n_tokens"] == s["n_tokens"]


def test_bundled_model_and_default_inputs(tmp_path):
    from trl_integration.demo.model import tiny_model_path

    try:
        tiny_model_path()
    except FileNotFoundError:
        pytest.skip("the bundled tiny model is not built in this checkout")
    s = run(["--no_plots"], tmp_path)
    assert s["n_tokens"] > 100 and s["rollout_dtype"] == "bfloat16" and not math.isnan(s["eps_max"])


def test_errors_are_clear(model_dir, tmp_path, capsys):
    assert main(["diagnose", "--model", str(tmp_path / "nope"), "--output_dir", str(tmp_path)]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["diagnose", "--model", model_dir, "--compare", "float32:int8", "--output_dir", str(tmp_path)]) == 2
    assert "--compare" in capsys.readouterr().err
    assert main(["diagnose", "--model", model_dir, "--noise", "-1", "--output_dir", str(tmp_path)]) == 2
    assert main(["diagnose", "--model", model_dir, "--rule", "min_p=7", "--output_dir", str(tmp_path)]) == 2
    assert main([]) == 2
    with pytest.raises(ValueError, match="TRAIN:ROLLOUT"):
        parse_compare("float32")
    assert parse_compare("fp32:bf16") == (torch.float32, torch.bfloat16)
