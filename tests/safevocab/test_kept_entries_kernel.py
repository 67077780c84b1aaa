"""S's entries written by the fold's last pass (issue 56, point 1): ``forward_fold(kept_capacity=...)`` appends each
column block's kept ``(column, z)`` to a bounded pool and ``pack_kept`` puts them in CSR order, for every route, so the
forward stores a chunk's ``S`` with no second pass over ``[rows, V]``; a pool too small is compacted again from the
logits, counted and logged, never silently sent to the dense backward.

Under Triton's interpreter on CPU (as tests/safevocab/test_kernels.py sets it up), compiled on CUDA. The entries are
checked against the rule's own torch code on the logits the kernels see (``transformed_rows``) and against the separate
compaction kernel (``compact_kept``), bit for bit: rows with whole column blocks that keep nothing, ties at the
threshold (top_k's k-th value, min_p's ``m + log rho`` itself), a pool exactly as large as the kept count and one
entry smaller.
"""

import logging
import math

import pytest
import torch
from backward_path import set_sparse_max_density

# test_kernels imports Triton under its interpreter on CPU (or skips the module when it cannot): the same set-up here
from test_kernels import DEVICE, FULL_TRANSFORM, grads_of, kernel_env, make_inputs, slow  # noqa: F401

import safevocab.backends.triton.backward as triton_backward
import safevocab.backends.triton.forward as triton_forward
import safevocab.backends.triton.route as triton_route
from safevocab import fused_safe_logprobs, parse_rule
from safevocab.backends.triton import sparse_gate
from safevocab.fused.transform import Transform
from safevocab.kernels import forward_fold, kept_entries
from safevocab.kernels.threshold_select import transformed_rows

BLOCK = 16  # the fold's column block here: 10 blocks a row of 150


def chunk(v=150, seed=0):
    """Raw fp32 logits: random rows; a row whose blocks 1-5 are all ``-inf`` (no kept entry in them); a row whose
    3rd-largest value is tied 5 times across blocks; a row whose entries sit on ``m + log 0.05`` exactly (min_p's
    threshold, as the kernel rounds it in fp32: identity transform only)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(7, v, generator=g) * 3
    raw[1, BLOCK : 6 * BLOCK] = -math.inf
    raw[2] = raw[2].clamp(max=4.0)
    raw[2, 0], raw[2, 1] = 6.0, 5.5
    raw[2, [10, 40, 70, 100, 130]] = 5.0
    m = raw[3].amax()
    on_min_p = m + torch.tensor(math.log(0.05), dtype=torch.float32)  # fp32 m + fp32 log rho: the kernel's t
    raw[3, [5, 37, 38, 121]] = on_min_p
    return raw.to(DEVICE)


def fold(raw, rule, transform, kept_capacity, in_bytes=4):
    """The route's fold of ``raw`` (the kernel's own transform, or the torch copy on the torch route) with a pool."""
    route = triton_route.Route.of(rule, in_bytes)
    n = raw.shape[0]
    stat = torch.float64 if in_bytes == 8 else torch.float32
    tf = Transform(temperature=transform.get("temperature", 1.0), softcap=transform.get("softcap"),
                   logit_scale=transform.get("logit_scale", 1.0))  # fmt: skip
    z = raw if route.transform_in_kernel else tf.apply_(raw.to(stat).clone())
    out = {name: torch.empty(n, dtype=stat, device=DEVICE) for name in
           ("threshold", "row_max", "target_shift", "log_sum_safe", "log_sum_full", "entropy")}  # fmt: skip
    out["in_safe"] = torch.empty(n, dtype=torch.bool, device=DEVICE)
    out["safe_size"] = torch.empty(n, dtype=torch.int64, device=DEVICE)
    targets = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    pool = route.fold(z, targets, out, tf, kept_capacity=kept_capacity)
    return route, z, out, pool


def expected_entries(raw, rule, transform, stat=torch.float32):
    """The rule's own set on the kernel-transformed logits: ``(counts, cols, z - m)`` row after row."""
    kw = {"scale": transform.get("logit_scale", 1.0), "softcap": transform.get("softcap"),
          "temperature": transform.get("temperature", 1.0)}  # fmt: skip
    z = transformed_rows(raw, torch.arange(raw.shape[0], device=raw.device), **kw).to(stat)
    t, m = rule.threshold_and_max(z)
    keep = z >= t
    row, col = keep.nonzero(as_tuple=True)
    return keep.sum(-1), col.to(torch.int32), z[row, col] - m.squeeze(-1)[row]


RULES = ["none", "min_p=0.05", "min_prob=0.01", "top_k=3", "top_p=0.8", "top_k=20,min_p=0.02"]


@pytest.mark.parametrize("transform", [{}, pytest.param(FULL_TRANSFORM, marks=slow)])
@pytest.mark.parametrize("rule", RULES)
def test_the_fold_writes_each_rules_kept_set(rule, transform, monkeypatch):
    """Every rule's fold (in-kernel threshold, selection kernel) writes exactly the rule's set, in CSR order, with the
    values the separate compaction computes, bit for bit; blocks that keep nothing are skipped (count 0), and ties at
    the threshold are all kept. (The full transform in the slow tier: test_kernels' sparse tests cover it fast.)"""
    monkeypatch.setattr(forward_fold, "MAX_BLOCK", BLOCK)
    monkeypatch.setattr(kept_entries, "PACK_SLOTS", 4)  # the pack: several programs, several steps a block
    monkeypatch.setattr(kept_entries, "PACK_BLOCK", 4)
    raw = chunk()
    parsed = parse_rule(rule)
    route, z, out, pool = fold(raw, parsed, transform, kept_capacity=raw.numel())
    assert route.kind == ("selection" if parsed.key in ("top_k", "top_p", "intersection") else "in-kernel")
    nnz = int(pool.counter)
    counts, cols, shifted = kept_entries.pack_kept(pool, out["row_max"], nnz)
    want_counts, want_cols, want_shifted = expected_entries(raw, parsed, transform)
    assert torch.equal(counts, want_counts) and torch.equal(counts, out["safe_size"]) and nnz == int(counts.sum())
    assert torch.equal(cols, want_cols)
    assert torch.equal(shifted, want_shifted)
    # the separate compaction (the old path) gives the same bits
    kw = {"scale": transform.get("logit_scale", 1.0), "softcap": transform.get("softcap"),
          "temperature": transform.get("temperature", 1.0)}  # fmt: skip
    old = kept_entries.compact_kept(raw, out["threshold"], out["row_max"], out["safe_size"], *kw.values(), True)
    assert torch.equal(old[0], cols) and torch.equal(old[1], shifted)
    # row 1: blocks 1-5 all -inf keep nothing
    assert not pool.block_count[1, 1:6].any() and pool.block_count[1].sum() == counts[1]
    if rule == "top_k=3":  # the k-th value tied 5 times: all kept
        assert int(counts[2]) == 7
    if rule == "min_p=0.05" and not transform:  # entries on t itself are kept
        assert float(out["threshold"][3]) == float(raw[3, 5]) and int((raw[3] == raw[3, 5]).sum()) == 4
        assert set(cols[counts[:3].sum() : counts[:4].sum()].tolist()) >= {5, 37, 38, 121}


def test_the_torch_route_writes_its_kept_set(monkeypatch):
    """fp64 inputs: the rule's threshold in torch on the transformed fp64 copy; the fold (``MODE_GIVEN``) writes the
    same set and values as the separate compaction of that copy."""
    monkeypatch.setattr(forward_fold, "MAX_BLOCK", BLOCK)
    raw = chunk().double()
    parsed = parse_rule("top_k=3")
    route, z, out, pool = fold(raw, parsed, {"temperature": 0.7}, kept_capacity=raw.numel(), in_bytes=8)
    assert route.kind == "torch" and z.dtype == torch.float64
    counts, cols, shifted = kept_entries.pack_kept(pool, out["row_max"], int(pool.counter))
    keep = z >= parsed.threshold(z)
    row, col = keep.nonzero(as_tuple=True)
    assert torch.equal(counts, keep.sum(-1)) and torch.equal(cols, col.to(torch.int32)) and int(counts[2]) == 7
    assert torch.equal(shifted, z[row, col] - out["row_max"][row])
    old = kept_entries.compact_kept(z, out["threshold"], out["row_max"], out["safe_size"], 1.0, None, 1.0, False)
    assert torch.equal(old[0], cols) and torch.equal(old[1], shifted)


# min_p in the slow tier: top_k=3 guards the same pool bound fast
@pytest.mark.parametrize("rule", [pytest.param("min_p=0.05", marks=slow), "top_k=3"])
def test_a_pool_holds_exactly_its_capacity_and_counts_one_more(rule, monkeypatch):
    """A pool of exactly the chunk's kept count is filled and packed; one entry smaller, the counter still counts every
    kept entry (the caller sees the overflow) and nothing is written past the pool (a guard behind it stays as it
    was)."""
    monkeypatch.setattr(forward_fold, "MAX_BLOCK", BLOCK)
    raw = chunk()
    parsed = parse_rule(rule)
    want = expected_entries(raw, parsed, {})
    total = int(want[0].sum())
    empty = kept_entries.KeptPool.empty
    guards = []

    def guarded(n, n_cols, block, capacity, dtype, device):
        pool = empty(n, n_cols, block, capacity + 64, dtype, device)
        pool.cols.fill_(-7)
        pool.values.fill_(-7.0)
        guards.append((pool.cols[capacity:], pool.values[capacity:]))
        pool.cols, pool.values = pool.cols[:capacity], pool.values[:capacity]
        return pool

    monkeypatch.setattr(kept_entries.KeptPool, "empty", guarded)
    _, _, out, pool = fold(raw, parsed, {}, kept_capacity=total)
    assert pool.capacity == total and int(pool.counter) == total
    counts, cols, shifted = kept_entries.pack_kept(pool, out["row_max"], total)
    assert torch.equal(counts, want[0]) and torch.equal(cols, want[1]) and torch.equal(shifted, want[2])
    for capacity in (total - 1, total // 2):  # one entry short; a block cut in the middle
        _, _, out, pool = fold(raw, parsed, {}, kept_capacity=capacity)
        assert pool.capacity == capacity and int(pool.counter) > pool.capacity  # an overflow, seen
        assert torch.equal(pool.row_counts(), want[0])
    for cols_guard, values_guard in guards:
        assert (cols_guard == -7).all() and (values_guard == -7.0).all()
    with pytest.raises(AssertionError, match="overflowed"):
        kept_entries.pack_kept(pool, out["row_max"], total)


def test_a_program_that_sees_its_pool_overflow_stops_reserving(monkeypatch):
    """``none`` keeps every finite logit: in a pool of 10 entries each row's program reserves places until it sees the
    overflow, then no more (one atomic add a program after that, not one a block), while the table still counts
    every row's kept entries exactly."""
    monkeypatch.setattr(forward_fold, "MAX_BLOCK", BLOCK)
    raw = chunk()
    parsed = parse_rule("none")
    _, _, out, pool = fold(raw, parsed, {}, kept_capacity=10)
    assert torch.equal(pool.row_counts(), out["safe_size"]) and int(out["safe_size"].sum()) > 500
    assert 10 < int(pool.counter) <= 10 + raw.shape[0] * BLOCK


class _NoCompaction:
    """Stands for ``_compact_kept_kernel``: any launch fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("the separate compaction kernel was launched")


@pytest.fixture
def sparse_calls(monkeypatch):
    """Counts the per-id sparse kernels' calls (forced: ``sparse_gate.FORCE``) and the stored rows of each."""
    monkeypatch.setattr(sparse_gate, "FORCE", sparse_gate.PER_ID)
    calls = []
    kernel = triton_backward.kernel_sparse_backward
    monkeypatch.setattr(
        triton_backward, "kernel_sparse_backward", lambda *a, **k: calls.append(a[1].numel()) or kernel(*a, **k)
    )
    return calls


@pytest.mark.parametrize(
    "rule, dtype",
    [
        # fast: one in-kernel rule and one selection rule; the other rules and the torch route in the slow tier (the
        # fold's entries of each are checked fast by test_the_fold_writes_each_rules_kept_set)
        pytest.param("none", torch.float32, marks=slow),
        ("min_p=0.05", torch.bfloat16),
        pytest.param("min_prob=0.01", torch.float32, marks=slow),
        ("top_k=5", torch.bfloat16),
        pytest.param("top_p=0.8", torch.float32, marks=slow),
        pytest.param("top_k=5", torch.float64, marks=slow),  # the torch route
    ],
)
def test_stored_sets_launch_no_separate_compaction(rule, dtype, sparse_calls, monkeypatch):
    """Through the op, every chunk stored (gate 1): the sparse backward runs on the fold's own entries, the separate
    compaction kernel is never launched, and the gradients are the torch backend's."""
    monkeypatch.setattr(kept_entries, "_compact_kept_kernel", _NoCompaction())
    set_sparse_max_density(monkeypatch, 1.0)
    hidden, weight, bias, targets = make_inputs(n=20, v=90, dtype=dtype, seed=3)
    params = (hidden, weight, bias)
    outs = []
    for backend in ("triton", "torch"):
        out = fused_safe_logprobs(hidden, weight, targets, rule, bias=bias, backend=backend, compute_entropy=True,
                                  max_chunk_bytes=4096, temperature=0.8)  # fmt: skip
        loss = (out.logprobs.double() * out.in_safe).sum() + 0.1 * out.entropy.double().sum()
        outs.append(grads_of(loss, params))
    assert len(sparse_calls) == 1 and sparse_calls[0] >= 2  # one call, several stored chunks
    tol = {torch.float32: 1e-4, torch.float64: 1e-10}.get(dtype, 3e-2)
    for a, b in zip(*outs):
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


def _grads_and_sizes(rule, dtype):
    hidden, weight, bias, targets = make_inputs(n=20, v=90, dtype=dtype, seed=5)
    params = (hidden, weight, bias)
    out = fused_safe_logprobs(hidden, weight, targets, rule, bias=bias, backend="triton", compute_entropy=True,
                              max_chunk_bytes=4096, softcap=3.0)  # fmt: skip
    loss = (out.logprobs.double() * out.in_safe).sum() + 0.1 * out.entropy.double().sum()
    return [out.logprobs, out.entropy, *grads_of(loss, params)]


# "disagree" in the slow tier: "overflow" guards the same fallback (compacted again, counted, logged) fast
@pytest.mark.parametrize("why", ["overflow", pytest.param("disagree", marks=slow)])
def test_a_pool_that_overflows_or_disagrees_is_compacted_again_counted_and_logged(
    why, sparse_calls, monkeypatch, caplog
):
    """A pool smaller than its gate (``POOL_MAX_DENSITY`` binding below a raised gate) is checked at once: a chunk whose
    kept entries overflow it, or whose pool counts disagree with ``|S|``, is compacted again from its logits: the same
    bits as the pool's, still the sparse backward, counted in ``REREAD_FALLBACKS`` and logged (a warning the first
    time, debug records after)."""
    set_sparse_max_density(monkeypatch, 1.0)
    want = _grads_and_sizes("min_p=0.05", torch.float32)
    assert len(sparse_calls) == 1
    monkeypatch.setattr(kept_entries, "POOL_MAX_DENSITY", 0.0)
    if why == "overflow":
        monkeypatch.setattr(triton_forward, "POOL_ROW_ENTRIES", 1)  # one entry a row: every chunk overflows
    else:
        monkeypatch.setattr(triton_forward, "POOL_ROW_ENTRIES", 89)  # below the gate (90 a row), above |S|
        counts = kept_entries.KeptPool.row_counts
        monkeypatch.setattr(kept_entries.KeptPool, "row_counts", lambda self: counts(self) + 1)
    monkeypatch.setitem(triton_forward.REREAD_FALLBACKS, "chunks", 0)
    with caplog.at_level(logging.DEBUG, logger="safevocab"):
        got = _grads_and_sizes("min_p=0.05", torch.float32)
    assert len(sparse_calls) == 2  # still the sparse backward
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    chunks = triton_forward.REREAD_FALLBACKS["chunks"]
    assert chunks >= 2
    records = [r for r in caplog.records if "read again to compact them" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING] + [logging.DEBUG] * (chunks - 1)
    assert "rows 0-" in records[0].getMessage()
    assert ("overflow its pool" if why == "overflow" else "disagree with |S|") in records[0].getMessage()


def test_a_pool_decided_once_per_call_that_disagrees_goes_dense_counted_and_logged(sparse_calls, monkeypatch, caplog):
    """A pool as large as its gate is checked once per call, after the last chunk (its logits are gone): a chunk whose
    pool counts disagree with ``|S|`` (never seen; forced here) takes the dense backward, counted in
    ``DENSE_FALLBACKS`` and logged, never silently; the other rows' results are unchanged."""
    set_sparse_max_density(monkeypatch, 1.0)
    want = _grads_and_sizes("top_k=5", torch.float32)
    assert len(sparse_calls) == 1
    counts = kept_entries.KeptPool.row_counts
    monkeypatch.setattr(kept_entries.KeptPool, "row_counts", lambda self: counts(self) + 1)
    monkeypatch.setitem(triton_forward.DENSE_FALLBACKS, "chunks", 0)
    monkeypatch.setitem(triton_forward.REREAD_FALLBACKS, "chunks", 0)
    with caplog.at_level(logging.DEBUG, logger="safevocab"):
        got = _grads_and_sizes("top_k=5", torch.float32)
    assert len(sparse_calls) == 1  # no stored chunk left: the sparse backward did not run
    assert triton_forward.REREAD_FALLBACKS["chunks"] == 0
    chunks = triton_forward.DENSE_FALLBACKS["chunks"]
    assert chunks >= 2
    records = [r for r in caplog.records if "take the dense backward" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING] + [logging.DEBUG] * (chunks - 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the forward's values
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _host_reads_in_forward(rule, chunks, monkeypatch):
    """Reads of a tensor's value by the host (``tolist``, ``item``, ``bool``/``int``/``float``, ``torch.equal``,
    ``nonzero``: each a synchronisation on a GPU) during one forward of ``chunks`` chunks, every chunk stored."""
    reads = []
    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
            original = getattr(torch.Tensor, name)
            patch.setattr(torch.Tensor, name, lambda *a, _f=original, _n=name, **k: reads.append(_n) or _f(*a, **k))
        equal = torch.equal
        patch.setattr(torch, "equal", lambda *a, **k: reads.append("equal") or equal(*a, **k))
        hidden, weight, bias, targets = make_inputs(n=16 * chunks, v=90, seed=6)
        with torch.no_grad():
            fused_safe_logprobs(hidden, weight, targets, rule, bias=bias, backend="triton",
                                max_chunk_bytes=16 * 90 * 4)  # fmt: skip
    return reads


# none in the slow tier: min_p guards the same read fast
@pytest.mark.parametrize("rule", ["min_p=0.05", pytest.param("none", marks=slow)])
def test_the_in_kernel_forward_reads_the_device_a_fixed_number_of_times(rule, monkeypatch):
    """Issue 56 point 2, where it is contained: on the in-kernel route (none, min_p, min_prob) the forward with every
    chunk stored reads the device the same number of times for 2 chunks as for 6 (in the op: one read decides every
    chunk's storage, one the non-finite check); it read three times a chunk (the gate's ``int``, the CSR size,
    ``torch.equal``). The selection route still reads per chunk inside the threshold selection."""
    set_sparse_max_density(monkeypatch, 1.0)
    few, many = (_host_reads_in_forward(rule, chunks, monkeypatch) for chunks in (2, 6))
    assert few == many, (few, many)  # today 5: the targets' range (2) and the bias check up front, these two
    assert many.count("tolist") == 1
