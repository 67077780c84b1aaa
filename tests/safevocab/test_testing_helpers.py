"""safevocab.testing: the strategies produce valid values; the assertions pass on good inputs and fail
on bad ones with informative messages."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safevocab.bounds import pruning_tv
from safevocab.rules import Intersection, MinP, NoPruning, SafeVocabRule, TopK, parse_rule
from safevocab.testing import (
    LOGIT_KINDS,
    assert_mismatch_within_bound,
    assert_pruning_bias_within,
    assert_sequence_bias_within,
    logits,
    perturbations,
    rules,
)

# ----------------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=80)
@given(z=logits())
def test_logits_default_strategy_is_valid(z):
    assert isinstance(z, torch.Tensor) and z.dtype == torch.float32
    assert 1 <= z.dim() <= 3 and 2 <= z.shape[-1] <= 64
    assert not torch.isnan(z).any() and not torch.isposinf(z).any()
    assert torch.isfinite(z).any(dim=-1).all()  # every row has a token of nonzero probability


@settings(deadline=None, max_examples=40)
@given(
    z=logits(
        batch_shape=(3, 2), vocab_size=7, dtype=torch.float64, scale=st.sampled_from([0.5, 2.0]), allow_neg_inf=False
    ),
)
def test_logits_fixed_arguments(z):
    assert z.shape == (3, 2, 7) and z.dtype == torch.float64
    assert torch.isfinite(z).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(deadline=None, max_examples=20)
@given(data=st.data())
def test_logits_half_dtypes(dtype, data):
    z = data.draw(logits(dtype=dtype))
    assert z.dtype == dtype and torch.isfinite(z).any(dim=-1).all()


@pytest.mark.parametrize("kind", LOGIT_KINDS)
def test_logits_each_kind_has_its_shape_of_distribution(kind):
    samples = []

    @settings(deadline=None, max_examples=15, database=None)
    @given(z=logits(batch_shape=(8,), vocab_size=32, kinds=(kind,), allow_neg_inf=False, dtype=torch.float64))
    def collect(z):
        samples.append(torch.softmax(z, dim=-1).amax(dim=-1))

    collect()
    p_max = torch.cat(samples)
    if kind == "flat":
        assert bool((p_max < 1.5 / 32).all())
    if kind == "peaked":
        assert bool((p_max > 0.99).all())


@settings(deadline=None, max_examples=80)
@given(rule=rules())
def test_rules_strategy_gives_valid_round_tripping_rules(rule):
    assert isinstance(rule, SafeVocabRule)
    assert parse_rule(str(rule)) == rule
    z = torch.randn(3, 20)
    keep = rule.keep_mask(z)
    assert keep.any(dim=-1).all()
    assert keep.gather(-1, z.argmax(dim=-1, keepdim=True)).all()  # the argmax is always kept


@settings(deadline=None, max_examples=30)
@given(rule=rules(kinds=("min_p", "top_k"), allow_none=False, max_top_k=5))
def test_rules_strategy_respects_kinds(rule):
    assert {p.key for p in rule.parts} <= {"min_p", "top_k"} and rule.parts
    assert all(p.k <= 5 for p in rule.parts if isinstance(p, TopK))


def test_rules_strategy_covers_all_shapes():
    seen = set()

    @settings(deadline=None, max_examples=150, database=None)
    @given(rule=rules())
    def collect(rule):
        seen.add(type(rule).__name__)

    collect()
    assert {"NoPruning", "Intersection", "MinP", "MinProb", "TopK", "TopP"} <= seen


@settings(deadline=None, max_examples=80)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 9)),
    eps=st.floats(0, 3) | st.sampled_from([0.1, 1e-3, 1 / 3]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    data=st.data(),
)
def test_perturbations_are_bounded_exactly(shape, eps, dtype, data):
    delta = data.draw(perturbations(shape, eps, dtype=dtype))
    assert delta.shape == shape and delta.dtype == dtype
    assert float(delta.to(torch.float64).abs().max()) <= eps


def test_perturbation_kinds_include_the_adversarial_pattern():
    found = []

    @settings(deadline=None, max_examples=60, database=None)
    @given(delta=perturbations((4, 6), 0.25, dtype=torch.float64, kinds=("adversarial",)))
    def collect(delta):
        found.append(delta)

    collect()
    for delta in found:  # exactly one -eps per row, +eps elsewhere
        assert ((delta == -0.25).sum(dim=-1) == 1).all() and ((delta == 0.25).sum(dim=-1) == 5).all()


def test_strategies_reject_bad_arguments_when_built():
    with pytest.raises(ValueError, match="kinds"):
        logits(kinds=("nope",))
    with pytest.raises(ValueError, match="vocab_size=0"):
        logits(vocab_size=0)
    with pytest.raises(TypeError, match="dtype"):
        logits(dtype=torch.int64)
    with pytest.raises(ValueError, match="eps=-1.0"):
        perturbations((2, 3), -1.0)
    with pytest.raises(ValueError, match="kinds"):
        perturbations((2, 3), 0.1, kinds=("gaussian",))
    with pytest.raises(ValueError, match="kinds"):
        rules(kinds=())
    with pytest.raises(ValueError, match="max_top_k=0"):
        rules(max_top_k=0)


# ----------------------------------------------------------------------------------------------------
# assert_pruning_bias_within
# ----------------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=50)
@given(z=logits(), rule=rules())
def test_pruning_bias_assertion_passes_at_the_exact_value(z, rule):
    keep = rule.keep_mask(z)
    p = torch.softmax(z.double(), dim=-1)
    worst_tv = float(pruning_tv((p * keep).sum(-1).clamp(max=1)).max())
    assert_pruning_bias_within(z, rule, max_tv=min(1.0, worst_tv + 1e-5))
    assert_pruning_bias_within(z, rule, max_kl=-math.log(max(1e-300, 1 - worst_tv)) + 1e-4)


def test_pruning_bias_assertion_fails_with_worst_position():
    z = torch.zeros(2, 3, 10)
    z[1, 2, :5] = 1.0  # position (1, 2): min_p=0.9 keeps the 5 tokens at 1.0, prunes 5 at 0.0
    z[0, 0, 0] = 10.0  # a confident position prunes almost nothing
    assert_pruning_bias_within(z[0, :1], "min_p=0.9", max_tv=1e-3)
    with pytest.raises(AssertionError) as info:
        assert_pruning_bias_within(z, "min_p=0.9", max_tv=0.2)
    message = str(info.value)
    expected_tv = 5 / (5 + 5 * math.e)
    assert "position (1, 2)" in message and f"{expected_tv:.6g}" in message and "max_tv=0.2" in message
    assert "|S|=5 of V=10" in message
    with pytest.raises(AssertionError, match="KL"):
        assert_pruning_bias_within(z, MinP(0.9), max_kl=0.05)


def test_pruning_bias_assertion_applies_temperature():
    z = torch.tensor([[3.0, 0.0, 0.0, 0.0]])
    assert_pruning_bias_within(z, "top_k=1", max_tv=0.15)  # m = 3 / (e^3 + 3) = 0.13
    with pytest.raises(AssertionError):
        assert_pruning_bias_within(z, "top_k=1", max_tv=0.15, temperature=2.0)  # m = 3 / (e^1.5 + 3) = 0.4


def test_pruning_bias_assertion_rejects_bad_limits():
    z = torch.randn(2, 5)
    with pytest.raises(ValueError, match="max_tv"):
        assert_pruning_bias_within(z, "top_k=2")
    with pytest.raises(ValueError, match="max_tv=1.5"):
        assert_pruning_bias_within(z, "top_k=2", max_tv=1.5)
    with pytest.raises(ValueError, match="max_kl=-1"):
        assert_pruning_bias_within(z, "top_k=2", max_kl=-1.0)


# ----------------------------------------------------------------------------------------------------
# assert_mismatch_within_bound
# ----------------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=60)
@given(
    z=logits(dtype=torch.float64),
    rule=rules() | st.none(),
    eps=st.sampled_from([0.0, 1e-3, 0.1, 1.0]),
    temperature=st.sampled_from([1.0, 0.7]),
    data=st.data(),
)
def test_mismatch_assertion_passes_for_bounded_perturbations(z, rule, eps, temperature, data):
    delta = data.draw(perturbations(tuple(z.shape), eps, dtype=torch.float64))
    infer = z + delta  # -inf + delta stays -inf: the same masked tokens on both sides
    assert_mismatch_within_bound(z, infer, rule, temperature=temperature)  # eps measured per position
    assert_mismatch_within_bound(z, infer, rule, eps=eps, temperature=temperature)


def test_mismatch_assertion_is_tight_and_fails_when_eps_is_understated():
    z = torch.tensor([[2.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
    eps = 0.3
    delta = torch.full_like(z, eps)
    delta[0, 2] = -eps  # adversarial for token 2: the gap attains the bound
    assert_mismatch_within_bound(z, z + delta, eps=eps)
    with pytest.raises(AssertionError) as info:
        assert_mismatch_within_bound(z, z + delta, eps=0.9 * eps)
    message = str(info.value)
    assert "token 2" in message and "position (0,)" in message and "measured max |delta|" in message


def test_mismatch_assertion_fails_when_safe_sets_are_not_shared():
    # A "buggy" pipeline that renormalises inference over S but compares with full training log-probs:
    # the log(kept mass) offset is far outside the bound for a tiny eps.
    z = torch.tensor([[3.0, 2.0, -4.0, -5.0]])
    rule = MinP(0.1)
    keep = rule.keep_mask(z)
    full_logp = torch.log_softmax(z, dim=-1)
    renormalised = torch.log_softmax(z.masked_fill(~keep, -math.inf), dim=-1).masked_fill(~keep, -30.0)
    with pytest.raises(AssertionError, match="exceeds the mismatch bound"):
        assert_mismatch_within_bound(full_logp, renormalised, None, eps=1e-3)


def test_mismatch_assertion_with_rule_checks_kept_tokens_only():
    z = torch.tensor([[5.0, 4.0, -3.0, -3.0]], dtype=torch.float64)
    infer = z.clone()
    infer[0, 2:] += torch.tensor([1.0, -1.0], dtype=torch.float64)  # big noise on pruned tokens only
    assert_mismatch_within_bound(z, infer, "top_k=2", eps=0.0)  # kept tokens: identical log pi_S
    with pytest.raises(AssertionError):
        assert_mismatch_within_bound(z, infer, None, eps=0.0)


def test_mismatch_assertion_rejects_bad_inputs():
    z = torch.randn(2, 5)
    with pytest.raises(ValueError, match="same shape"):
        assert_mismatch_within_bound(z, torch.randn(2, 6))
    with pytest.raises(ValueError, match="eps=-0.1"):
        assert_mismatch_within_bound(z, z, eps=-0.1)
    other = z.clone()
    other[0, 1] = -math.inf
    with pytest.raises(ValueError, match="-inf"):
        assert_mismatch_within_bound(z, other)
    with pytest.raises(TypeError, match="train_logits"):
        assert_mismatch_within_bound(z.long(), z)


# ----------------------------------------------------------------------------------------------------
# assert_sequence_bias_within
# ----------------------------------------------------------------------------------------------------


def test_sequence_bias_assertion_passes_and_fails():
    kept = torch.tensor([[0.99, 0.98, 0.5], [0.999, 0.999, 0.999]])
    mask = torch.tensor([[True, True, False], [True, True, True]])  # the 0.5 is padding
    tv = 0.5 * ((1 - 0.99 * 0.98) + (1 - 0.999**3))
    assert_sequence_bias_within(kept, mask, max_tv=tv + 1e-6)
    assert_sequence_bias_within(kept, mask, max_tv=0.02, max_kl=0.02)
    with pytest.raises(AssertionError) as info:
        assert_sequence_bias_within(kept, mask, max_tv=tv - 1e-4)
    message = str(info.value)
    assert "TV(P, Q)" in message and "worst sequence 0" in message and "over 2 tokens" in message
    with pytest.raises(AssertionError, match="KL"):
        assert_sequence_bias_within(kept, mask, max_kl=1e-3)
    # Without the mask the padding 0.5 counts, and the TV jumps.
    with pytest.raises(AssertionError):
        assert_sequence_bias_within(kept, max_tv=0.02)


def test_sequence_bias_assertion_rejects_bad_inputs():
    kept = torch.full((2, 3), 0.9)
    with pytest.raises(ValueError, match="max_tv"):
        assert_sequence_bias_within(kept)
    with pytest.raises(ValueError, match="kept_mass"):
        assert_sequence_bias_within(torch.full((2, 3), 1.5), max_tv=0.1)


def test_intersection_rule_strings_work_in_assertions():
    z = torch.randn(4, 16)
    rule = Intersection.of(TopK(8), MinP(0.01))
    assert_pruning_bias_within(z, str(rule), max_tv=1.0)
    assert_pruning_bias_within(z, NoPruning(), max_tv=1e-6)


USER_TEST = """
import torch
from safevocab.testing import assert_mismatch_within_bound, assert_pruning_bias_within, assert_sequence_bias_within

def test_pruning():
    assert_pruning_bias_within(torch.arange(8.0).expand(2, 8), "top_k=1", max_tv=0.1)

def test_mismatch():
    z = torch.zeros(1, 4)
    assert_mismatch_within_bound(z, z + torch.tensor([[0.0, 0.0, 0.0, 3.0]]), eps=0.01)

def test_sequence():
    assert_sequence_bias_within(torch.full((2, 3), 0.5), max_tv=0.1)

def test_misuse():
    assert_pruning_bias_within(torch.zeros(2, 8), "top_k=1", max_tv=2.0)
"""


def test_a_failing_user_test_shows_the_message_not_the_helpers_source(tmp_path):
    """Issue 31: a failure inside the helpers printed ~50 lines of their source before the message; with
    ``__tracebackhide__`` pytest points at the user's call and prints the message."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "test_user.py").write_text(USER_TEST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *sys.path])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_user.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "4 failed" in done.stdout, done.stdout[-2000:]
    assert "safevocab/testing/assertions.py" not in done.stdout and "raise AssertionError(" not in done.stdout
    for message in ("pruning TV 0.367", "exceeds the mismatch bound", "TV(P, Q) = ", "max_tv=2.0 is out of range"):
        assert message in done.stdout, message
    # Each failure is shown at the user's line, in a few lines rather than the helpers' source.
    assert done.stdout.count("test_user.py:") >= 4
    assert len(done.stdout.splitlines()) < 120, done.stdout
