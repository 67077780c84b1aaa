"""``safevocab diagnose``'s precision arms (issue 54, points 2 and 5) on the bundled tiny model: the fp32 arm against
an fp32 rollout is exactly 0; an arm's self-comparison is exactly 0 where the batch shapes are bit-identical and
measures a forced batch-dependent kernel; the fp32 head is trl's ``cast_lm_head_to_fp32`` and is put back; the
arms' one-line error; and the command line (summary.json, the figure, the printed rows, ``--help``)."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from batch_dependent_model import BatchDependent, expected_log_ratios

from safevocab.mismatch.formulas import k3_terms
from trl_integration.commands import main
from trl_integration.lab import default_texts, run_diagnose
from trl_integration.lab.batch_shape import SHAPE_PAIRS
from trl_integration.lab.precision_arms import (
    PRECISION_ARMS,
    fp32_lm_head,
    parse_precision_arms,
    run_precision_arms,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ARM_KEYS = {"dtype", "lm_head_dtype", "seconds", "n_forwards", "batch_size", "n_tokens", "n_nonfinite", "vs_rollout",
            "vs_itself"}  # fmt: skip


@pytest.fixture(scope="module")
def scored(bundled_tiny):
    """12 arithmetic texts scored by the comparison, float32 on both sides (the rollout is the fp32 trainer)."""
    model, tokenizer = bundled_tiny
    return run_diagnose(model, tokenizer, default_texts(12), compare=(torch.float32, torch.float32), rule="none",
                        batch_size=4, progress=False)  # fmt: skip


class RowByRow(torch.nn.Module):
    """Batch-invariant by construction: each sequence of a call (a row, or a packed segment of one) is scored alone,
    so every batch shape gives bit-identical logits (in any dtype the weights are cast to)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        rows = []
        for b in range(input_ids.shape[0]):
            real = torch.ones_like(input_ids[b], dtype=torch.bool) if attention_mask is None else attention_mask[b] > 0
            idx = real.nonzero()[:, 0]
            starts = (position_ids[b, idx] == 0).nonzero()[:, 0].tolist() + [idx.numel()]
            row = None
            for s, e in zip(starts[:-1], starts[1:]):
                ids = input_ids[b, idx[s:e]][None]
                logits = self.inner(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    position_ids=torch.arange(e - s)[None], use_cache=False).logits[0]  # fmt: skip
                row = torch.zeros(input_ids.shape[1], logits.shape[-1], dtype=logits.dtype) if row is None else row
                row[idx[s:e]] = logits
            rows.append(row)
        return SimpleNamespace(logits=torch.stack(rows))


def test_arms_against_the_rollout_and_themselves(bundled_tiny, scored):
    model, tokenizer = bundled_tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    arms = run_precision_arms(model, scored.sequences, scored.tokens["rollout_logp"], rule="min_p=0.001",
                              batch_size=4, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert list(arms) == list(PRECISION_ARMS)
    n = scored.summary["n_tokens"]
    for arm, data in arms.items():
        assert set(data) == ARM_KEYS, arm
        assert data["n_tokens"] == data["vs_rollout"]["n_tokens"] == n and data["n_nonfinite"] == 0
        assert data["seconds"] > 0 and data["n_forwards"] == 3  # 12 sequences in batches of 4
        assert data["vs_rollout"]["rule"]["rule"] == "min_p=0.001"
        assert set(data["vs_itself"]) == {"n_sequences", "n_tokens", *SHAPE_PAIRS}
    # the fp32 arm scores in the comparison's batches: against the fp32 rollout it is the same numbers, bit for bit
    fp32 = arms["fp32"]["vs_rollout"]
    assert fp32["frac_identical"] == 1.0 and fp32["k3_kl"] == fp32["abs_diff_max"] == 0.0
    assert fp32["frac_ratio_outside_0.9_1.1"] == fp32["frac_ratio_outside_0.8_1.25"] == 0.0
    assert (arms["fp32"]["dtype"], arms["fp32"]["lm_head_dtype"]) == ("float32", "float32")
    assert (arms["bf16+fp32_head"]["dtype"], arms["bf16+fp32_head"]["lm_head_dtype"]) == ("bfloat16", "float32")
    # the low-precision arms are not the fp32 rollout; the fp32 head takes part of bf16's gap away, fp16 more
    k3 = {arm: arms[arm]["vs_rollout"]["k3_kl"] for arm in PRECISION_ARMS}
    assert 0 < k3["fp16"] < k3["bf16+fp32_head"] < k3["bf16"]
    # the fp32 head arm is trl's cast_lm_head_to_fp32 on the bf16 model: linear(h.float(), W.float())
    seq = scored.sequences[0][0][None]
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        hidden = bf16.model(seq).last_hidden_state
        expected = torch.nn.functional.linear(hidden.float(), bf16.lm_head.weight.float())
        with fp32_lm_head(bf16):
            got = bf16(seq).logits
        plain = bf16(seq).logits
    assert got.dtype == torch.float32 and torch.equal(got, expected) and plain.dtype == torch.bfloat16
    assert "forward" not in vars(bf16.lm_head)  # put back
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the caller's model is unchanged


def test_self_comparison_is_zero_when_bit_identical_and_measures_a_batch_dependent_kernel(bundled_tiny, scored):
    model, _ = bundled_tiny
    rollout = scored.tokens["rollout_logp"]
    same = run_precision_arms(RowByRow(model), scored.sequences, rollout, arms=["fp32", "bf16"], rule="min_p=0.001")
    for arm in ("fp32", "bf16"):
        for key in SHAPE_PAIRS:
            pair = same[arm]["vs_itself"][key]
            assert pair["skipped"] is None and pair["frac_identical"] == 1.0, (arm, key)
            assert pair["k3_kl"] == pair["abs_diff_max"] == pair["frac_ratio_outside_0.9_1.1"] == 0.0, (arm, key)
    forced = run_precision_arms(BatchDependent(model), scored.sequences, rollout, arms=["fp32"])["fp32"]
    log_r = expected_log_ratios(model, scored.sequences)  # micro-batch 1 minus the batch of N
    pair = forced["vs_itself"]["micro_batch_1_vs_n"]
    assert pair["frac_identical"] == 0.0 and pair["frac_ratio_outside_0.9_1.1"] > 0
    assert pair["k3_kl"] == pytest.approx(float(k3_terms(log_r).mean()), rel=1e-3)
    # its scoring batches have several rows too: against the (unlifted) rollout, the same shift
    assert forced["vs_rollout"]["abs_diff_mean"] == pytest.approx(float(log_r.abs().mean()), abs=1e-5)


def test_arm_errors(bundled_tiny, scored):
    model, _ = bundled_tiny
    assert parse_precision_arms(["all"]) == PRECISION_ARMS and parse_precision_arms(None) == ()
    assert parse_precision_arms(["all", "fp32"]) == PRECISION_ARMS  # an arm "all" names counts once
    with pytest.raises(ValueError, match=r"^--precision_arms 'fp32' is given twice: accepted each of bf16, .* once"):
        parse_precision_arms(["fp32", "bf16", "fp32"])  # a typo's duplicate is refused, not silently dropped
    with pytest.raises(ValueError) as err:
        parse_precision_arms(["bf16", "fp8"])
    message = str(err.value)
    assert "\n" not in message and "--precision_arms 'fp8'" in message
    assert all(arm in message for arm in (*PRECISION_ARMS, "all")), message
    with pytest.raises(ValueError, match="rollout_logp has 3 log-probabilities"):
        run_precision_arms(model, scored.sequences, torch.zeros(3))
    with pytest.raises(ValueError, match="no LM head"):
        run_precision_arms(RowByRow(model), scored.sequences, scored.tokens["rollout_logp"], arms=["bf16+fp32_head"])


def test_command_line(bundled_tiny, tmp_path, capsys):
    out = tmp_path / "arms"
    argv = ["diagnose", "--no_tail", "--compare", "fp32:bf16", "--precision_arms", "fp32", "bf16", "--output_dir"]
    assert main([*argv, str(out)]) == 0
    printed = capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())
    assert list(s["precision_arms"]) == ["fp32", "bf16"]
    # the bf16 arm re-scores what the bf16 rollout scored, in the same batches: 0; the fp32 arm is the comparison
    assert s["precision_arms"]["bf16"]["vs_rollout"]["k3_kl"] == 0.0
    fp32 = s["precision_arms"]["fp32"]["vs_rollout"]
    assert fp32["abs_diff_mean"] == pytest.approx(s["abs_diff_mean"], rel=1e-12)
    assert fp32["frac_ratio_outside_0.8_1.25"] == s["frac_ratio_outside_0.8_1.25"]
    assert "precision_arms.png" in s["files"] and (out / "precision_arms.png").read_bytes().startswith(PNG_MAGIC)
    for row in ("precision arms", "  fp32", "  bf16", "vs rollout k3", "vs itself k3"):
        assert row in printed, row
    assert main(["diagnose", "--no_tail", "--precision_arms", "fp8", "--quiet", "--output_dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--precision_arms 'fp8'" in error and "bf16+fp32_head" in error
    off = tmp_path / "off"
    assert main(["diagnose", "--no_tail", "--no_batch_shape", "--quiet", "--no_plots", "--output_dir", str(off)]) == 0
    assert json.loads((off / "summary.json").read_text())["precision_arms"] is None
    with pytest.raises(SystemExit):
        main(["diagnose", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for phrase in ("--precision_arms", "bf16+fp32_head", "linear(h.float(), W.float())", "log r = log pi_arm - log mu",
                   "k3 = mean(r - log r - 1)", "[0.9, 1.1] and [0.8, 1.25]", "time.perf_counter"):  # fmt: skip
        assert phrase in help_text, phrase
