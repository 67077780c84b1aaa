"""``safevocab diagnose``'s batch-shape control (issue 54, points 1 and 5) and the ratio bands, on the bundled tiny
model: the pair metrics against hand-computed values; exactly 0 when the shapes are bit-identical (a single
sequence, or a model that scores every sequence alone whatever the batch); the size of a forced batch-dependent
kernel measured exactly; the packing probe; the engine's bands and cut shares against its per-token values; and
the command line (summary.json, the figure, the console rows, ``--no_batch_shape``, ``--help``)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from batch_dependent_model import BatchDependent, expected_log_ratios

from safevocab.mismatch.formulas import k3_terms
from trl_integration.commands import main
from trl_integration.lab import default_texts, run_diagnose
from trl_integration.lab.bands import outside_band
from trl_integration.lab.batch_shape import SHAPE_PAIRS, _micro_batch, _score, batch_shape_control, shape_pair

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def scored(bundled_tiny):
    """The tokens of 12 arithmetic texts, as the comparison scored them (float32 on both sides, no rule)."""
    model, tokenizer = bundled_tiny
    return run_diagnose(model, tokenizer, default_texts(12), compare=(torch.float32, torch.float32), rule="none",
                        progress=False)  # fmt: skip


class RowByRow(torch.nn.Module):
    """Batch-invariant by construction: each sequence of a call (a row, or a packed segment of one) is scored alone,
    as ``[1, L]`` with positions ``0..L-1``: every batch shape gives bit-identical logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        out = torch.zeros(*input_ids.shape, self.config.vocab_size)
        for b in range(input_ids.shape[0]):
            real = torch.ones_like(input_ids[b], dtype=torch.bool) if attention_mask is None else attention_mask[b] > 0
            idx = real.nonzero()[:, 0]
            starts = (position_ids[b, idx] == 0).nonzero()[:, 0].tolist() + [idx.numel()]
            for s, e in zip(starts[:-1], starts[1:]):
                ids = input_ids[b, idx[s:e]][None]
                pos = torch.arange(e - s)[None]
                out[b, idx[s:e]] = self.inner(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos,
                                              use_cache=False).logits[0]  # fmt: skip
        return SimpleNamespace(logits=out)


class CacheOn(torch.nn.Module):
    """Forwards with ``use_cache=True``: transformers then leaves packed sequences unisolated (no block mask)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, use_cache=False, **kwargs):
        return self.inner(use_cache=True, **kwargs)


def test_pair_metrics_match_hand_computed_values():
    p_a = torch.tensor([0.5, 0.2, 0.0005, 0.05, 0.9, 0.3], dtype=torch.float64)
    r = torch.tensor([1.0, 0.85, 1.2, 0.7, 1.05, 1.3], dtype=torch.float64)
    logp_a = p_a.log()
    logp_b = logp_a - r.log()
    logp_b[0] = logp_a[0]  # bit-identical
    in_set = torch.tensor([True, True, False, False, True, True])
    pair = shape_pair(logp_a, logp_b, in_set, rule="min_p=0.001")
    log_r = r.log()
    k3 = r - log_r - 1
    assert pair["n_tokens"] == 6 and pair["frac_identical"] == 1 / 6
    assert pair["k3_kl"] == pytest.approx(float(k3.mean()), rel=1e-12)
    assert pair["abs_diff_mean"] == pytest.approx(float(log_r.abs().mean()), rel=1e-12)
    assert pair["abs_diff_max"] == pytest.approx(math.log(1 / 0.7), rel=1e-12)
    assert pair["frac_ratio_outside_0.9_1.1"] == 4 / 6  # 0.85, 1.2, 0.7, 1.3
    assert pair["frac_ratio_outside_0.8_1.25"] == 2 / 6  # 0.7, 1.3
    assert [b["n"] for b in pair["buckets"]] == [1, 0, 1, 2, 2]
    assert pair["buckets"][1]["abs_diff_mean"] is None
    assert pair["buckets"][4]["abs_diff_mean"] == pytest.approx(math.log(1.05) / 2, rel=1e-12)
    assert pair["buckets"][3]["diff_mean"] == pytest.approx((math.log(0.85) + math.log(1.3)) / 2, rel=1e-12)
    rule = pair["rule"]
    assert rule["rule"] == "min_p=0.001" and rule["out_of_set_frac"] == 2 / 6
    assert rule["k3_share_outside"] == pytest.approx(float(k3[2:4].sum() / k3.sum()), rel=1e-12)
    assert rule["abs_diff_share_outside"] == pytest.approx(float(log_r[2:4].abs().sum() / log_r.abs().sum()), rel=1e-12)
    assert rule["ratio_outside_0.9_1.1_share_outside"] == 2 / 4  # 1.2 and 0.7 of 0.85, 1.2, 0.7, 1.3
    assert rule["ratio_outside_0.8_1.25_share_outside"] == 1 / 2  # 0.7 of 0.7, 1.3
    assert rule["bucket_abs_diff_share_outside"] == [1.0, None, 1.0, 0.0, 0.0]
    # the band edges are inside the band; the bands are read on r, not on |log r|
    edges = torch.tensor([0.9, 1.1, 0.8, 1.25], dtype=torch.float64).log()
    assert not outside_band(edges[:2], 0.9, 1.1).any() and not outside_band(edges[2:], 0.8, 1.25).any()
    assert shape_pair(logp_a, logp_b)["rule"] is None


def test_identical_shapes_give_exactly_zero(bundled_tiny, scored):
    model, _ = bundled_tiny
    invariant = batch_shape_control(RowByRow(model), scored.sequences, rule="min_p=0.001")
    single = batch_shape_control(model, scored.sequences[:1], rule="min_p=0.001")  # N = 1: the same shapes
    assert invariant["n_tokens"] == scored.summary["n_tokens"] and single["n_sequences"] == 1
    for control in (invariant, single):
        for key in SHAPE_PAIRS:
            pair = control[key]
            assert pair["skipped"] is None, pair
            assert pair["frac_identical"] == 1.0
            assert pair["k3_kl"] == pair["abs_diff_mean"] == pair["abs_diff_max"] == 0.0
            assert pair["frac_ratio_outside_0.9_1.1"] == pair["frac_ratio_outside_0.8_1.25"] == 0.0
            assert all(b["abs_diff_mean"] in (0.0, None) and b["diff_mean"] in (0.0, None) for b in pair["buckets"])
            rule = pair["rule"]
            assert rule["k3_share_outside"] is None and rule["abs_diff_share_outside"] is None  # nothing to share


def test_a_batch_dependent_kernel_is_measured_exactly(bundled_tiny, scored):
    model, _ = bundled_tiny
    control = batch_shape_control(BatchDependent(model), scored.sequences, rule="min_p=0.001")
    log_r = expected_log_ratios(model, scored.sequences)  # micro-batch 1 minus the batch of N
    assert log_r.abs().min() > 0 and outside_band(log_r, 0.9, 1.1).any()
    for key, sign in (("micro_batch_1_vs_n", 1.0), ("padded_vs_packed", -1.0)):  # the batch of N: first, then second
        pair = control[key]
        assert pair["skipped"] is None and pair["frac_identical"] == 0.0
        assert pair["abs_diff_mean"] == pytest.approx(float(log_r.abs().mean()), abs=1e-5)
        assert pair["k3_kl"] == pytest.approx(float(k3_terms(sign * log_r).mean()), rel=1e-3)
        assert pair["frac_ratio_outside_0.9_1.1"] == float(outside_band(sign * log_r, 0.9, 1.1).double().mean())
        assert pair["frac_ratio_outside_0.8_1.25"] == float(outside_band(sign * log_r, 0.8, 1.25).double().mean())
        assert 0.0 < pair["frac_ratio_outside_0.9_1.1"] and pair["rule"]["k3_share_outside"] is not None


def test_unisolated_packing_is_skipped_with_its_reason_and_the_batch_is_capped(bundled_tiny, scored):
    model, _ = bundled_tiny
    control = batch_shape_control(CacheOn(model), scored.sequences, max_tokens=40)
    assert "does not isolate packed sequences" in control["padded_vs_packed"]["skipped"]
    assert control["micro_batch_1_vs_n"]["skipped"] is None
    n = control["n_sequences"]
    assert 1 <= n < control["n_sequences_total"] == 12
    lengths = [ids.numel() for ids, _ in scored.sequences]
    assert n * max(lengths[:n]) <= 40 < (n + 1) * max(lengths[: n + 1])  # the first sequences that fit
    # the scored sequences are the comparison's tokens: micro-batch 1 reproduces its float32 log-probabilities
    logp, _ = _score(_micro_batch(model, scored.sequences, torch.device("cpu")), scored.sequences, 1.0, None)
    torch.testing.assert_close(logp, scored.tokens["train_logp"], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no sequence"):
        batch_shape_control(model, [])
    with pytest.raises(ValueError, match="max_tokens"):
        batch_shape_control(model, scored.sequences, max_tokens=0)


def test_sampled_tokens_are_the_ones_rescored(bundled_tiny):
    model, tokenizer = bundled_tiny
    prompts = list(default_texts(3))
    res = run_diagnose(model, tokenizer, prompts, compare=(torch.float32, torch.float32), rule="none",
                       max_new_tokens=4, num_samples=2, progress=False)  # fmt: skip
    assert len(res.sequences) == 6 and sum(int(c.sum()) for _, c in res.sequences) == res.summary["n_tokens"]
    logp, _ = _score(_micro_batch(model, res.sequences, torch.device("cpu")), res.sequences, 1.0, None)
    torch.testing.assert_close(logp, res.tokens["train_logp"], atol=1e-5, rtol=0)


def test_engine_reports_the_bands_and_their_share_below_the_cut(bundled_tiny):
    model, tokenizer = bundled_tiny
    res = run_diagnose(model, tokenizer, default_texts(16), compare=(torch.float32, torch.float32), noise=0.3,
                       rule="min_p=0.05", progress=False)  # fmt: skip
    s, log_r, outside = res.summary, res.tokens["log_r"], ~res.tokens["in_train_set"]
    for lo, hi in ((0.9, 1.1), (0.8, 1.25)):
        off = (log_r.exp() < lo) | (log_r.exp() > hi)
        assert s[f"frac_ratio_outside_{lo:g}_{hi:g}"] == float(off.double().mean())
        assert s["rule"][f"ratio_outside_{lo:g}_{hi:g}_share_outside"] == pytest.approx(
            int((off & outside).sum()) / int(off.sum()), rel=1e-12
        )
    assert 0 < s["frac_ratio_outside_0.8_1.25"] < s["frac_ratio_outside_0.9_1.1"] < 1
    gap = log_r.abs()
    assert s["rule"]["abs_diff_share_outside"] == pytest.approx(float(gap[outside].sum() / gap.sum()), rel=1e-12)


def test_command_line(bundled_tiny, tmp_path, capsys):
    out = tmp_path / "on"
    assert main(["diagnose", "--no_tail", "--rule", "min_p=0.01", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())
    control = s["batch_shape"]
    assert control["dtype"] == "float32" and control["n_tokens"] == s["n_tokens"]
    for key in SHAPE_PAIRS:  # the bundled model isolates packed sequences: both pairs run
        pair = control[key]
        assert pair["skipped"] is None and 0.0 <= pair["k3_kl"] < 1e-8 and pair["abs_diff_max"] < 1e-4
        assert pair["frac_ratio_outside_0.9_1.1"] == 0.0 and pair["rule"]["rule"] == "min_p=0.01"
    assert "batch_shape.png" in s["files"] and (out / "batch_shape.png").read_bytes().startswith(PNG_MAGIC)
    for row in ("ratio π/μ outside", "batch-shape control", "micro-batch 1 vs 64", "padded vs packed", "below the cut"):
        assert row in printed, row
    off = tmp_path / "off"
    assert main(["diagnose", "--no_tail", "--no_batch_shape", "--quiet", "--output_dir", str(off)]) == 0
    s_off = json.loads((off / "summary.json").read_text())
    assert s_off["batch_shape"] is None and not (off / "batch_shape.png").exists()
    assert s_off["frac_ratio_outside_0.9_1.1"] == s["frac_ratio_outside_0.9_1.1"]
    with pytest.raises(SystemExit):
        main(["diagnose", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--no_batch_shape" in help_text and "k3 = mean(r - log r - 1)" in help_text
    assert "log r = log pi_A - log pi_B" in help_text and "[0.9, 1.1] and [0.8, 1.25]" in help_text
