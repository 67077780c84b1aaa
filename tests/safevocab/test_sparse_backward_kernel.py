"""The Triton sparse backward (``safevocab.kernels.sparse_backward``) and replay on the Triton backend (issue 41).

Runs under Triton's interpreter on CPU (the set-up of ``test_kernels.py``, imported from it: ``TRITON_INTERPRET=1``
before the first ``import triton``), compiled on CUDA. Three levels:

- the kernel alone on hand-made CSR entries (duplicate ids across many rows, empty rows, several entry and ``H``
  blocks) against a float64 restatement of the formula written here;
- ``fused_safe_logprobs(backend="triton")`` with the sparse backward against the torch backend (its MKL sparse GEMMs
  for fp32, its dense backward for bf16), the Triton dense backward and the float64 reference
  (``tests/helpers/safevocab_reference.py``): entropy gradients, transforms, rows with ``y`` outside ``S`` and gradients
  through ``log_kept_mass`` (the full-softmax part of a sparse chunk);
- replayed supports (``SafeSupport``) on the Triton backend against the torch backend: unsorted ids, ids of
  probability 0, supports far below the row maximum, supports that keep nothing (refused), duplicate ids (refused).
"""

import math

import pytest
import torch
from backward_path import set_sparse_max_density
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_kernels import (  # noqa: F401  (kernel_env: the interpreter fixture, autouse)
    DEVICE,
    FULL_TRANSFORM,
    grads_of,
    kernel_env,
    make_inputs,
    slow,
    triton_package,
)
from test_reference_fuzz import check_fused, fuzz_settings, head_inputs, rule_parts, supports, transforms

import safevocab.backends.triton.backward as triton_backward
import safevocab.fused.op as fused_op
from safevocab import SafeSupport, fused_safe_logprobs
from safevocab.backends.triton import sparse_gate
from safevocab.kernels import sparse_backward as sparse_kernel

# ---------------------------------------------------------------------------------------------- the kernel alone


def reference_entry_grads(rows, counts, cols, shifted, coef, scale, softcap, temperature):
    """float64 ``g_{t,a}`` of each entry, from the definitions: ``g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H))``,
    times ``1 - tanh^2`` of the softcap and ``logit_scale / T``."""
    row_of = torch.repeat_interleave(rows, counts)
    c = {k: v.double()[row_of] for k, v in coef.items() if k != "targets"}
    log_p = shifted.double() - c["log_sum_safe"]
    g = -log_p.exp() * (c["c_safe"] + c["g_ent"] * (log_p + c["entropy"]))
    g = g + torch.where(cols.long() == coef["targets"][row_of], c["g_lp"], 0.0)
    if softcap is not None:
        tanh = (shifted.double() + c["set_max"]) * temperature / softcap  # the softcapped logit is c tanh(.) / T
        g = g * (1 - tanh.square().clamp(max=1.0))
    return row_of, g * scale / temperature


def kernel_case(seed, n_rows=9, vocab=23, hidden_size=37, dtype=torch.float32):
    """CSR entries of ``n_rows`` rows, two of them empty, ids drawn from few columns (many rows share each id)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 30, (n_rows,), generator=g)
    counts[[1, 5]] = 0
    cols = torch.randint(0, 6, (int(counts.sum()),), generator=g).to(torch.int32)  # ids 0..5 only: duplicates
    cols[::4] = torch.randint(0, vocab, (cols[::4].numel(),), generator=g).to(torch.int32)
    n_total = n_rows + 3
    rows = torch.arange(3, 3 + n_rows)  # the stored rows need not start at 0
    coef = {
        "targets": torch.randint(0, 6, (n_total,), generator=g),
        "log_sum_safe": torch.rand(n_total, generator=g) * 2,
        "c_safe": torch.randn(n_total, generator=g),
        "g_lp": torch.randn(n_total, generator=g),
        "g_ent": torch.randn(n_total, generator=g) * 0.3,
        "entropy": torch.rand(n_total, generator=g),
        "set_max": torch.randn(n_total, generator=g),
    }
    shifted = -torch.rand(cols.numel(), generator=g) * 4  # z - m_S <= 0
    hidden = torch.randn(n_total, hidden_size, generator=g).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=g).to(dtype)
    return rows, counts, cols, shifted, coef, hidden, weight


def run_kernel(case, transform=(1.0, None, 1.0), out_dtype=torch.float32, grad_shift=1.0):
    rows, counts, cols, shifted, coef, hidden, weight = (x.to(DEVICE) if torch.is_tensor(x) else x for x in case)
    coef = {k: v.to(DEVICE) for k, v in coef.items()}
    scale, softcap, temperature = transform
    grads = (
        torch.zeros(hidden.shape, dtype=out_dtype, device=DEVICE),
        torch.zeros(weight.shape, dtype=out_dtype, device=DEVICE),
        torch.zeros(weight.shape[0], dtype=out_dtype, device=DEVICE),
    )
    sparse_kernel.sparse_backward(
        rows,
        counts,
        cols,
        shifted,
        coef["targets"],
        coef["log_sum_safe"],
        coef["c_safe"],
        coef["g_lp"],
        coef["g_ent"],
        coef["entropy"],
        coef["set_max"],
        hidden,
        weight,
        *grads,
        temperature=temperature,
        softcap=softcap,
        logit_scale=scale,
        grad_shift=grad_shift,
    )
    return [g.cpu() for g in grads]


def reference_grads(case, transform=(1.0, None, 1.0)):
    rows, counts, cols, shifted, coef, hidden, weight = case
    row_of, g = reference_entry_grads(rows, counts, cols, shifted, coef, *transform)
    h64, w64 = hidden.double(), weight.double()
    d_hidden = torch.zeros_like(h64).index_add_(0, row_of, g[:, None] * w64[cols.long()])
    d_weight = torch.zeros_like(w64).index_add_(0, cols.long(), g[:, None] * h64[row_of])
    d_bias = torch.zeros(w64.shape[0], dtype=torch.float64).index_add_(0, cols.long(), g)
    return [d_hidden, d_weight, d_bias]


def assert_kernel_matches(got, want, rtol=1e-5):
    for name, a, b in zip(("grad_hidden", "grad_weight", "grad_bias"), got, want):
        atol = rtol * max(1.0, float(b.abs().max()))
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("transform", [(1.0, None, 1.0), (1.7, 2.5, 1.3), (1.0, None, 0.05)])
def test_sparse_kernel_against_float64_formula(transform, monkeypatch):
    """Many rows share each vocabulary id (dW sums across rows), two rows are empty, rows span several entry blocks
    and ``H`` spans several blocks; rows outside the stored ones stay exactly zero."""
    monkeypatch.setattr(sparse_kernel, "MAX_BLOCK_H", 16)
    monkeypatch.setattr(sparse_kernel, "BLOCK_ENTRIES", 4)
    case = kernel_case(0)
    rows, counts, cols, shifted, coef, hidden, weight = case
    if transform[1] is not None:  # tanh = (s + m_S) T / c must lie in (-1, 1): a softcapped logit
        coef["set_max"] = coef["set_max"].clamp(-0.5, 0.5)
        case = (rows, counts, cols, shifted * 0.1, coef, hidden, weight)
    got = run_kernel(case, transform)
    assert_kernel_matches(got, reference_grads(case, transform))
    assert not got[0][:3].any() and not got[0][[3 + 1, 3 + 5]].any()  # unstored and empty rows: zero
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[cols.long()] = False
    assert untouched.any() and not got[1][untouched].any() and not got[2][untouched].any()


def test_sparse_kernel_adds_to_existing_gradients_and_is_deterministic():
    """The kernel adds to what the gradients hold (dense chunks' products) and gives the same bits every run."""
    case = kernel_case(1)
    first = run_kernel(case)
    assert all(torch.equal(a, b) for a, b in zip(first, run_kernel(case)))
    rows, counts, cols, shifted, coef, hidden, weight = case
    grads = [torch.full_like(g, 0.5) for g in first]
    sparse_kernel.sparse_backward(
        rows,
        counts,
        cols,
        shifted,
        *(coef[k] for k in ("targets", "log_sum_safe", "c_safe", "g_lp", "g_ent", "entropy", "set_max")),
        hidden,
        weight,
        *grads,
        temperature=1.0,
        softcap=None,
        logit_scale=1.0,
    )
    for a, b in zip(grads, first):
        torch.testing.assert_close(a, b + 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_kernel_half_inputs_and_fp16_grad_shift(dtype):
    """bf16/fp16 ``h`` and ``W``, fp32 sums, gradients written once in the inputs' dtype; ``grad_shift`` (fp16 at tiny
    temperatures) divides ``g`` and multiplies the sums back: the same result."""
    case = kernel_case(2, dtype=dtype)
    want = reference_grads(case)
    for shift in (1.0, 2.0**10):
        got = run_kernel(case, out_dtype=dtype, grad_shift=shift)
        assert all(g.dtype == dtype for g in got)
        assert_kernel_matches(got, want, rtol=2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), n_rows=st.integers(1, 12), vocab=st.integers(6, 40), h=st.integers(1, 40))
def test_sparse_kernel_property(seed, n_rows, vocab, h):
    case = kernel_case(seed, n_rows=max(n_rows, 6), vocab=vocab, hidden_size=h)
    assert_kernel_matches(run_kernel(case), reference_grads(case))


# ---------------------------------------------------------------------------------------------- through the fused op


@pytest.fixture
def sparse_calls(monkeypatch):
    """Counts the Triton sparse backward's calls with stored chunks, and the dtype of the weight gradient it wrote.
    The per-id kernels forced (``sparse_gate.FORCE``): these tests are theirs; the union GEMMs, the dense backward of
    stored chunks and the gate choosing between them: test_union_backward_kernel.py."""
    monkeypatch.setattr(sparse_gate, "FORCE", sparse_gate.PER_ID)
    calls = []
    kernel = triton_backward.kernel_sparse_backward

    def counting(*args, **kwargs):
        calls.append(args[14].dtype if args[14] is not None else None)  # grad_weight
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_backward, "kernel_sparse_backward", counting)
    return calls


def run(backend, rule, params, targets, density, monkeypatch, **kwargs):
    set_sparse_max_density(monkeypatch, density)  # both gates: the torch sparse GEMMs' and the Triton kernels'
    hidden, weight, bias = params
    return fused_safe_logprobs(
        hidden, weight, targets, rule, bias=bias, backend=backend, compute_entropy=True, max_chunk_bytes=4096, **kwargs
    )


def rl_loss(out, seed=3):
    """trl GRPO's shape: out-of-set tokens masked, log_kept_mass detached, an entropy bonus."""
    w = torch.randn(out.logprobs.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return (out.logprobs * w * out.in_safe).sum() + 0.1 * out.entropy.sum()


def mixed_loss(out, seed=4):
    """Gradients leaving S: out-of-set targets' full log-softmax and log_kept_mass."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = (torch.randn(out.logprobs.shape, generator=g).to(DEVICE) for _ in range(2))
    return (out.logprobs * w1).sum() + (out.log_kept_mass * w2).sum() + 0.1 * out.entropy.sum()


def assert_grads_close(got, want, dtype):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.isfinite(a.float()).all()
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
        else:
            rel = 2.0**-6 if dtype == torch.bfloat16 else 2.0**-9
            torch.testing.assert_close(a.float(), b.float(), atol=rel * b.float().abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rule, transform",
    [
        ("min_p=0.05", {}),
        ("top_k=7", FULL_TRANSFORM),
        ("top_p=0.8", {"temperature": 0.3}),
        *[pytest.param(r, t, marks=slow) for r in ("min_p=0.05", "top_k=7", "top_p=0.8") for t in (FULL_TRANSFORM, {})],
    ],
)
def test_triton_sparse_backward_matches_torch_and_dense(dtype, rule, transform, sparse_calls, monkeypatch):
    """The RL loss: every chunk sparse; the Triton sparse backward agrees with the torch backend (fp32: its sparse
    GEMMs; bf16: its dense backward) and the Triton dense backward, and allocates no fp32 [V, H] buffer."""
    hidden, weight, bias, targets = make_inputs(n=24, v=200, dtype=dtype)
    params = (hidden, weight, bias)
    tri = run("triton", rule, params, targets, 1.0, monkeypatch, **transform)
    got = grads_of(rl_loss(tri), params)
    assert sparse_calls == [dtype]  # one call for all chunks; the weight gradient in the weight's dtype
    ref = run("torch", rule, params, targets, fused_op.SPARSE_MAX_DENSITY, monkeypatch, **transform)
    assert_grads_close(got, grads_of(rl_loss(ref), params), dtype)
    dense = run("triton", rule, params, targets, 0.0, monkeypatch, **transform)
    assert_grads_close(got, grads_of(rl_loss(dense), params), dtype)
    assert len(sparse_calls) == 1  # the dense run stored nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["min_p=0.1", "top_k=5"])
def test_triton_sparse_chunks_with_gradients_leaving_s(dtype, rule, sparse_calls, monkeypatch):
    """Rows with y outside S and the log_kept_mass gradient: the sparse part plus the full-softmax part of the same
    chunks (fp32 accumulators then), against the torch backend and the dense backward."""
    hidden, weight, bias, targets = make_inputs(n=30, v=120, dtype=dtype, seed=4)
    params = (hidden, weight, bias)
    tri = run("triton", rule, params, targets, 1.0, monkeypatch, softcap=3.0)
    assert not tri.in_safe.all() and tri.in_safe.any()
    got = grads_of(mixed_loss(tri), params)
    assert sparse_calls == [torch.float32]
    ref = run("torch", rule, params, targets, fused_op.SPARSE_MAX_DENSITY, monkeypatch, softcap=3.0)
    assert_grads_close(got, grads_of(mixed_loss(ref), params), dtype)
    dense = run("triton", rule, params, targets, 0.0, monkeypatch, softcap=3.0)
    assert_grads_close(got, grads_of(mixed_loss(dense), params), dtype)


def test_triton_sparse_backward_many_rows_share_ids(sparse_calls, monkeypatch):
    """Every row keeps tokens 7 and 8 only (two large bias entries, top_k=2): dW[7] and dW[8] sum all 50 rows (the
    grouping by id), the other rows of dW and of the bias gradient stay exactly 0."""
    hidden, weight, _, targets = make_inputs(n=50, v=40, bias=False, seed=8)
    bias = torch.zeros(40, device=DEVICE)
    bias[7], bias[8] = 30.0, 29.5
    bias.requires_grad_()
    params = (hidden, weight, bias)
    targets = torch.where(torch.arange(50, device=DEVICE) % 2 == 0, 7, 8)
    w = torch.linspace(-1, 1, 50, device=DEVICE)
    tri = run("triton", "top_k=2", params, targets, 1.0, monkeypatch, temperature=2.0)
    assert (tri.safe_size == 2).all() and tri.in_safe.all()
    got = grads_of((tri.logprobs * w).sum() + tri.entropy.sum(), params)
    assert sparse_calls == [torch.float32]
    ref = run("torch", "top_k=2", params, targets, 1.0, monkeypatch, temperature=2.0)
    assert_grads_close(got, grads_of((ref.logprobs * w).sum() + ref.entropy.sum(), params), torch.float32)
    others = torch.ones(40, dtype=torch.bool, device=DEVICE)
    others[[7, 8]] = False
    assert not got[1][others].any() and not got[2][others].any()
    assert got[1][[7, 8]].abs().amin(-1).gt(0).all()


@pytest.mark.parametrize("top_k, sparse", [(2, True), (4, True), (5, False), (16, False)])
def test_triton_backend_stores_s_only_below_its_crossover(top_k, sparse, sparse_calls):
    """The default gate (no patch): a chunk keeping at most ``KERNEL_SPARSE_MAX_DENSITY`` of its logits (4 of
    V = 4096 per row) takes the Triton sparse backward, a denser one the dense backward. The torch backend's gate,
    1/16, would send ``top_k=16`` to the sparse kernel: on an H100 with 2430 kept logits per row the op then took 5.3x
    trl's kernel, its sparse backward 285 ms (docs/performance.md, third GPU run)."""
    assert fused_op.KERNEL_SPARSE_MAX_DENSITY * 4096 == 4
    hidden, weight, bias, targets = make_inputs(n=6, h=4, v=4096, seed=2)
    params = (hidden, weight, bias)
    out = fused_safe_logprobs(
        hidden, weight, targets, f"top_k={top_k}", bias=bias, backend="triton", compute_entropy=True
    )
    assert (out.safe_size == top_k).all()
    grads_of((out.logprobs * out.in_safe).sum() + 0.1 * out.entropy.sum(), params)
    assert sparse_calls == ([torch.float32] if sparse else [])


def test_a_chunk_that_falls_back_to_the_dense_backward_is_counted(sparse_calls, monkeypatch, caplog):
    """Reliability IV point 6: a chunk whose kept entries do not count the fold's ``|S|`` takes the dense backward
    (the same gradient), counted in ``DENSE_FALLBACKS`` and logged with its rows and the reason: a warning the first
    time, debug records after; it was silent. Since issue 56 the fold writes the entries itself; only a chunk whose
    pool overflows is compacted again from its logits (test_kept_entries_kernel.py), and that count may disagree."""
    import logging

    import safevocab.backends.triton.forward as triton_forward
    from safevocab.kernels import kept_entries

    monkeypatch.setattr(kept_entries, "POOL_MAX_DENSITY", 0.0)
    monkeypatch.setattr(triton_forward, "POOL_ROW_ENTRIES", 1)  # a pool of one entry a row: every chunk overflows
    monkeypatch.setattr(triton_forward, "compact_kept", lambda *args, **kwargs: None)  # and its compaction disagrees
    monkeypatch.setitem(triton_forward.DENSE_FALLBACKS, "chunks", 0)
    hidden, weight, bias, targets = make_inputs(n=6, h=4, v=4096, seed=2)
    params = (hidden, weight, bias)
    with caplog.at_level(logging.DEBUG, logger="safevocab"):
        out = fused_safe_logprobs(
            hidden, weight, targets, "top_k=2", bias=bias, backend="triton", max_chunk_bytes=2**16
        )
    got = grads_of((out.logprobs * out.in_safe).sum(), params)
    assert sparse_calls == []  # the dense backward did it all
    chunks = triton_forward.DENSE_FALLBACKS["chunks"]
    assert chunks >= 2
    records = [r for r in caplog.records if "take the dense backward" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING] + [logging.DEBUG] * (chunks - 1)
    assert "rows 0-" in records[0].getMessage() and "do not count the fold's |S|" in records[0].getMessage()
    monkeypatch.undo()
    ref = fused_safe_logprobs(hidden, weight, targets, "top_k=2", bias=bias, backend="torch")
    for a, b in zip(got, grads_of((ref.logprobs * ref.in_safe).sum(), params)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@settings(fuzz_settings(12), suppress_health_check=list(HealthCheck))
@given(inputs=head_inputs(dtypes=(torch.float32, torch.bfloat16)), data=st.data())
def test_triton_sparse_backward_matches_reference(inputs, data):
    """The sparse path (every chunk stored) against the float64 reference (``check_fused``, its RL loss)."""
    parts = data.draw(rule_parts(inputs["weight"].shape[0]))
    transform = data.draw(transforms(inputs["exact"]))
    check_fused(inputs, parts, transform, data.draw(st.integers(1, 4096)), False, "triton", device=DEVICE.type)


# ---------------------------------------------------------------------------------------------- replay on Triton


def replay_both(params, targets, support, rule="none", loss=rl_loss, **transform):
    hidden, weight, bias = params
    results = []
    for backend in ("triton", "torch"):
        out = fused_safe_logprobs(
            hidden,
            weight,
            targets,
            rule,
            bias=bias,
            backend=backend,
            compute_entropy=True,
            max_chunk_bytes=4096,
            support=support,
            **transform,
        )
        results.append((out, grads_of(loss(out), params)))
    return results


# fp32 in CI's slow phase: bf16 is the GPU dtype and takes the half-precision paths the fp32 ones do not (the fast suite's
# Triton-interpreter time, issue 39)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
@pytest.mark.parametrize(
    "rule, transform",
    [
        ("none", {}),
        ("none", FULL_TRANSFORM),
        ("top_k=20", {}),
        ("min_p=0.05", FULL_TRANSFORM),
        ("top_k=20", FULL_TRANSFORM),
        ("top_p=0.9", FULL_TRANSFORM),
    ],
)
def test_triton_replay_matches_torch(dtype, rule, transform, sparse_calls):
    """Unsorted ids (the argmax often left out), ids of probability 0 (-inf bias), a rule intersected with them;
    values, sets and gradients (RL loss and the mixed loss) as the torch backend's."""
    n, v = 24, 90
    hidden, weight, _, targets = make_inputs(n=n, v=v, dtype=dtype, bias=False, seed=9)
    bias = torch.zeros(v, device=DEVICE, dtype=dtype)
    bias[60:70] = -math.inf
    bias.requires_grad_()
    g = torch.Generator().manual_seed(10)
    rows = [torch.randperm(v, generator=g)[: int(torch.randint(2, 40, (1,), generator=g))].tolist() for _ in range(n)]
    rows = [r if any(i < 60 or i >= 70 for i in r) else r + [0] for r in rows]
    if rule != "none":  # each row meets the rule's set: its argmax replayed
        top1 = (hidden.detach().double() @ weight.detach().double().t()).argmax(-1).tolist()
        rows = [r if top1[i] in r else [*r[:1], top1[i], *r[1:]] for i, r in enumerate(rows)]
    support = SafeSupport.from_lists(rows)
    targets = [r[i % len(r)] if i % 3 else (r[0] + 1) % v for i, r in enumerate(rows)]
    targets = torch.tensor([0 if 60 <= t < 70 else t for t in targets], device=DEVICE)  # no target of probability 0
    for loss in (rl_loss, mixed_loss):
        (tri, g_tri), (ref, g_ref) = replay_both((hidden, weight, bias), targets, support, rule, loss, **transform)
        assert torch.equal(tri.safe_size, ref.safe_size) and torch.equal(tri.in_safe, ref.in_safe)
        assert not tri.in_safe.all() and tri.in_safe.any()
        for field in ("logprobs", "log_kept_mass", "entropy"):
            a, b = getattr(tri, field), getattr(ref, field)
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
        assert_grads_close(g_tri, g_ref, dtype)
    assert len(sparse_calls) == 2  # the replayed sets always take the sparse backward


def test_triton_replay_far_below_the_maximum(sparse_calls):
    """A support ~1e6 logits below the row maximum: S gets its own shift, finite values, ties give -log 2."""
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]], device=DEVICE)
    weight = torch.tensor([[2.0**20, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.5]], device=DEVICE, requires_grad=True)
    support = SafeSupport.from_lists([[2, 1], [3, 1, 2]])
    targets = torch.tensor([1, 3], device=DEVICE)
    (tri, g_tri), (ref, g_ref) = replay_both((hidden, weight, None), targets, support, loss=lambda o: o.logprobs.sum())
    torch.testing.assert_close(tri.logprobs, torch.tensor([-math.log(2), -math.log(3)], device=DEVICE))
    torch.testing.assert_close(tri.logprobs, ref.logprobs)
    assert torch.isfinite(tri.log_kept_mass).all() and torch.isfinite(tri.entropy).all()
    for a, b in zip(g_tri, g_ref):
        torch.testing.assert_close(a, b)
    assert len(sparse_calls) == 1  # the Triton path replayed it


def test_triton_replay_takes_a_single_column_weight_view(sparse_calls):
    """Reliability IV T2: a ``[V, 1]`` weight with strides ``(1, V)`` (torch calls it contiguous, and its rows are)
    takes the replayed sparse backward and gets the torch backend's gradients; it raised the kernel wrapper's raw
    ``AssertionError: hidden and weight must be row-contiguous``."""
    g = torch.Generator().manual_seed(12)
    weight = torch.randn(1, 6, generator=g).to(DEVICE).t().requires_grad_()  # [6, 1], strides (1, 6)
    hidden = torch.randn(3, 1, generator=g).to(DEVICE).requires_grad_()
    assert weight.is_contiguous() and weight.stride() == (1, 6)
    support = SafeSupport.from_lists([[0, 1], [2, 3, 4], [5, 0]])
    targets = torch.tensor([1, 3, 5], device=DEVICE)
    (tri, g_tri), (ref, g_ref) = replay_both((hidden, weight, None), targets, support)
    torch.testing.assert_close(tri.logprobs, ref.logprobs)
    for a, b in zip(g_tri, g_ref):
        torch.testing.assert_close(a, b)
    assert len(sparse_calls) == 1


def _log_kept_mass_grads(backend, params, targets, support):
    out = fused_safe_logprobs(*params[:2], targets, "none", bias=params[2], backend=backend, support=support)
    return grads_of(out.log_kept_mass.double().sum(), params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_replay_log_kept_mass_gradient_in_half_precision(dtype, sparse_calls):
    """Reliability IV T1: the gradient of ``log_kept_mass`` (``pi_S 1[S] - pi`` per logit, a KL(pi_S || p) penalty's)
    under a replayed support with half inputs is as close to float64 as the torch backend's, and exactly 0 where
    ``S`` is the whole vocabulary. Its two parts were rounded to the inputs' dtype separately (the full-softmax part
    written into a half buffer before its GEMM): relative error 0.2-0.3 in bf16 where torch's is ~1e-3, and dW ~1e-3
    at V = 1, where every output is 0."""
    n, v = 12, 50
    hidden, weight, bias, _ = make_inputs(n=n, v=v, dtype=dtype, seed=13)
    params = (hidden, weight, bias)
    g = torch.Generator().manual_seed(14)
    kept = [torch.randperm(v, generator=g)[: 5 + 3 * i].tolist() for i in range(n)]
    support = SafeSupport.from_lists(kept)
    targets = torch.tensor([row[0] for row in kept], device=DEVICE)
    exact = _log_kept_mass_grads("torch", [p.detach().double().requires_grad_() for p in params], targets, support)
    errors = {}
    for backend in ("triton", "torch"):
        got = _log_kept_mass_grads(backend, params, targets, support)
        errors[backend] = max(float((a.double() - b).norm() / b.norm()) for a, b in zip(got, exact))
    assert len(sparse_calls) == 1  # the Triton path took the sparse backward with its full-softmax part
    assert errors["triton"] <= 2 * errors["torch"] + 1e-3, errors

    # S = V: log_kept_mass = 0 whatever the inputs, so its gradient is exactly 0
    whole = SafeSupport.from_lists([list(range(v))] * n)
    for grad in _log_kept_mass_grads("triton", params, targets, whole):
        assert float(grad.abs().max()) <= 4 * torch.finfo(torch.float32).eps, grad.abs().max()
    single = [hidden, weight[:1].detach().clone().requires_grad_(), None]  # V = 1: every output is 0
    for grad in _log_kept_mass_grads("triton", single, torch.zeros_like(targets), SafeSupport.from_lists([[0]] * n)):
        assert float(grad.abs().max()) == 0.0


def _log_kept_mass_property(inputs, data):
    """T1 as a property: with half inputs and a replayed support (any subset, or the whole vocabulary), the gradient
    of ``sum_i b_i log_kept_mass_i`` on the Triton backend is as close to float64 (the torch backend on float64 copies
    of the same rounded inputs) as the torch backend's in the same dtype: at most twice its error plus fp32 rounding
    of the gradient's natural size. The old backward failed this on the whole vocabulary, where the exact gradient is
    0 and its two parts, rounded apart, left ``eps_bf16 * p`` per logit. A one-column weight is sometimes passed as a
    strided view (T2), which the sparse kernel's wrapper refused with a raw ``AssertionError``."""
    dtype = inputs["dtype"]
    n, v = inputs["targets"].numel(), inputs["weight"].shape[0]
    kept = [list(range(v))] * n if data.draw(st.booleans()) else data.draw(supports(inputs))
    bias = inputs["bias"]
    if bias is not None:  # a row whose ids all have probability 0 keeps nothing (refused elsewhere): not this property
        assume(all(any(math.isfinite(float(bias[i])) for i in row) for row in kept))
    support = SafeSupport.from_lists(kept)
    coefficients = torch.randn(n, generator=torch.Generator().manual_seed(inputs["loss_seed"]), dtype=torch.float64)

    # T2 as well: a one-column weight enters as the [V, 1] view with strides (1, V) that torch calls contiguous
    strided = inputs["weight"].shape[1] == 1 and data.draw(st.booleans())

    def grads(backend, cast):
        params = [None if x is None else cast(x).to(DEVICE).requires_grad_() for x in
                  (inputs["hidden"], inputs["weight"], bias)]  # fmt: skip
        weight = params[1].t().contiguous().t() if strided else params[1]
        out = fused_safe_logprobs(params[0], weight, inputs["targets"].to(DEVICE), "none", bias=params[2],
                                  backend=backend, support=support)  # fmt: skip
        loss = (out.log_kept_mass.double() * coefficients.to(DEVICE)).sum()
        live = [p for p in params if p is not None]
        return [g.double().cpu() for g in torch.autograd.grad(loss, live, allow_unused=True)]

    exact = grads("torch", lambda x: x.to(dtype).double())
    size = float(sum(x.to(dtype).double().nan_to_num(neginf=0.0).norm() for x in (inputs["hidden"], inputs["weight"])))
    floor = 16 * torch.finfo(torch.float32).eps * (size + 1) * float(coefficients.abs().sum())
    errors = {}
    for backend in ("triton", "torch"):
        got = grads(backend, lambda x: x.to(dtype))
        errors[backend] = [float((a - b).norm()) for a, b in zip(got, exact)]
    for name, tri, ref in zip(("hidden", "weight", "bias"), errors["triton"], errors["torch"]):
        assert tri <= 2 * ref + floor, (name, tri, ref, floor)


_half_replay_cases = dict(inputs=head_inputs(dtypes=(torch.bfloat16, torch.float16)), data=st.data())


@settings(fuzz_settings(12), suppress_health_check=list(HealthCheck))
@given(**_half_replay_cases)
def test_triton_replay_log_kept_mass_matches_reference(inputs, data):
    _log_kept_mass_property(inputs, data)


@slow
@settings(fuzz_settings(200), suppress_health_check=list(HealthCheck))
@given(**_half_replay_cases)
def test_triton_replay_log_kept_mass_matches_reference_ci(inputs, data):
    _log_kept_mass_property(inputs, data)


@pytest.mark.fuzz20k
@slow
@settings(fuzz_settings(2000), suppress_health_check=list(HealthCheck))
@given(**_half_replay_cases)
def test_triton_replay_log_kept_mass_matches_reference_2000(inputs, data):
    """2,000 examples (issue 57's figure), on demand with the other ``fuzz20k`` runs."""
    _log_kept_mass_property(inputs, data)


def test_triton_replay_refuses_empty_and_duplicate_supports():
    """A support whose ids all have probability 0 (or lie outside the rule's set) keeps nothing: refused with the
    torch backend's message, never a +-inf log-prob; duplicate ids and empty rows are refused by SafeSupport."""
    hidden, weight, _, targets = make_inputs(n=3, v=12, bias=False, seed=11)
    bias = torch.zeros(12, device=DEVICE)
    bias[4:6] = -math.inf
    support = SafeSupport.from_lists([[0, 1], [4, 5], [2]])
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match="support row 1 keeps no token of nonzero probability"):
            fused_safe_logprobs(hidden, weight, targets, "none", bias=bias, backend=backend, support=support)
    top1 = (hidden.detach() @ weight.detach().t()).argmax(-1).tolist()
    outside = SafeSupport.from_lists([[top1[0]], [top1[1]], [(top1[2] + 1) % 12]])  # row 2 misses top_k=1's set
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match="support row 2 keeps no token"):
            fused_safe_logprobs(hidden, weight, targets, "top_k=1", backend=backend, support=outside)
    with pytest.raises(ValueError, match="lists token id 3 twice"):
        SafeSupport.from_lists([[3, 1, 3]])
    with pytest.raises(ValueError, match="is empty"):
        SafeSupport.from_lists([[1], []])


@settings(fuzz_settings(12), suppress_health_check=list(HealthCheck))
@given(inputs=head_inputs(dtypes=(torch.float32, torch.bfloat16)), data=st.data())
def test_triton_replay_matches_reference(inputs, data):
    """Replay on the Triton backend against the float64 reference: random unsorted supports, with and without a rule
    (supports that keep nothing must raise)."""
    parts = data.draw(st.one_of(st.just([]), rule_parts(inputs["weight"].shape[0])))
    transform = data.draw(transforms(inputs["exact"]))
    support = data.draw(supports(inputs))
    check_fused(inputs, parts, transform, data.draw(st.integers(1, 4096)), False, "triton", DEVICE.type, support)


def test_sparse_kernel_writes_each_weight_row_once(monkeypatch):
    """No atomics: the dW kernel must get one program per distinct id (ids strictly ascending), or two programs would
    read-add-write the same row of dW concurrently on a GPU (the interpreter, running programs one after another,
    would not show the lost update)."""
    launches = []
    kernel = sparse_kernel._grad_weight_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(group_cols, group_offsets, *args, **kwargs):
                launches.append((grid, group_cols.cpu(), group_offsets.cpu()))
                return kernel[grid](group_cols, group_offsets, *args, **kwargs)

            return launch

    monkeypatch.setattr(sparse_kernel, "_grad_weight_kernel", Recording())
    case = kernel_case(3)
    run_kernel(case)
    ((grid, group_cols, group_offsets),) = launches
    cols = case[2].long()
    assert torch.equal(group_cols, cols.unique())  # ascending, each id once
    assert grid[0] == group_cols.numel() and int(group_offsets[-1]) == cols.numel()
    assert torch.equal(group_offsets.diff(), torch.bincount(cols)[group_cols])


def test_compact_kept_entries_of_a_half_chunk(monkeypatch):
    """S's entries of a bf16 GEMM output, transformed as the forward kernel does, compacted across several column
    blocks in column order; a count that differs from the forward's |S| gives None (the chunk then goes dense). The
    forward's fallback where the fold's pool overflows; the fold's own entries: test_kept_entries_kernel.py."""
    from safevocab.kernels import kept_entries

    monkeypatch.setattr(kept_entries, "MAX_BLOCK", 16)
    g = torch.Generator().manual_seed(12)
    raw = (torch.randn(7, 90, generator=g) * 3).to(torch.bfloat16)
    raw[2, 30:60] = -math.inf
    scale, temperature = 1.5, 0.7
    z = raw.float() * scale / temperature  # the same fp32 operations as the kernel's (no softcap)
    m = z.amax(-1)
    t = m - torch.rand(7, generator=g) * 6
    t[4] = z[4].amin()  # a row keeping everything
    keep = z >= t[:, None]
    dev = [x.to(DEVICE) for x in (raw, t, m, keep.sum(-1))]
    cols, shifted = kept_entries.compact_kept(*dev, scale, None, temperature, apply_transform=True)
    r, c = keep.nonzero(as_tuple=True)
    assert torch.equal(cols.cpu(), c.to(torch.int32))
    assert torch.equal(shifted.cpu(), z[r, c] - m[r])
    wrong = dev[3].clone()
    wrong[5] -= 1
    assert kept_entries.compact_kept(*dev[:3], wrong, scale, None, temperature, apply_transform=True) is None
