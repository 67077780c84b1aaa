"""Every statement of docs/bounds.md (the pruning bias and the mismatch bound) against brute force.

Per position: the full distribution ``p``, the safe set ``S`` (from the rule), ``p_S`` and the exact
TV/KL/log-ratio are computed directly and compared with :mod:`safevocab.bounds`. Sequences: a tiny
autoregressive policy whose sequence space is enumerated exhaustively, so ``P``, ``Q``, ``TV(P, Q)`` and
``KL(Q || P)`` are exact. Exactness checks run in float64.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safevocab.bounds import (
    logprob_mismatch_bound,
    logprob_mismatch_bound_first_order,
    min_p_pruned_mass_bound,
    objective_bias_bound,
    pruned_logprob_mismatch_bound,
    pruned_mass,
    pruning_kl,
    pruning_tv,
    sequence_kl,
    sequence_tv,
    sequence_tv_upper_bound,
)
from safevocab.rules import Intersection, MinP, MinProb, NoPruning, TopK, TopP

F64 = torch.float64

# ----------------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------------

_elementary = st.one_of(
    st.floats(1e-4, 1.0).map(MinP),
    st.floats(1e-4, 0.5).map(MinProb),
    st.integers(1, 6).map(TopK),
    st.floats(0.05, 1.0).map(TopP),
)
rules_st = st.one_of(
    st.just(NoPruning()),
    _elementary,
    st.lists(_elementary, min_size=2, max_size=4, unique_by=type).map(lambda rs: Intersection.of(*rs)),
)


def _logits(seed: int, shape: tuple[int, ...], scale: float, n_neg_inf: int = 0) -> torch.Tensor:
    """Deterministic float64 logits; ``n_neg_inf`` entries per row set to ``-inf`` (never the first)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g, dtype=F64) * scale
    if n_neg_inf:
        z[..., 1 : 1 + n_neg_inf] = -math.inf
    return z


logit_args = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(2, 40),  # V
    st.sampled_from([0.1, 1.0, 3.0, 8.0]),  # scale: flat .. peaked
    st.integers(0, 2),  # -inf entries per row
)


def _pruned(z: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full p, p_S and the kept mass, all float64, directly from the definitions."""
    p = torch.softmax(z, dim=-1)
    kept = (p * keep).sum(dim=-1)
    p_s = p * keep / kept.unsqueeze(-1)
    return p, p_s, kept


# ----------------------------------------------------------------------------------------------------
# per-position statements
# ----------------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=60)
@given(args=logit_args, rule=rules_st)
def test_pruning_tv_kl_logratio_exact(args, rule):
    seed, vocab, scale, n_inf = args
    z = _logits(seed, (5, vocab), scale, min(n_inf, vocab - 1))
    keep = rule.keep_mask(z)
    p, p_s, kept = _pruned(z, keep)
    m = pruned_mass(p, keep)
    torch.testing.assert_close(m + kept, torch.ones_like(m), rtol=0, atol=1e-12)

    tv_direct = 0.5 * (p - p_s).abs().sum(dim=-1)
    torch.testing.assert_close(pruning_tv(kept), tv_direct, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(pruning_tv(kept), m, rtol=1e-9, atol=1e-12)

    log_ratio = torch.where(keep, torch.log(p_s) - torch.log(p), torch.zeros_like(p))
    kl_direct = torch.where(keep, p_s * log_ratio, torch.zeros_like(p)).sum(dim=-1)
    torch.testing.assert_close(pruning_kl(kept), kl_direct, rtol=1e-9, atol=1e-12)
    # log p_S(a) - log p(a) = -log(1 - m) for every kept a.
    expected = pruning_kl(kept).unsqueeze(-1).expand_as(p)
    torch.testing.assert_close(log_ratio[keep], expected[keep], rtol=1e-9, atol=1e-12)


@settings(deadline=None, max_examples=60)
@given(args=logit_args, rho=st.floats(1e-4, 1.0))
def test_min_p_pruned_mass_bound(args, rho):
    seed, vocab, scale, n_inf = args
    z = _logits(seed, (6, vocab), scale, min(n_inf, vocab - 1))
    keep = MinP(rho).keep_mask(z)
    p = torch.softmax(z, dim=-1)
    m = pruned_mass(p, keep)
    bound = min_p_pruned_mass_bound(p.amax(dim=-1), keep.sum(dim=-1), vocab, rho)
    # The safe set is computed in fp32, so a token within an fp32 ulp of the threshold may fall either way.
    assert bool((m <= bound * (1 + 1e-5) + 1e-12).all()), (m, bound)
    # Both terms of the min are real constraints: each alone also holds.
    assert bool((m <= 1 - p.amax(dim=-1) + 1e-12).all())


def test_min_p_bound_each_term_can_be_the_binding_one():
    # Few tokens pruned: the count term binds.  p_max small: 1 - p_max ... also check the values.
    assert min_p_pruned_mass_bound(0.9, 9, 10, 0.01) == pytest.approx(1 * 0.01 * 0.9)
    assert min_p_pruned_mass_bound(0.2, 1, 1000, 0.5) == pytest.approx(0.8)
    out = min_p_pruned_mass_bound(torch.tensor([0.9, 0.2]), torch.tensor([9, 1]), 1000, 0.5)
    torch.testing.assert_close(out, torch.tensor([min(0.1, 991 * 0.45), 0.8]))


def test_pruned_mass_handles_neg_inf_and_half_precision():
    z = torch.tensor([[2.0, 1.0, -math.inf, 0.0]])
    p = torch.softmax(z, dim=-1)
    keep = torch.tensor([[True, True, False, False]])
    assert pruned_mass(p, keep).item() == pytest.approx(p[0, 3].item())
    out = pruned_mass(p.to(torch.bfloat16), keep)
    assert out.dtype == torch.float32


# ----------------------------------------------------------------------------------------------------
# the training-inference mismatch bound
# ----------------------------------------------------------------------------------------------------


def _perturbations(seed: int, shape: tuple[int, ...], eps: float) -> list[torch.Tensor]:
    """Uniform, random-sign and adversarial-like (+-eps on random halves) perturbations, |delta| <= eps."""
    g = torch.Generator().manual_seed(seed + 1)
    uniform = (torch.rand(shape, generator=g, dtype=F64) * 2 - 1) * eps
    signs = (torch.randint(0, 2, shape, generator=g).to(F64) * 2 - 1) * eps
    return [uniform, signs, -signs, torch.full(shape, eps, dtype=F64), torch.zeros(shape, dtype=F64)]


def _adversarial(vocab: int, eps: float, sign: float = 1.0) -> torch.Tensor:
    """``[V, V]``: row a is delta with delta_a = -sign*eps and +sign*eps elsewhere."""
    return sign * eps * (1 - 2 * torch.eye(vocab, dtype=F64))


eps_st = st.sampled_from([1e-6, 1e-3, 0.05, 0.3, 1.0, 3.0])


@settings(deadline=None, max_examples=60)
@given(args=logit_args, eps=eps_st)
def test_mismatch_bound_holds_for_bounded_perturbations(args, eps):
    seed, vocab, scale, _ = args
    z = _logits(seed, (4, vocab), scale)
    p = torch.softmax(z, dim=-1)
    bound = logprob_mismatch_bound(p, eps)
    assert bound.shape == p.shape and bound.dtype == F64
    for delta in _perturbations(seed, z.shape, eps):
        assert float(delta.abs().max()) <= eps
        gap = (torch.log_softmax(z, dim=-1) - torch.log_softmax(z + delta, dim=-1)).abs()
        assert bool((gap <= bound * (1 + 1e-9) + 1e-12).all()), (gap - bound).max()
        # Both sides are eps-perturbations of each other: the bound at the inference probability holds too.
        bound_mu = logprob_mismatch_bound(torch.softmax(z + delta, dim=-1), eps)
        assert bool((gap <= bound_mu * (1 + 1e-9) + 1e-12).all())


@settings(deadline=None, max_examples=60)
@given(args=logit_args, eps=eps_st)
def test_mismatch_bound_is_attained(args, eps):
    """delta_a = -eps (+eps elsewhere) attains the bound at p = pi(a); the reverse attains it at mu(a)."""
    seed, vocab, scale, _ = args
    z = _logits(seed, (vocab,), scale)
    p = torch.softmax(z, dim=-1)
    idx = torch.arange(vocab)
    # Adversarial delta for token a in row a.
    perturbed = z + _adversarial(vocab, eps)
    gap = (torch.log_softmax(z, -1) - torch.log_softmax(perturbed, -1)[idx, idx]).abs()
    torch.testing.assert_close(gap, logprob_mismatch_bound(p, eps), rtol=1e-6, atol=1e-12)
    # Reverse signs: the gap equals the bound evaluated at the perturbed side's probability mu(a).
    perturbed = z + _adversarial(vocab, eps, sign=-1.0)
    mu = torch.softmax(perturbed, dim=-1)[idx, idx]
    gap = (torch.log_softmax(z, -1) - torch.log_softmax(perturbed, -1)[idx, idx]).abs()
    torch.testing.assert_close(gap, logprob_mismatch_bound(mu, eps), rtol=1e-6, atol=1e-12)


@settings(deadline=None, max_examples=60)
@given(args=logit_args, eps=eps_st, rule=rules_st)
def test_same_safe_set_obeys_pruned_bound_never_looser(args, eps, rule):
    seed, vocab, scale, _ = args
    z = _logits(seed, (4, vocab), scale)
    keep = rule.keep_mask(z)
    p, p_s, kept = _pruned(z, keep)
    pruned_bound = pruned_logprob_mismatch_bound(p, kept.unsqueeze(-1), eps)
    full_bound = logprob_mismatch_bound(p, eps)
    assert bool((pruned_bound[keep] <= full_bound[keep] + 1e-15).all())
    expected = logprob_mismatch_bound(p_s.clamp(max=1), eps)
    torch.testing.assert_close(pruned_bound[keep], expected[keep])

    def log_pi_s(logits):
        return torch.log_softmax(logits.masked_fill(~keep, -math.inf), dim=-1)

    for delta in _perturbations(seed, z.shape, eps):
        gap = (log_pi_s(z) - log_pi_s(z + delta)).abs()
        assert bool((gap[keep] <= pruned_bound[keep] * (1 + 1e-9) + 1e-12).all())

    # Tight on S too: delta = -eps on a, +eps elsewhere in S.
    # Row a of the adversarial batch perturbs token a by -eps and every other token by +eps.
    row_keep, idx = keep[0], torch.arange(vocab)
    perturbed = (z[0] + _adversarial(vocab, eps)).masked_fill(~row_keep, -math.inf)
    gap = (log_pi_s(z)[0] - torch.log_softmax(perturbed, dim=-1)[idx, idx]).abs()
    torch.testing.assert_close(gap[row_keep], pruned_bound[0][row_keep], rtol=1e-6, atol=1e-12)


@settings(deadline=None, max_examples=40)
@given(p=st.floats(0.01, 0.99), eps=st.floats(0.01, 2.0))
def test_first_order_form_is_not_a_bound(p, eps):
    """The attained gap exceeds 2 eps (1 - p) for every 0 < p < 1, eps > 0: the first-order form is no bound."""
    z = torch.tensor([math.log(p), math.log(1 - p)], dtype=F64)
    delta = torch.tensor([-eps, eps], dtype=F64)
    gap = (torch.log_softmax(z, -1)[0] - torch.log_softmax(z + delta, -1)[0]).abs().item()
    assert gap > logprob_mismatch_bound_first_order(p, eps)
    assert gap == pytest.approx(logprob_mismatch_bound(p, eps), rel=1e-9)


def test_first_order_violation_concrete_example():
    p, eps = 0.5, 0.5
    assert logprob_mismatch_bound_first_order(p, eps) == pytest.approx(0.5)
    assert logprob_mismatch_bound(p, eps) == pytest.approx(math.log(0.5 + 0.5 * math.e))  # 0.6201
    assert logprob_mismatch_bound(p, eps) > logprob_mismatch_bound_first_order(p, eps) + 0.1


def test_mismatch_bound_limits_and_numerics():
    eps = torch.tensor([0.0, 1e-12, 1e-3, 1.0, 400.0, 1e4], dtype=F64)
    # p = 0: the bound is 2 eps; p = 1: it is 0, even when exp(2 eps) overflows.
    torch.testing.assert_close(logprob_mismatch_bound(torch.zeros_like(eps), eps), 2 * eps)
    torch.testing.assert_close(logprob_mismatch_bound(torch.ones_like(eps), eps), torch.zeros_like(eps))
    # Tiny eps: relative agreement with the first-order form (a naive log(p + ...) returns 0 here).
    p = torch.tensor([0.0, 0.5, 1 - 1e-9], dtype=F64)
    tiny = logprob_mismatch_bound(p, 1e-15)
    torch.testing.assert_close(tiny, logprob_mismatch_bound_first_order(p, 1e-15), rtol=1e-9, atol=0)
    # Large eps in float32: finite, ~ 2 eps + log(1 - p).
    big = logprob_mismatch_bound(torch.tensor([0.5], dtype=torch.float32), 100.0)
    assert big.dtype == torch.float32 and torch.isfinite(big).all()
    assert big.item() == pytest.approx(200 + math.log(0.5), rel=1e-6)
    # Monotone: decreasing in p, increasing in eps.
    grid = logprob_mismatch_bound(torch.linspace(0, 1, 11, dtype=F64).unsqueeze(1), eps[:4])
    assert bool((grid.diff(dim=0) <= 0).all()) and bool((grid.diff(dim=1) >= 0).all())


def test_scalar_and_tensor_return_types():
    assert isinstance(logprob_mismatch_bound(0.3, 0.1), float)
    assert isinstance(pruning_tv(0.9), float) and isinstance(pruning_kl(1), float)
    assert isinstance(pruned_logprob_mismatch_bound(0.3, 0.9, 0.1), float)
    assert isinstance(objective_bias_bound(0.1, 0.0, 1.0), float)
    out = logprob_mismatch_bound(torch.rand(3, 1), torch.tensor([0.1, 0.2]))
    assert out.shape == (3, 2) and out.dtype == torch.float32
    # A kept mass a few ulps above 1 (rounding) is accepted and clamped.
    assert pruning_tv(torch.tensor(1.0 + 1e-7)).item() == 0.0


# ----------------------------------------------------------------------------------------------------
# sequences: exhaustive enumeration of a tiny autoregressive policy
# ----------------------------------------------------------------------------------------------------


class TinyPolicy:
    """Logits are a fixed random function of the prefix: ``table[t, index(prefix)]``.

    With ``eos=True`` token 0 ends a sequence; the enumeration then holds each complete sequence once
    (padded with 0 after the EOS) and the mask marks its real tokens.
    """

    def __init__(self, seed: int, vocab: int, horizon: int, scale: float, eos: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.horizon, self.eos = vocab, horizon, eos
        self.table = torch.randn(horizon, vocab ** max(horizon - 1, 0), vocab, generator=g, dtype=F64) * scale

    def prefix_index(self, ys: torch.Tensor, t: int) -> torch.Tensor:
        powers = self.vocab ** torch.arange(t - 1, -1, -1)
        return (ys[:, :t] * powers).sum(dim=-1) if t else torch.zeros(len(ys), dtype=torch.long)

    def logits(self, ys: torch.Tensor, t: int) -> torch.Tensor:
        return self.table[t, self.prefix_index(ys, t)]

    def mask(self, ys: torch.Tensor) -> torch.Tensor:
        """Real tokens: all of them, or (with EOS) up to and including the first EOS."""
        if not self.eos:
            return torch.ones_like(ys, dtype=torch.bool)
        ended_before = torch.cumsum((ys == 0).long(), dim=-1) - (ys == 0).long() > 0
        return ~ended_before

    def enumerate(self) -> torch.Tensor:
        ys = torch.tensor(list(itertools.product(range(self.vocab), repeat=self.horizon)), dtype=torch.long)
        ys = ys.reshape(-1, self.horizon)
        if self.eos:  # canonical padding: everything after the first EOS is 0
            mask = self.mask(ys)
            ys = ys[((ys == 0) | mask).all(dim=-1)]
        return ys

    def step_stats(self, ys: torch.Tensor, rule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per step: log p(y_t), log p_S(y_t) (-inf if y_t is pruned) and the kept mass ``[N, T]``."""
        logp, logq, kept = [], [], []
        for t in range(self.horizon):
            z = self.logits(ys, t)
            keep = rule.keep_mask(z)
            p, p_s, k = _pruned(z, keep)
            y = ys[:, t : t + 1]
            logp.append(torch.log(p.gather(-1, y)).squeeze(-1))
            logq.append(torch.log(p_s.gather(-1, y)).squeeze(-1))
            kept.append(k)
        return torch.stack(logp, -1), torch.stack(logq, -1), torch.stack(kept, -1)

    def exact(self, rule):
        ys = self.enumerate()
        mask = self.mask(ys)
        logp, logq, kept = self.step_stats(ys, rule)
        zero = torch.zeros((), dtype=F64)
        big_p = torch.where(mask, logp, zero).sum(-1).exp()
        big_q = torch.where(mask, logq, zero).sum(-1).exp()
        return ys, mask, big_p, big_q, kept

    def sample(self, rule, n: int, seed: int):
        """``n`` sequences from Q (the per-step pruned policy); returns kept masses and mask."""
        g = torch.Generator().manual_seed(seed)
        ys = torch.zeros(n, self.horizon, dtype=torch.long)
        for t in range(self.horizon):
            z = self.logits(ys, t)
            _, p_s, _ = _pruned(z, rule.keep_mask(z))
            ys[:, t] = torch.multinomial(p_s, 1, generator=g).squeeze(-1)
        if self.eos:  # canonical padding after EOS (the kept mass there is ignored through the mask)
            ys = torch.where(self.mask(ys), ys, torch.zeros_like(ys))
        _, _, kept = self.step_stats(ys, rule)
        return kept, self.mask(ys)


policy_args = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(3, 5),  # V
    st.integers(1, 4),  # T
    st.sampled_from([0.5, 1.5, 3.0]),  # logit scale
    st.booleans(),  # EOS / variable length
)


@settings(deadline=None, max_examples=40)
@given(
    args=policy_args,
    rule=rules_st,
    rewards_seed=st.integers(0, 2**31 - 1),
    r_range=st.sampled_from([(0.0, 1.0), (-2.0, 3.0)]),
)
def test_sequence_statements_exact_by_enumeration(args, rule, rewards_seed, r_range):
    seed, vocab, horizon, scale, eos = args
    policy = TinyPolicy(seed, vocab, horizon, scale, eos)
    ys, mask, big_p, big_q, kept = policy.exact(rule)
    assert big_p.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert big_q.sum().item() == pytest.approx(1.0, abs=1e-12)

    tv_exact = 0.5 * (big_p - big_q).abs().sum()
    support = big_q > 0
    kl_exact = (big_q[support] * (big_q[support].log() - big_p[support].log())).sum()

    tv = sequence_tv(kept, mask, weights=big_q)
    kl = sequence_kl(kept, mask, weights=big_q)
    assert tv.dtype == F64 and tv.dim() == 0
    assert abs(tv.item() - tv_exact.item()) <= 1e-9
    assert abs(kl.item() - kl_exact.item()) <= 1e-9
    upper = sequence_tv_upper_bound(kept, mask, weights=big_q)
    assert tv_exact.item() <= upper.item() + 1e-12

    # |J(P) - J(Q)| <= (r_max - r_min) TV(P, Q) for any reward in [r_min, r_max] ...
    r_min, r_max = r_range
    g = torch.Generator().manual_seed(rewards_seed)
    rewards = r_min + (r_max - r_min) * torch.rand(len(ys), generator=g, dtype=F64)
    bound = objective_bias_bound(tv, r_min, r_max)
    assert abs((big_p * rewards).sum() - (big_q * rewards).sum()).item() <= bound.item() + 1e-12
    # ... with equality for the reward r_max on {Q > P} and r_min elsewhere: the bound is tight.
    worst = torch.where(big_q > big_p, r_max, r_min)
    gap = abs((big_p * worst).sum() - (big_q * worst).sum()).item()
    assert gap == pytest.approx(bound.item(), abs=1e-9)


@pytest.mark.parametrize("rule", [MinP(0.1), TopK(2), TopP(0.7) & MinP(0.05), MinProb(0.15)], ids=str)
@pytest.mark.parametrize("eos", [False, True])
def test_sequence_monte_carlo_from_q_is_unbiased(rule, eos):
    policy = TinyPolicy(seed=7, vocab=5, horizon=4, scale=1.5, eos=eos)
    _, mask_all, _, big_q, kept_all = policy.exact(rule)
    tv_exact = sequence_tv(kept_all, mask_all, weights=big_q).item()
    kl_exact = sequence_kl(kept_all, mask_all, weights=big_q).item()

    n = 4000
    kept, mask = policy.sample(rule, n, seed=123)
    tv_est, kl_est = sequence_tv(kept, mask).item(), sequence_kl(kept, mask).item()
    log_prod = torch.where(mask, kept.log(), torch.zeros((), dtype=F64)).sum(-1)
    se_tv = (-torch.expm1(log_prod)).std().item() / math.sqrt(n)
    se_kl = (-log_prod).std().item() / math.sqrt(n)
    assert abs(tv_est - tv_exact) <= 5 * se_tv + 1e-12, (tv_est, tv_exact, se_tv)
    assert abs(kl_est - kl_exact) <= 5 * se_kl + 1e-12, (kl_est, kl_exact, se_kl)
    assert tv_exact <= sequence_tv_upper_bound(kept_all, mask_all, weights=big_q).item() + 1e-12


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), horizon=st.integers(0, 7))
def test_sequence_padding_is_ignored(seed, batch, horizon):
    g = torch.Generator().manual_seed(seed)
    kept = torch.rand(batch, horizon, generator=g, dtype=F64) * 0.9 + 0.1
    mask = torch.rand(batch, horizon, generator=g) < 0.7
    weights = torch.rand(batch, generator=g, dtype=F64) + 0.1
    # Reference: ragged per-row lists.
    rows = [kept[b][mask[b]] for b in range(batch)]
    w = weights / weights.sum()
    tv_ref = sum(w[b] * (1 - rows[b].prod()) for b in range(batch))
    kl_ref = sum(w[b] * (-rows[b].log().sum()) for b in range(batch))
    ub_ref = sum(w[b] * (1 - rows[b]).sum() for b in range(batch))
    for garbage in (0.0, math.nan, 5.0, -1.0):
        padded = torch.where(mask, kept, torch.full_like(kept, garbage))
        for m in (mask, mask.long(), mask.to(F64)):
            assert sequence_tv(padded, m, weights).item() == pytest.approx(float(tv_ref), abs=1e-12)
            assert sequence_kl(padded, m, weights).item() == pytest.approx(float(kl_ref), abs=1e-12)
            assert sequence_tv_upper_bound(padded, m, weights).item() == pytest.approx(float(ub_ref), abs=1e-12)
    # Unweighted = plain mean; no mask = every position real.
    unweighted = sum((1 - rows[b].prod()) for b in range(batch)) / batch
    assert sequence_tv(torch.where(mask, kept, 1.0), mask).item() == pytest.approx(float(unweighted), abs=1e-12)
    assert sequence_tv(torch.where(mask, kept, 1.0)).item() == pytest.approx(float(unweighted), abs=1e-12)


def test_sequence_tv_keeps_precision_for_tiny_pruned_mass():
    kept = torch.full((2, 1000), 1 - 1e-12, dtype=F64)
    assert sequence_tv(kept).item() == pytest.approx(1000 * 1e-12, rel=1e-3)
    assert sequence_kl(kept).item() == pytest.approx(1000 * 1e-12, rel=1e-3)
    # float32 input: computed in float64 inside.
    out = sequence_tv(torch.full((1, 3), 0.5))
    assert out.dtype == F64 and out.item() == pytest.approx(0.875)


# ----------------------------------------------------------------------------------------------------
# bad inputs: ValueError/TypeError naming the argument, the value and the accepted range
# ----------------------------------------------------------------------------------------------------

_K = torch.full((2, 3), 0.9)

BAD_INPUTS = [
    (lambda: logprob_mismatch_bound(1.5, 0.1), ValueError, ["p", "1.5", "0 <= p <= 1"]),
    (lambda: logprob_mismatch_bound(-0.1, 0.1), ValueError, ["p", "-0.1"]),
    (lambda: logprob_mismatch_bound(0.5, -0.1), ValueError, ["eps", "-0.1", ">= 0"]),
    (lambda: logprob_mismatch_bound(0.5, math.inf), ValueError, ["eps", "inf"]),
    (lambda: logprob_mismatch_bound(torch.tensor([0.5, math.nan]), 0.1), ValueError, ["p", "nan", "index (1,)"]),
    (lambda: logprob_mismatch_bound(torch.tensor([1]), 0.1), TypeError, ["p", "floating"]),
    (lambda: logprob_mismatch_bound("0.5", 0.1), TypeError, ["p", "str"]),
    (lambda: logprob_mismatch_bound(torch.rand(3), torch.rand(4)), ValueError, ["p (3,)", "eps (4,)"]),
    (lambda: logprob_mismatch_bound_first_order(0.5, -1.0), ValueError, ["eps", "-1.0"]),
    (lambda: pruning_tv(0.0), ValueError, ["kept_mass", "0.0", "0 < kept_mass <= 1"]),
    (lambda: pruning_tv(1.01), ValueError, ["kept_mass", "1.01"]),
    (lambda: pruning_kl(torch.tensor([[0.5, 1.2]])), ValueError, ["kept_mass", "index (0, 1)"]),
    (lambda: pruning_kl(True), TypeError, ["kept_mass", "bool"]),
    (lambda: pruned_mass(torch.rand(2, 3), torch.ones(2, 4, dtype=torch.bool)), ValueError, ["probs", "(2, 4)"]),
    (lambda: pruned_mass(torch.rand(2, 3), torch.ones(2, 3)), TypeError, ["keep", "bool"]),
    (lambda: pruned_mass(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)), TypeError, ["probs"]),
    (lambda: pruned_mass(-torch.rand(1, 3), torch.ones(1, 3, dtype=torch.bool)), ValueError, ["probs", ">= 0"]),
    (lambda: pruned_logprob_mismatch_bound(0.6, 0.5, 0.1), ValueError, ["p", "kept_mass"]),
    (lambda: pruned_logprob_mismatch_bound(0.1, 0.0, 0.1), ValueError, ["kept_mass", "0.0"]),
    (lambda: min_p_pruned_mass_bound(0.5, 3, 10, 0.0), ValueError, ["rho", "0.0", "0 < rho <= 1"]),
    (lambda: min_p_pruned_mass_bound(0.5, 3, 10, 1.5), ValueError, ["rho", "1.5"]),
    (lambda: min_p_pruned_mass_bound(0.5, 11, 10, 0.1), ValueError, ["safe_size", "11", "vocab_size=10"]),
    (lambda: min_p_pruned_mass_bound(0.5, 0, 10, 0.1), ValueError, ["safe_size", "0"]),
    (lambda: min_p_pruned_mass_bound(0.5, 3.0, 10, 0.1), TypeError, ["safe_size", "float"]),
    (lambda: min_p_pruned_mass_bound(0.5, 3, 0, 0.1), ValueError, ["vocab_size", "0", ">= 1"]),
    (lambda: min_p_pruned_mass_bound(1.5, 3, 10, 0.1), ValueError, ["p_max", "1.5"]),
    (lambda: objective_bias_bound(0.1, 1.0, 0.0), ValueError, ["r_max", "r_min", "r_max >= r_min"]),
    (lambda: objective_bias_bound(1.1, 0.0, 1.0), ValueError, ["tv", "1.1"]),
    (lambda: objective_bias_bound(0.1, -math.inf, 1.0), ValueError, ["r_min", "finite"]),
    (lambda: sequence_tv(torch.full((3,), 0.9)), ValueError, ["kept_mass", "(3,)", "[B, T]"]),
    (lambda: sequence_tv(torch.ones(0, 3)), ValueError, ["kept_mass", "B >= 1"]),
    (lambda: sequence_tv(torch.ones(2, 3, dtype=torch.long)), TypeError, ["kept_mass", "floating"]),
    (lambda: sequence_tv(torch.tensor([[0.5, 0.0]])), ValueError, ["kept_mass", "0.0", "index (0, 1)"]),
    (lambda: sequence_kl(torch.tensor([[0.5, 1.5]])), ValueError, ["kept_mass", "1.5"]),
    (lambda: sequence_tv(_K, mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, ["mask", "(2, 2)", "(2, 3)"]),
    (lambda: sequence_tv(_K, mask=torch.full((2, 3), 2)), ValueError, ["mask", "2"]),
    (lambda: sequence_tv(_K, mask=[[1, 1, 1]] * 2), TypeError, ["mask", "list"]),
    (lambda: sequence_kl(_K, weights=torch.ones(3)), ValueError, ["weights", "(3,)", "(2,)"]),
    (lambda: sequence_kl(_K, weights=torch.tensor([1.0, -1.0])), ValueError, ["weights", "-1.0", ">= 0"]),
    (lambda: sequence_kl(_K, weights=torch.zeros(2)), ValueError, ["weights", "sum"]),
    (lambda: sequence_tv_upper_bound(_K, weights=torch.ones(2, dtype=torch.long)), TypeError, ["weights"]),
]


@pytest.mark.parametrize("call, exc, fragments", BAD_INPUTS)
def test_bad_inputs_raise_naming_argument_value_and_range(call, exc, fragments):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
