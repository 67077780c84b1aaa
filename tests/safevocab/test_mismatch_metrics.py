"""``safevocab.mismatch``'s metric functions (``safevocab/mismatch/metrics.py``: per-token mismatch, buckets, safe-set
sizes, importance-ratio statistics, reductions) against formulas written out independently in the tests; the importance
ratio they summarise is ``safevocab.correction``'s, checked against trl's own formulas."""

from __future__ import annotations

import math

import pytest
import torch

from safevocab.correction import importance_sampling_ratio
from safevocab.mismatch import (
    bucket_mismatch_metrics,
    bucket_names,
    importance_ratio_metrics,
    mismatch_metrics,
    reduction,
    safe_set_metrics,
)
from safevocab.mismatch.metrics import safe_set_row


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(3, 5, generator=g) * 4  # log-probs in (-4, 0]
    rollout = train + 0.1 * torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    return train, rollout, mask


def test_mismatch_metrics_formulas(batch):
    train, rollout, mask = batch
    out = mismatch_metrics(train, rollout, mask)
    tokens = [(b, t) for b in range(3) for t in range(5) if mask[b, t]]
    lr = [float(train[b, t] - rollout[b, t]) for b, t in tokens]
    assert out["mismatch/kl"].item() == pytest.approx(-sum(lr) / len(lr), rel=1e-5)
    assert out["mismatch/k3_kl"].item() == pytest.approx(sum(math.exp(x) - x - 1 for x in lr) / len(lr), rel=1e-4)
    assert out["mismatch/chi2_token"].item() == pytest.approx(sum(math.expm1(x) ** 2 for x in lr) / len(lr), rel=1e-4)
    seq_diffs, seq_sums, train_ppl = [], [], []
    for b in range(3):
        ts = [t for t in range(5) if mask[b, t]]
        mt = sum(float(train[b, t]) for t in ts) / len(ts)
        mr = sum(float(rollout[b, t]) for t in ts) / len(ts)
        seq_diffs.append(mr - mt)
        seq_sums.append(sum(float(train[b, t] - rollout[b, t]) for t in ts))
        train_ppl.append(math.exp(-mt))
    assert out["mismatch/log_ppl_diff"].item() == pytest.approx(sum(seq_diffs) / 3, rel=1e-5, abs=1e-7)
    assert out["mismatch/log_ppl_abs_diff"].item() == pytest.approx(sum(map(abs, seq_diffs)) / 3, rel=1e-5)
    assert out["mismatch/log_ppl_diff_max"].item() == pytest.approx(max(seq_diffs), rel=1e-5)
    assert out["mismatch/training_ppl"].item() == pytest.approx(sum(train_ppl) / 3, rel=1e-5)
    assert out["mismatch/ppl_ratio"].item() == pytest.approx(sum(math.exp(d) for d in seq_diffs) / 3, rel=1e-5)
    assert out["mismatch/chi2_seq"].item() == pytest.approx(sum(math.expm1(s) ** 2 for s in seq_sums) / 3, rel=1e-4)
    assert out["mismatch/abs_logp_diff_max"].item() == pytest.approx(max(map(abs, lr)), rel=1e-5)


def test_zero_mismatch_is_zero(batch):
    train, _, mask = batch
    out = mismatch_metrics(train, train.clone(), mask)
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_abs_diff", "abs_logp_diff_max"):
        assert out[f"mismatch/{key}"].item() == pytest.approx(0.0, abs=1e-6), key
    assert out["mismatch/ppl_ratio"].item() == pytest.approx(1.0)


def test_nan_rollout_tokens_are_ignored(batch):
    train, rollout, mask = batch
    rollout2 = rollout.clone()
    rollout2[0, 4] = float("nan")
    mask2 = mask.clone()
    mask2[0, 4] = False
    a, b = mismatch_metrics(train, rollout2, mask), mismatch_metrics(train, rollout, mask2)
    for k in a:
        assert torch.allclose(a[k], b[k], equal_nan=True), k


def test_buckets(batch):
    train = torch.log(torch.tensor([[0.0005, 0.005, 0.05, 0.3, 0.9]]))
    rollout = train + torch.tensor([[0.1, -0.2, 0.3, -0.4, 0.5]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    edges = [1e-3, 1e-2, 1e-1, 0.5]
    names = bucket_names(edges)
    assert names == ["p=0-0.001", "p=0.001-0.01", "p=0.01-0.1", "p=0.1-0.5", "p=0.5-1"]
    out = bucket_mismatch_metrics(train, rollout, mask, edges)
    for j, name in enumerate(names):
        expected = -float(rollout[0, j] - train[0, j])
        assert out[f"mismatch/diff/{name}"].item() == pytest.approx(expected, rel=1e-5)
        assert out[f"mismatch/abs_diff/{name}"].item() == pytest.approx(abs(expected), rel=1e-5)
        assert out[f"mismatch/token_frac/{name}"].item() == pytest.approx(0.2)
    # an empty bucket is NaN (undefined), not 0
    out = bucket_mismatch_metrics(train[:, 4:], rollout[:, 4:], mask[:, 4:], edges)
    assert math.isnan(out["mismatch/abs_diff/p=0-0.001"].item())
    assert out["mismatch/token_frac/p=0-0.001"].item() == 0.0
    with pytest.raises(ValueError, match="edges"):
        bucket_mismatch_metrics(train, rollout, mask, [0.5, 0.1])


def test_safe_set_metrics():
    kept = torch.tensor([[0.9, 0.8, 1.0], [0.5, 0.7, 0.1]])  # the last entry is padding
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    in_safe = torch.tensor([[True, False, True], [True, True, False]])
    size = torch.tensor([[3, 4, 5], [6, 7, 100]])
    out = safe_set_metrics(in_safe, kept.log(), size, mask)
    assert out["safevocab/out_of_set_frac"].item() == pytest.approx(1 / 5)
    assert out["safevocab/pruned_mass_mean"].item() == pytest.approx((0.1 + 0.2 + 0.0 + 0.5 + 0.3) / 5, rel=1e-5)
    assert out["safevocab/pruned_mass_max"].item() == pytest.approx(0.5, rel=1e-5)
    assert out["safevocab/safe_size_mean"].item() == pytest.approx((3 + 4 + 5 + 6 + 7) / 5)
    tv = 1 - (0.9 * 0.8 * 1.0 + 0.5 * 0.7) / 2
    assert out["safevocab/seq_tv_estimate"].item() == pytest.approx(tv, rel=1e-5)
    kl = (-math.log(0.9 * 0.8) - math.log(0.5 * 0.7)) / 2
    assert out["safevocab/seq_kl_estimate"].item() == pytest.approx(kl, rel=1e-5)
    assert out["safevocab/safe_size_median"].item() == 5.0  # of 3, 4, 5, 6, 7 (padding's 100 not counted)
    assert out["safevocab/safe_size_p99"].item() == pytest.approx(6.96)  # numpy.quantile([3..7], 0.99)
    assert out["safevocab/singleton_frac"].item() == 0.0


def test_kept_set_size_quantiles_and_singletons_match_numpy():
    """The set-level readouts against numpy over the counted positions of random batches (stacked rows too)."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        size = torch.randint(1, 6, (3, 4, 9), generator=g) ** 2 // 4 + 1  # many ones, a long tail
        mask = torch.rand(3, 4, 9, generator=g) < 0.7
        in_safe = torch.rand(3, 4, 9, generator=g) < 0.9
        kept = torch.rand(3, 4, 9, generator=g) * 0.5 + 0.5
        row = safe_set_row(in_safe, kept.log(), size, mask)  # one row per stacked batch
        for i in range(3):
            counted = size[i][mask[i]].numpy().astype(float)
            values = dict(zip(row.names, row.values[i].tolist()))
            assert values["safevocab/safe_size_median"] == pytest.approx(np.quantile(counted, 0.5), rel=1e-6)
            assert values["safevocab/safe_size_p99"] == pytest.approx(np.quantile(counted, 0.99), rel=1e-6)
            assert values["safevocab/singleton_frac"] == pytest.approx((counted == 1).mean(), rel=1e-6)


def _trl_reference_ratio(train, rollout, mask, mode, lo, hi):
    """trl 1.16's vLLM IS computation (grpo_trainer._generate_and_score_completions), restated."""
    diff = torch.nan_to_num((train - rollout) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    r = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(r, min=lo, max=hi)
    lo_v = -math.inf if lo is None else lo
    hi_v = math.inf if hi is None else hi
    return r.masked_fill((r < lo_v) | (r > hi_v), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("lo, hi", [(None, 1.05), (0.95, 1.05), (0.97, None)])
def test_importance_ratio_matches_trl(batch, mode, lo, hi):
    train, rollout, mask = batch
    if mode.endswith("truncate") and lo is None and hi is None:
        pytest.skip("trl requires a bound for truncation")
    out = importance_sampling_ratio(train, rollout, mask, mode, lo, hi)
    ref = _trl_reference_ratio(train, rollout, mask.float(), mode, lo, hi)
    assert torch.allclose(out.ratio, ref, atol=1e-6)
    raw = torch.exp(out.log_raw)
    changed = ~torch.isclose(raw, out.ratio, rtol=1e-6, atol=0)
    if not out.sequence_level:
        changed &= mask
    assert torch.equal(out.clipped, changed)
    stats = importance_ratio_metrics(out.log_raw, out.ratio, out.clipped, mask)
    valid = mask if not out.sequence_level else mask.any(-1, keepdim=True)
    assert stats["mismatch/is_raw_mean"].item() == pytest.approx(raw[valid].double().mean().item(), rel=1e-5)
    assert stats["mismatch/is_raw_max"].item() == pytest.approx(raw[valid].max().item(), rel=1e-5)
    assert stats["mismatch/is_clipped_frac"].item() == pytest.approx(out.clipped[valid].float().mean().item())
    w = out.ratio[valid].double()
    if w.square().sum() > 0:
        assert stats["mismatch/is_ess"].item() == pytest.approx((w.sum() ** 2 / (w.numel() * w.square().sum())).item())


def test_importance_ratio_nan_rollout_gives_one():
    train = torch.zeros(1, 3)
    rollout = torch.tensor([[0.0, float("nan"), -0.5]])
    out = importance_sampling_ratio(train, rollout, torch.ones(1, 3, dtype=torch.bool), "token_truncate", None, 10.0)
    assert out.ratio[0, 1].item() == 1.0
    assert out.ratio[0, 2].item() == pytest.approx(math.exp(0.5))


def test_reduction_names():
    assert reduction("mismatch/is_raw_max") == "max"
    assert reduction("sampling/importance_sampling_ratio/min") == "min"
    assert reduction("mismatch/k3_kl") == "mean"
