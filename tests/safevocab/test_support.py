"""SafeSupport (replayed kept ids): construction, errors, and both entry points on exactly those sets.

Values and gradients against the float64 reference are fuzzed in ``test_reference_fuzz.py``
(``test_fused_with_support_matches_reference``); the real vLLM ``SamplingMask`` is used in
``tests/trl_integration/grpo/test_vllm_engine.py`, `tests/trl_integration/rollout/test_vllm_bounds.py`` where vLLM is installed.
"""

from __future__ import annotations

import math

import pytest
import torch
from backward_path import set_sparse_max_density

from safevocab import SafeSupport, fused_safe_logprobs, parse_rule, safe_log_softmax
from safevocab.bounds import pruned_mass, pruning_kl, pruning_tv


def test_from_lists_is_csr_and_to_dense_marks_the_ids():
    support = SafeSupport.from_lists([[3, 0], [1], [2, 4, 5]])
    assert support.token_ids.tolist() == [3, 0, 1, 2, 4, 5]
    assert support.offsets.tolist() == [0, 2, 3, 6]
    assert support.sizes.tolist() == [2, 1, 3]
    dense = support.to_dense(6)
    assert dense.tolist() == [
        [True, False, False, True, False, False],
        [False, True, False, False, False, False],
        [False, False, True, False, True, True],
    ]


def test_what_replay_reads_on_the_host_is_the_supports_own():
    """The op replays a support with no device read of its own: where a chunk's entries start (``entry_starts``) and
    the largest id (checked against ``V``) were read when it was built; they must be the tensors' values."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        rows = [torch.randperm(50, generator=gen)[: int(torch.randint(1, 6, (1,), generator=gen))].tolist()
                for _ in range(int(torch.randint(1, 9, (1,), generator=gen)))]  # fmt: skip
        support = SafeSupport.from_lists(rows)
        n = support.num_rows
        assert support.entry_starts(range(n + 1)) == support.offsets.tolist()
        assert support.entry_starts([n, 0]) == [support.token_ids.numel(), 0]
        largest = max(max(r) for r in rows)
        support.check(largest + 1)  # every id below V: no error
        with pytest.raises(ValueError, match=f"has token id {largest}: accepted 0 <= id < vocab_size={largest}$"):
            support.check(largest)


def test_a_support_is_its_own_copy_and_old_pickles_load():
    """What the op reads on the host was read when the support was built, so the support keeps its own tensors: an
    in-place write to the caller's ids once slipped an id past ``check`` (an ``IndexError`` in the op, out of bounds on
    a device), and one to its offsets changed the sets silently. A support pickled before it kept those facts loads."""
    import pickle

    ids, offsets = torch.tensor([0, 3, 5]), torch.tensor([0, 2, 3])
    support = SafeSupport(ids, offsets)
    ids[1], offsets[1] = 99, 1  # the caller's tensors change; the support does not
    assert support.token_ids.tolist() == [0, 3, 5] and support.offsets.tolist() == [0, 2, 3]
    support.check(6)
    hidden, weight, targets = torch.randn(2, 4), torch.randn(6, 4), torch.tensor([3, 5])
    got = fused_safe_logprobs(hidden, weight, targets, None, support=support, max_chunk_bytes=24)
    want = safe_log_softmax(hidden @ weight.T, targets, None, support=SafeSupport.from_lists([[0, 3], [5]]))
    torch.testing.assert_close(got.logprobs, want.logprobs)
    assert got.safe_size.tolist() == [2, 1]

    old = SafeSupport.from_lists([[0, 3], [5]])
    del old.__dict__["_host_offsets"], old.__dict__["_max_id"]  # as pickled before 2026-11-29
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded.entry_starts([0, 1, 2]) == [0, 2, 3]
    with pytest.raises(ValueError, match="SafeSupport row 0 has token id 3: accepted 0 <= id < vocab_size=3"):
        loaded.check(3)


@pytest.mark.parametrize(
    "rows, vocab, fragment",
    [
        ([[0, 7]], 6, "SafeSupport row 0 has token id 7: accepted 0 <= id < vocab_size=6"),
        ([[0], [2, 6]], 6, "SafeSupport row 1 has token id 6: accepted 0 <= id < vocab_size=6"),  # id == V
        ([[1], [-2]], 6, "SafeSupport row 1 has a negative token id"),
        ([[1], [2, 3, 2]], 6, "SafeSupport row 1 lists token id 2 twice"),
        ([[1], []], 6, "SafeSupport row 1 is empty"),
    ],
)
def test_bad_supports_raise_one_line_naming_the_row(rows, vocab, fragment):
    hidden, weight = torch.randn(len(rows), 3), torch.randn(vocab, 3)
    with pytest.raises(ValueError) as err:
        fused_safe_logprobs(
            hidden, weight, torch.zeros(len(rows), dtype=torch.long), None, support=SafeSupport.from_lists(rows)
        )
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_ids_near_the_int64_limit_are_no_false_duplicates():
    """Distinct (row, id) pairs with ids >= 2^62 (row 0's 4 and row 4's 0 shared an overflowed key) are accepted;
    a real duplicate of such an id is still named."""
    support = SafeSupport.from_lists([[2**62, 4], [1], [1], [1], [0]])
    assert support.token_ids.tolist() == [2**62, 4, 1, 1, 1, 0]
    SafeSupport.from_lists([[5, 2**63 - 1], [1], [5]])
    with pytest.raises(
        ValueError, match=f"^SafeSupport row 1 lists token id {2**63 - 1} twice: accepted distinct ids$"
    ):
        SafeSupport.from_lists([[7], [2**63 - 1, 5, 2**63 - 1]])


def test_support_length_must_match_the_targets():
    support = SafeSupport.from_lists([[0], [1]])
    for call in (
        lambda: fused_safe_logprobs(
            torch.randn(3, 2), torch.randn(4, 2), torch.zeros(3, dtype=torch.long), None, support=support
        ),
        lambda: safe_log_softmax(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), None, support=support),
    ):
        with pytest.raises(ValueError, match="support has 2 rows but the targets have 3 positions"):
            call()
    with pytest.raises(TypeError, match="support must be a safevocab.SafeSupport"):
        safe_log_softmax(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), None, support=[[0], [1]])


@pytest.mark.parametrize("rule", [None, "top_k=3", "min_p=0.05"])
@pytest.mark.parametrize("dense_chunks", [False, True])
def test_fused_equals_materialised_on_the_replayed_sets(rule, dense_chunks, monkeypatch):
    set_sparse_max_density(monkeypatch, 0.0 if dense_chunks else 1.0)
    g = torch.Generator().manual_seed(0)
    n, h, v = 19, 6, 40
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    logits = hidden.detach() @ weight.detach().t()
    # each row: the argmax plus a few random ids (the engine's set, slightly different from the rule's)
    rows = [sorted({int(logits[i].argmax())} | set(torch.randperm(v, generator=g)[:4].tolist())) for i in range(n)]
    support = SafeSupport.from_lists(rows)
    targets = torch.tensor([r[-1] for r in rows])
    out = fused_safe_logprobs(
        hidden, weight, targets, rule, support=support, compute_entropy=True, max_chunk_bytes=40 * 20 * 4
    )
    z = hidden @ weight.t()
    ref = safe_log_softmax(z, targets, rule, support=support, compute_entropy=True)
    keep = support.to_dense(v) & (parse_rule(rule).keep_mask(logits) if rule else True)
    assert torch.equal(out.safe_size, keep.sum(-1)) and torch.equal(ref.safe_size, keep.sum(-1))
    for field in ("logprobs", "log_kept_mass", "entropy"):
        torch.testing.assert_close(getattr(out, field), getattr(ref, field), rtol=1e-12, atol=1e-12)
    loss = lambda o: (o.logprobs * o.in_safe).sum() + o.log_kept_mass.sum() + 0.3 * o.entropy.sum()  # noqa: E731
    fused = torch.autograd.grad(loss(out), (hidden, weight))
    materialised = torch.autograd.grad(loss(ref), (hidden, weight))
    for a, b in zip(fused, materialised):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_replayed_set_far_below_the_maximum_stays_finite_in_fp32():
    """A replayed set need not hold the trainer's argmax: exp(z - m) underflows to 0 on it in fp32."""
    hidden = torch.ones(1, 1, requires_grad=True)
    weight = torch.tensor([[0.0], [-200.0], [-201.0]], requires_grad=True)
    out = fused_safe_logprobs(
        hidden, weight, torch.tensor([1]), None, support=SafeSupport.from_lists([[1, 2]]), compute_entropy=True
    )
    p = 1 / (1 + math.exp(-1))
    tol = 2 * 2**-23 * 201  # two ulps of the logits (~200) in fp32
    assert out.logprobs.item() == pytest.approx(math.log(p), abs=tol)
    assert out.entropy.item() == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), abs=tol)
    (g,) = torch.autograd.grad(out.logprobs.sum(), (weight,))
    assert torch.isfinite(g).all() and g[1].item() == pytest.approx(1 - p, abs=tol)


# The float64 answer of issue 37's N13 reproducer: S = {0, 1} with logits [0, 0.3], 3e7 z-units below the maximum.
_N13_LOGPROB = 0.0 - math.log(1 + math.exp(0.3))
_N13_P0 = 1 / (1 + math.exp(0.3))
_N13_ENTROPY = -(_N13_P0 * math.log(_N13_P0) + (1 - _N13_P0) * math.log(1 - _N13_P0))


@pytest.mark.parametrize("entry", ["materialised", "fused-sparse", "fused-dense", "fused-softcap", "fused-chunks"])
def test_replayed_set_1e6_below_the_maximum_keeps_its_precision(entry, monkeypatch):
    """Issue 37, N13: the materialised op formed ``z - m`` in fp32 before S's own shift, so a set ~3e7 below the row
    maximum became a tie plus a rounding step (log-prob 0.0, entropy 0, gradient [0, -1, 0]); float64: -0.8544, 0.6820,
    [0.574, -0.574, 0]. The fused op shifts by S's maximum on every path (sparse, dense, softcap, several chunks)."""
    raw = torch.tensor([[0.0, 0.3, 3e7]] * 3)
    support = SafeSupport.from_lists([[0, 1]] * 3)
    targets = torch.zeros(3, dtype=torch.long)
    if entry == "materialised":
        logits = raw.clone().requires_grad_()
        out = safe_log_softmax(logits, targets, None, support=support, compute_entropy=True)
        (grad,) = torch.autograd.grad(out.logprobs.sum(), logits)
    else:
        set_sparse_max_density(monkeypatch, 0.0 if entry == "fused-dense" else 1.0)
        hidden, weight = torch.ones(3, 1), raw[0].reshape(3, 1).clone().requires_grad_()
        kwargs = {"softcap": 1e9} if entry == "fused-softcap" else {}
        if entry == "fused-chunks":
            kwargs["max_chunk_bytes"] = 12  # one row per chunk
        out = fused_safe_logprobs(hidden, weight, targets, None, support=support, compute_entropy=True, **kwargs)
        (grad,) = torch.autograd.grad(out.logprobs.sum(), weight)
        grad = grad.reshape(1, 3).expand(3, 3) / 3  # the weight gradient sums the three rows
    tol = 1e-5
    assert out.logprobs.tolist() == pytest.approx([_N13_LOGPROB] * 3, abs=tol), entry
    assert out.entropy.tolist() == pytest.approx([_N13_ENTROPY] * 3, abs=tol), entry
    for row in grad.tolist():
        assert row == pytest.approx([1 - _N13_P0, -(1 - _N13_P0), 0.0], abs=tol), entry
    z_max = 1e9 * math.tanh(3e7 / 1e9) if entry == "fused-softcap" else 3e7
    assert out.log_kept_mass.tolist() == pytest.approx([-z_max] * 3, rel=1e-6), entry


def test_support_that_misses_the_rule_raises():
    logits = torch.tensor([[3.0, 0.0, -1.0]])
    with pytest.raises(ValueError, match="support row 0 keeps no token of nonzero probability under rule 'top_k=1'"):
        safe_log_softmax(logits, torch.tensor([1]), "top_k=1", support=SafeSupport.from_lists([[1, 2]]))


def test_bounds_take_a_support():
    probs = torch.softmax(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)), -1)
    support = SafeSupport.from_lists([[0, 1], [4], [2, 3], [0], [1, 2, 3], [4, 0]])
    m = pruned_mass(probs, support)
    torch.testing.assert_close(m, probs.masked_fill(support.to_dense(5).view(2, 3, 5), 0.0).sum(-1))
    torch.testing.assert_close(pruning_tv(1 - m), m)
    torch.testing.assert_close(pruning_kl(1 - m), -torch.log1p(-m))
    with pytest.raises(ValueError, match="the support has 6 rows but probs"):
        pruned_mass(probs[:1], support)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: SafeSupport.from_lists([[1], [3, 2**64 - 1]]),
            ValueError,
            f"SafeSupport row 1 token id={2**64 - 1} is out of range: accepted 0 <= id < vocab_size (an int64)",
        ),
        (lambda: SafeSupport.from_lists([[2**63]]), ValueError, f"SafeSupport row 0 token id={2**63} is out of range"),
        (
            lambda: SafeSupport(torch.ones(5000, dtype=torch.bool), torch.tensor([0, 5000])),
            TypeError,
            "SafeSupport.token_ids must be a 1-D integer torch.Tensor, got a tensor of dtype torch.bool and shape (5000,)",
        ),
        (
            lambda: SafeSupport.from_lists([[1]], device="meta"),
            ValueError,
            "SafeSupport.token_ids is on the meta device (a shape without values): accepted a tensor with values",
        ),
        (
            lambda: safe_log_softmax(torch.zeros(2, 5, device="meta"), torch.zeros(2, dtype=torch.long), "top_k=2"),
            ValueError,
            "logits is on the meta device",
        ),
        (
            lambda: fused_safe_logprobs(
                torch.zeros(2, 3, device="meta"),
                torch.zeros(5, 3, device="meta"),
                torch.zeros(2, dtype=torch.long),
                "top_k=2",
            ),
            ValueError,
            "hidden is on the meta device",
        ),
        (
            lambda: parse_rule("top_p=0.5").keep_mask(torch.zeros(2, 5, device="meta")),
            ValueError,
            "z is on the meta device",
        ),
    ],
)
def test_ids_past_int64_bool_ids_and_meta_tensors_raise_one_line(call, error, message):
    """Issue 37, N8/N10: ids >= 2^63 gave torch's "Overflow when unpacking long long" (no row named); a bool-ids
    TypeError printed the whole tensor; meta-device tensors gave "Tensor.item() cannot be called on meta tensors"."""
    with pytest.raises(error) as err:
        call()
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)[:300]


def test_supports_compare_by_their_sets():
    """``==`` compared the fields as tensors and asked a multi-element tensor for its truth (a RuntimeError); now the
    same rows of the same ids in the same order are equal, and equal supports hash alike (a set keeps one)."""
    a, b = SafeSupport.from_lists([[1, 2], [3]]), SafeSupport.from_lists([[1, 2], [3]])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != SafeSupport.from_lists([[2, 1], [3]])  # the order of a row's ids is part of the support
    assert a != SafeSupport.from_lists([[1], [2, 3]])  # the same ids cut into other rows
    assert a != SafeSupport.from_lists([[1, 2], [4]]) and a != "support"
