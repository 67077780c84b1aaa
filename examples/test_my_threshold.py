"""Unit-test your own safe-vocabulary thresholds with ``safevocab.testing``.

Run with ``pytest examples/test_my_threshold.py`` (needs ``hypothesis``). It shows three kinds of test:

1. a property test: a threshold *policy* (``min_p`` chosen from a TV budget) keeps the per-position
   pruning bias within budget for any logits hypothesis can find (flat, peaked, heavy-tailed, ties, -inf);
2. a mismatch test: two numerically different computations of the same logits (an fp32 and a bf16 LM
   head, standing in for the training and inference engines) keep every kept token's log-probability gap
   within the tight bound, plus the same check under simulated bounded engine noise;
3. a sequence test: rollouts from a toy autoregressive model sampled with the pruned sampler keep the
   sequence-level ``TV(P, Q)`` (and so the reward bias) within budget.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safevocab import MinP, parse_rule, safe_log_softmax
from safevocab.bounds import objective_bias_bound, sequence_tv
from safevocab.testing import (
    assert_mismatch_within_bound,
    assert_pruning_bias_within,
    assert_sequence_bias_within,
    logits,
    perturbations,
    rules,
)


# --- the code under test: your threshold policy -----------------------------------------------------
def choose_min_p(vocab_size: int, tv_budget: float) -> MinP:
    """Pick ``min_p = budget / V``: every pruned token has ``p < min_p * p_max <= budget / V``, so the
    pruned mass (= per-position TV) stays below ``budget`` whatever the logits."""
    return MinP(min(1.0, tv_budget / vocab_size))


@settings(deadline=None, max_examples=60)
@given(z=logits(vocab_size=st.integers(2, 256)), budget=st.sampled_from([1e-3, 1e-2, 0.1]))
def test_threshold_policy_respects_tv_budget(z, budget):
    rule = choose_min_p(z.shape[-1], budget)
    assert_pruning_bias_within(z, rule, max_tv=budget)


# --- mismatch between two engines ----------------------------------------------------------------------
ENGINE_EPS = 0.05  # the largest logit error you accept between training and inference


def test_bf16_head_stays_within_mismatch_bound():
    torch.manual_seed(0)
    hidden = torch.randn(32, 64)
    head = torch.randn(100, 64) / 8
    train = hidden @ head.T  # fp32 "training engine"
    infer = (hidden.bfloat16() @ head.bfloat16().T).float()  # bf16 "inference engine"
    measured = (infer - train).abs().max().item()
    assert measured <= ENGINE_EPS, f"engines differ by {measured:.4f} > {ENGINE_EPS}"
    for rule in ("none", "min_p=0.01", "top_k=20,min_p=0.001"):
        assert_mismatch_within_bound(train, infer, rule, eps=ENGINE_EPS)


@settings(deadline=None, max_examples=40)
@given(z=logits(dtype=torch.float64), rule=rules(kinds=("min_p", "top_k", "top_p")), data=st.data())
def test_any_bounded_engine_noise_stays_within_bound(z, rule, data):
    delta = data.draw(perturbations(tuple(z.shape), ENGINE_EPS, dtype=torch.float64))
    assert_mismatch_within_bound(z, z + delta, rule, eps=ENGINE_EPS)


# --- sequence-level bias of rollouts ---------------------------------------------------------------------
class ToyLM(torch.nn.Module):
    """A tiny autoregressive model: next-token logits from the embedding of the previous token."""

    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V]
        return self.head(self.embed(tokens)) * 3.0


@torch.no_grad()
def sample_pruned(model: ToyLM, rule, n: int, length: int, eos: int = 0, seed: int = 0):
    """Roll out from the pruned sampler; return per-token kept mass ``[n, length]`` and the mask."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((n, 1), 1)  # BOS
    for _ in range(length):
        z = model(tokens)[:, -1]
        probs = torch.softmax(z.masked_fill(~rule.keep_mask(z), float("-inf")), dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=g)], dim=1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out = safe_log_softmax(model(inputs), targets, rule)
    assert out.in_safe.all()  # the sampler and the training log-probabilities share one support
    ended = torch.cumsum((targets == eos).long(), dim=1) - (targets == eos).long() > 0
    return out.log_kept_mass.exp(), ~ended


def test_rollouts_keep_sequence_bias_small():
    torch.manual_seed(0)
    model = ToyLM()
    kept, mask = sample_pruned(model, parse_rule("min_p=0.005"), n=256, length=12)
    assert_sequence_bias_within(kept, mask, max_tv=0.05, max_kl=0.05)
    # With rewards in [0, 1], the expected reward moves by at most TV(P, Q).
    assert objective_bias_bound(sequence_tv(kept, mask), 0.0, 1.0) <= 0.05


def test_too_aggressive_threshold_is_caught():
    torch.manual_seed(0)
    model = ToyLM()
    kept, mask = sample_pruned(model, parse_rule("min_p=0.02"), n=256, length=12)
    with pytest.raises(AssertionError, match="exceeds max_tv=0.05"):
        assert_sequence_bias_within(kept, mask, max_tv=0.05)
