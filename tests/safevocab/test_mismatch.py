"""``safevocab.mismatch`` against direct computations (Python loops over tokens and sets, float64).

Each metric is recomputed here from its definition, token by token, without the library's vectorised code; the
noise bound (``|log pi - log mu| <= log(p + (1 - p) e^{2 eps})`` for ``|delta| <= eps``) is checked on random
logits and perturbations, including the shift-invariant ``eps_t`` of :func:`logit_perturbation_eps`.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from safevocab import fused_safe_logprobs
from safevocab.bounds import logprob_mismatch_bound
from safevocab.mismatch import (
    DEFAULT_BUCKETS,
    LOG_RATIO_BOUND,
    bucket_mismatch,
    bucket_mismatch_metrics,
    bucket_names,
    chi2_sequence,
    chi2_token,
    k3_kl,
    log_ppl_gap,
    logit_perturbation_eps,
    mismatch_metrics,
    safe_set_disagreement,
)


@pytest.fixture
def pair():
    """Training/rollout log-probs with a spread of probabilities, some NaN rollout entries and ragged masks."""
    g = torch.Generator().manual_seed(3)
    train = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 9  # p from ~1e-4 to 1
    rollout = train + 0.2 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    rollout[1, 2] = float("nan")
    mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool
    )
    return train, rollout, mask


def counted(train, rollout, mask):
    """The counted (b, t) tokens, as the definitions say: in the mask and reported by both engines."""
    return [
        (b, t)
        for b in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[b, t] and not math.isnan(rollout[b, t]) and not math.isnan(train[b, t])
    ]


def test_log_ppl_gap_per_sequence(pair):
    train, rollout, mask = pair
    gap = log_ppl_gap(train, rollout, mask)
    toks = counted(train, rollout, mask)
    for b in range(4):
        ts = [t for bb, t in toks if bb == b]
        if not ts:
            assert math.isnan(gap[b])
            continue
        expected = sum(float(rollout[b, t]) for t in ts) / len(ts) - sum(float(train[b, t]) for t in ts) / len(ts)
        assert gap[b].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_k3_and_chi2_token(pair):
    train, rollout, mask = pair
    toks = counted(train, rollout, mask)
    lr = [float(train[b, t] - rollout[b, t]) for b, t in toks]
    assert k3_kl(train, rollout, mask).item() == pytest.approx(sum(math.exp(x) - x - 1 for x in lr) / len(lr), rel=1e-5)
    assert chi2_token(train, rollout, mask).item() == pytest.approx(
        sum(math.expm1(x) ** 2 for x in lr) / len(lr), rel=1e-5, abs=1e-12
    )
    assert all(math.exp(x) - x - 1 >= 0 for x in lr)


def test_chi2_sequence_is_product_of_ratios(pair):
    train, rollout, mask = pair
    toks = counted(train, rollout, mask)
    seqs = sorted({b for b, _ in toks})
    terms = []
    for b in seqs:
        prod = 1.0
        for bb, t in toks:
            if bb == b:
                prod *= math.exp(float(train[b, t] - rollout[b, t]))
        terms.append((prod - 1) ** 2)
    assert chi2_sequence(train, rollout, mask).item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)


@pytest.mark.parametrize("log_r", [-0.1, 1e-6])
def test_chi2_is_never_negative_and_keeps_small_mismatches(log_r):
    """Issue 31: verl's ``mean r^2 - 1`` read -0.18 on ratios all below 1, and 2.0e-6 (its first-order term
    ``2 mean (r - 1)``) for ``log r = 1e-6``; ``(r - 1)^2 = expm1(log r)^2`` per token has the same expectation under
    sampling from the rollout and is never negative."""
    rollout = torch.full((2, 3), -0.5)
    train = rollout + log_r
    log_r = float(train[0, 0].double() - rollout[0, 0].double())  # as rounded to fp32
    mask = torch.ones(2, 3, dtype=torch.bool)
    token = math.expm1(log_r) ** 2
    sequence = math.expm1(3 * log_r) ** 2
    assert chi2_token(train, rollout, mask).item() == pytest.approx(token, rel=1e-3)
    assert chi2_sequence(train, rollout, mask).item() == pytest.approx(sequence, rel=1e-3)
    logged = mismatch_metrics(train, rollout, mask)
    assert logged["mismatch/chi2_token"].item() == pytest.approx(token, rel=1e-3)
    assert logged["mismatch/chi2_seq"].item() == pytest.approx(sequence, rel=1e-3)


def test_clamped_ratio_stays_finite():
    train = torch.tensor([[0.0, -1.0]])
    rollout = torch.tensor([[-100.0, -1.0]])  # log r = 100: clamped to LOG_RATIO_BOUND
    mask = torch.ones(1, 2, dtype=torch.bool)
    expected = (math.exp(LOG_RATIO_BOUND) - LOG_RATIO_BOUND - 1 + 0.0) / 2
    assert k3_kl(train, rollout, mask).item() == pytest.approx(expected, rel=1e-6)
    assert math.isfinite(chi2_sequence(train, rollout, mask).item())


def test_bucket_mismatch_by_loops(pair):
    train, rollout, mask = pair
    edges = (0.01, 0.1, 0.5)
    out = bucket_mismatch(train, rollout, mask, edges)
    assert out.names == ["p=0-0.01", "p=0.01-0.1", "p=0.1-0.5", "p=0.5-1"]
    toks = counted(train, rollout, mask)
    bounds = [0.0, *edges, 1.0]
    for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        last = j == len(bounds) - 2
        sel = [(b, t) for b, t in toks if lo <= math.exp(train[b, t]) and (math.exp(train[b, t]) < hi or last)]
        assert out.count[j].item() == len(sel)
        if not sel:
            assert math.isnan(out.abs_diff_mean[j]) and math.isnan(out.diff_mean[j])
            continue
        diffs = [float(train[b, t] - rollout[b, t]) for b, t in sel]
        assert out.abs_diff_mean[j].item() == pytest.approx(sum(map(abs, diffs)) / len(diffs), rel=1e-12)
        assert out.diff_mean[j].item() == pytest.approx(sum(diffs) / len(diffs), rel=1e-12, abs=1e-15)
    assert out.count.sum().item() == len(toks)
    assert out.frac.sum().item() == pytest.approx(1.0)
    # the metric dictionary carries the same numbers
    metrics = bucket_mismatch_metrics(train, rollout, mask, edges)
    for j, name in enumerate(out.names):
        assert metrics[f"mismatch/token_frac/{name}"].item() == pytest.approx(out.frac[j].item(), rel=1e-6)


def test_bucket_edges_validated(pair):
    train, rollout, mask = pair
    for bad in ([0.5, 0.1], [0.0, 0.5], [1.0]):
        with pytest.raises(ValueError, match="edges"):
            bucket_mismatch(train, rollout, mask, bad)
    assert bucket_names(DEFAULT_BUCKETS)[0] == "p=0-0.001"


def test_shapes_validated(pair):
    train, rollout, mask = pair
    with pytest.raises(ValueError, match="does not match"):
        k3_kl(train[:, :3], rollout, mask)
    with pytest.raises(ValueError, match="must match"):
        logit_perturbation_eps(torch.zeros(2, 3), torch.zeros(2, 4))


def test_mismatch_metrics_use_the_same_definitions(pair):
    train, rollout, mask = pair
    m = mismatch_metrics(train, rollout, mask)
    gap = log_ppl_gap(train, rollout, mask)
    gap = gap[~torch.isnan(gap)]
    assert m["mismatch/log_ppl_abs_diff"].item() == pytest.approx(gap.abs().mean().item(), rel=1e-6)
    assert m["mismatch/log_ppl_diff_max"].item() == pytest.approx(gap.max().item(), rel=1e-6)
    assert m["mismatch/k3_kl"].item() == pytest.approx(k3_kl(train, rollout, mask).item(), rel=1e-6)
    assert m["mismatch/chi2_seq"].item() == pytest.approx(chi2_sequence(train, rollout, mask).item(), rel=1e-6)
    toks = counted(train, rollout, mask)
    assert m["mismatch/abs_logp_diff_max"].item() == pytest.approx(
        max(abs(float(train[b, t] - rollout[b, t])) for b, t in toks), rel=1e-6
    )


def test_identical_engines_give_exact_zeros(pair):
    train, _, mask = pair
    m = mismatch_metrics(train, train.clone(), mask)
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_abs_diff", "abs_logp_diff_max"):
        assert m[f"mismatch/{key}"].item() == 0.0, key


# ----------------------------------------------------------------------------------------------------
# safe-set disagreement


def min_p_set(z: list[float], rho: float) -> set[int]:
    """The min-p safe set by its definition: p_a >= rho * p_max."""
    zmax = max(z)
    probs = [math.exp(v - zmax) for v in z]  # proportional to p
    return {a for a, q in enumerate(probs) if q >= rho * max(probs)}


@pytest.mark.parametrize("rho", [0.05, 0.3])
def test_safe_set_disagreement_jaccard(rho):
    g = torch.Generator().manual_seed(1)
    za = torch.randn(5, 7, 12, generator=g, dtype=torch.float64) * 2
    zb = za + 0.4 * torch.randn(5, 7, 12, generator=g, dtype=torch.float64)
    out = safe_set_disagreement(za, zb, f"min_p={rho}")
    any_differs = False
    for i in range(5):
        for j in range(7):
            sa = min_p_set(za[i, j].tolist(), rho)
            sb = min_p_set(zb[i, j].tolist(), rho)
            assert out.jaccard[i, j].item() == pytest.approx(len(sa & sb) / len(sa | sb), rel=1e-12)
            assert bool(out.differs[i, j]) == (sa != sb)
            assert out.size_a[i, j].item() == len(sa) and out.size_b[i, j].item() == len(sb)
            any_differs |= sa != sb
    assert any_differs, "the perturbation must change some sets for this test to mean anything"
    metrics = out.metrics()
    assert metrics["mismatch/safe_set_differ_frac"].item() == pytest.approx(out.differs.double().mean().item())
    assert metrics["mismatch/safe_set_jaccard_min"].item() == pytest.approx(out.jaccard.min().item())


def test_safe_set_disagreement_temperature_and_identity():
    z = torch.randn(3, 9, dtype=torch.float64)
    same = safe_set_disagreement(z, z.clone(), "top_k=3")
    assert not same.differs.any() and torch.all(same.jaccard == 1)
    # temperature changes min_p's set (it acts on p), so it must be applied before the rule
    hot = safe_set_disagreement(z, z, "min_p=0.2", temperature=5.0)
    expected = [len(min_p_set((z[i] / 5.0).tolist(), 0.2)) for i in range(3)]
    assert hot.size_a.tolist() == expected
    with pytest.raises(ValueError, match="temperature"):
        safe_set_disagreement(z, z, "min_p=0.2", temperature=0.0)


@pytest.mark.parametrize(
    "temperature, error, message",
    [
        ("1", TypeError, "temperature must be a real number, got str: '1'"),
        (None, TypeError, "temperature must be a real number, got NoneType: None"),
        (math.inf, ValueError, "temperature=inf is out of range: accepted a finite temperature > 0"),
        (math.nan, ValueError, "temperature=nan is out of range: accepted a finite temperature > 0"),
        (-1.0, ValueError, "temperature=-1.0 is out of range: accepted a finite temperature > 0"),
    ],
)
def test_safe_set_disagreement_checks_temperature_as_the_log_probabilities_do(temperature, error, message):
    """The same one-line errors as fused_safe_logprobs (inf was accepted here, a string gave a vague TypeError)."""
    z = torch.randn(2, 5)
    with pytest.raises(error) as err:
        safe_set_disagreement(z, z, "min_p=0.2", temperature=temperature)
    assert str(err.value) == message
    with pytest.raises(error) as reference:
        fused_safe_logprobs(z[:, :3].contiguous(), torch.randn(4, 3), torch.zeros(2, dtype=torch.long), "none",
                            temperature=temperature)  # fmt: skip
    assert str(reference.value) == message
    same = safe_set_disagreement(z, z, "min_p=0.2", temperature=np.float32(0.5))  # real scalars of any kind
    assert bool(same.jaccard.eq(1).all())


# ----------------------------------------------------------------------------------------------------
# perturbation size and the noise bound


def test_logit_perturbation_eps_is_the_smallest_shifted_sup_norm():
    g = torch.Generator().manual_seed(0)
    za = torch.randn(6, 10, generator=g, dtype=torch.float64)
    delta = torch.rand(6, 10, generator=g, dtype=torch.float64) * 3 - 1
    eps_t = logit_perturbation_eps(za, za + delta)
    raw = logit_perturbation_eps(za, za + delta, centered=False)
    for i in range(6):
        d = delta[i].tolist()
        # brute force: min over a fine grid of shifts c of max_i |d_i - c|
        cs = [min(d) + k * (max(d) - min(d)) / 2000 for k in range(2001)]
        brute = min(max(abs(x - c) for x in d) for c in cs)
        assert eps_t[i].item() == pytest.approx(brute, abs=1e-3)
        assert raw[i].item() == pytest.approx(max(abs(x) for x in d), rel=1e-12)
        assert eps_t[i] <= raw[i] + 1e-15
    # a constant shift of all logits is no perturbation at all
    assert logit_perturbation_eps(za, za + 7.5).abs().max().item() < 1e-12
    # -inf on both sides is ignored
    za[:, 0] = -math.inf
    assert torch.all(logit_perturbation_eps(za, za + delta) <= eps_t)  # dropping a token never increases eps


@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 60),
    eps=st.floats(1e-4, 3.0),
    scale=st.floats(0.1, 12.0),
)
def test_every_token_within_the_bound_under_bounded_noise(seed, vocab, eps, scale):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(8, vocab, generator=g, dtype=torch.float64) * scale
    delta = (torch.rand(8, vocab, generator=g, dtype=torch.float64) * 2 - 1) * eps
    delta[0] = eps  # constant: zero gap
    delta[1, 0], delta[1, 1:] = -eps, eps  # the extremal perturbation for token 0
    log_pi = z.log_softmax(-1)
    log_mu = (z + delta).log_softmax(-1)
    gap = (log_pi - log_mu).abs()
    p = log_pi.exp()
    assert delta.abs().max() <= eps
    assert torch.all(gap <= logprob_mismatch_bound(p, eps) + 1e-12)
    eps_t = logit_perturbation_eps(z, z + delta).unsqueeze(-1)
    assert torch.all(eps_t <= eps + 1e-12)
    assert torch.all(gap <= logprob_mismatch_bound(p, eps_t) + 1e-12)
    # the extremal perturbation attains the bound on token 0 of row 1: the check above is tight
    assert gap[1, 0].item() == pytest.approx(logprob_mismatch_bound(p[1, 0], eps).item(), rel=1e-9, abs=1e-12)


def test_bound_check_can_fail():
    """A perturbation larger than the assumed eps breaks the bound: the check above is not vacuous."""
    z = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    delta = torch.tensor([[-1.0, 1.0, 1.0]], dtype=torch.float64)
    gap = (z.log_softmax(-1) - (z + delta).log_softmax(-1)).abs()
    assert gap[0, 0] > logprob_mismatch_bound(z.softmax(-1)[0, 0], 0.5)


def test_core_module_does_not_import_trl():
    code = "import sys, safevocab.mismatch; print(any(m in sys.modules for m in ('trl', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_integer_log_probs_and_logits_raise_naming_the_argument():
    """Issue 37, D9 residue: mismatch_metrics with int log-probs and safe_set_disagreement with int logits were
    accepted (read as rounded values)."""
    ints, floats, mask = torch.tensor([[-1, -2]]), torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2)
    cases = [
        (lambda: mismatch_metrics(ints, floats, mask), "train_logps.dtype=torch.int64 is not accepted"),
        (lambda: mismatch_metrics(floats, ints, mask), "rollout_logps.dtype=torch.int64 is not accepted"),
        (lambda: safe_set_disagreement(ints, floats, "top_k=1"), "logits_a.dtype=torch.int64 is not accepted"),
        (lambda: safe_set_disagreement(floats, ints, "top_k=1"), "logits_b.dtype=torch.int64 is not accepted"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError) as err:
            call()
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
