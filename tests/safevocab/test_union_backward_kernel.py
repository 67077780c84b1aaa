"""The union backward (``safevocab.kernels.union_backward``, issue 56 point 3) and the gate that picks the stored sets'
backward (``safevocab.backends.triton.sparse_gate``).

Runs under Triton's interpreter on CPU (``test_kernels.py``'s set-up, imported from it), compiled on CUDA. Three levels:

- the kernel alone on hand-made CSR chunks (ids shared by many rows, empty rows, chunks with different unions)
  against the float64 restatement of the formula in ``test_sparse_backward_kernel.py`` and against the per-id kernels;
- the gate's rule, and each backward forced through ``fused_safe_logprobs(backend="triton")``;
- the fused op with the union backward forced, against the independent float64 reference
  (``tests/helpers/safevocab_reference.py`` through ``test_reference_fuzz.check_fused``): rules, replay, fp32 / bf16 /
  fp16, a softcap and temperature, targets outside ``S``, the entropy gradient on and off, forward outputs included.
"""

import pytest
import torch
from backward_path import set_sparse_max_density, sparse_max_density
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels import (  # noqa: F401  (kernel_env: the interpreter fixture, autouse)
    DEVICE,
    FULL_TRANSFORM,
    grads_of,
    kernel_env,
    make_inputs,
    slow,
)
from test_reference_fuzz import (
    check_fused,
    fuzz_settings,
    head_inputs,
    loss_of,
    loss_weights,
    rule_parts,
    rule_string,
    supports,
    transforms,
)
from test_sparse_backward_kernel import (
    _log_kept_mass_grads,
    assert_grads_close,
    assert_kernel_matches,
    mixed_loss,
    reference_grads,
    rl_loss,
)

import safevocab.backends.triton.backward as triton_backward
from safevocab import SafeSupport, fused_safe_logprobs
from safevocab.backends.triton import sparse_gate
from safevocab.kernels import sparse_backward as sparse_kernel
from safevocab.kernels import union_backward as union_kernel

COEFFICIENTS = ("targets", "log_sum_safe", "c_safe", "g_lp", "g_ent", "entropy", "set_max")

# ---------------------------------------------------------------------------------------------- the kernel alone


def union_case(seed, n_rows=10, vocab=29, hidden_size=19, dtype=torch.float32):
    """CSR entries of ``n_rows`` rows (global rows 3..), each row's ids distinct (a set) and drawn mostly from ids
    0..7 (many rows share each), two rows empty; coefficients and operands as ``kernel_case``'s."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(n_rows):
        few = torch.randint(0, 8, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)
        wide = torch.randint(0, vocab, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
        ids = torch.cat([few, wide]).unique()
        rows.append(ids[torch.randperm(ids.numel(), generator=g)] if r not in (1, 6) else ids[:0])
    counts = torch.tensor([r.numel() for r in rows])
    cols = torch.cat(rows).to(torch.int32)
    n_total = n_rows + 3
    coef = {
        "targets": torch.randint(0, 8, (n_total,), generator=g),
        "log_sum_safe": torch.rand(n_total, generator=g) * 2,
        "c_safe": torch.randn(n_total, generator=g),
        "g_lp": torch.randn(n_total, generator=g),
        "g_ent": torch.randn(n_total, generator=g) * 0.3,
        "entropy": torch.rand(n_total, generator=g),
        "set_max": torch.randn(n_total, generator=g),
    }
    shifted = -torch.rand(cols.numel(), generator=g) * 4
    hidden = torch.randn(n_total, hidden_size, generator=g).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=g).to(dtype)
    return torch.arange(3, 3 + n_rows), counts, cols, shifted, coef, hidden, weight


def run_union(case, transform=(1.0, None, 1.0), out_dtype=torch.float32, grad_shift=1.0, splits=(4, 7), **kw):
    """The union kernel on ``case`` cut into chunks at the stored rows ``splits``; returns the three gradients."""
    rows, counts, cols, shifted, coef, hidden, weight = (x.to(DEVICE) if torch.is_tensor(x) else x for x in case)
    coef = {k: v.to(DEVICE) for k, v in coef.items()}
    bounds = [0, *splits, counts.numel()]
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    parts = [(bounds[i], bounds[i + 1], offsets[bounds[i]], offsets[bounds[i + 1]]) for i in range(len(bounds) - 1)]
    ranks = union_kernel.kept_ranks([cols[e0:e1] for _, _, e0, e1 in parts], weight.shape[0])
    sizes = ranks[:, -1].tolist()
    chunks = [
        union_kernel.UnionChunk(int(rows[r0]), counts[r0:r1], cols[e0:e1], shifted[e0:e1], size)
        for (r0, r1, e0, e1), size in zip(parts, sizes)
    ]
    grads = [
        torch.zeros(hidden.shape, dtype=out_dtype, device=DEVICE),
        torch.zeros(weight.shape, dtype=out_dtype, device=DEVICE),
        torch.zeros(weight.shape[0], dtype=out_dtype, device=DEVICE),
    ]
    scale, softcap, temperature = transform
    union_kernel.union_backward(
        chunks,
        ranks,
        sizes[-1],
        *(coef[k] for k in COEFFICIENTS),
        hidden,
        weight,
        *grads,
        temperature=temperature,
        softcap=softcap,
        logit_scale=scale,
        grad_shift=grad_shift,
        **kw,
    )
    return [g.cpu() for g in grads]


def run_per_id(case):
    rows, counts, cols, shifted, coef, hidden, weight = case
    grads = [torch.zeros(hidden.shape), torch.zeros(weight.shape), torch.zeros(weight.shape[0])]
    sparse_kernel.sparse_backward(
        rows, counts, cols, shifted, *(coef[k] for k in COEFFICIENTS), hidden, weight, *grads,
        temperature=1.0, softcap=None, logit_scale=1.0,
    )  # fmt: skip
    return grads


@pytest.mark.parametrize("transform", [(1.0, None, 1.0), (1.7, 2.5, 1.3), (1.0, None, 0.05)])
def test_union_kernel_against_float64_formula(transform):
    """Three chunks with different unions (ids shared across rows and chunks), two empty rows: the float64 formula;
    unstored rows, empty rows and ids outside every union stay exactly zero."""
    case = union_case(0)
    rows, counts, cols, shifted, coef, hidden, weight = case
    if transform[1] is not None:  # tanh = (s + m_S) T / c must lie in (-1, 1): a softcapped logit
        coef["set_max"] = coef["set_max"].clamp(-0.5, 0.5)
        case = (rows, counts, cols, shifted * 0.1, coef, hidden, weight)
    got = run_union(case, transform)
    assert_kernel_matches(got, reference_grads(case, transform))
    assert not got[0][:3].any() and not got[0][[3 + 1, 3 + 6]].any()
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[cols.long()] = False
    assert untouched.any() and not got[1][untouched].any() and not got[2][untouched].any()


def test_union_kernel_agrees_with_per_id_and_is_deterministic():
    """The two GEMMs over U and the per-id kernels: the same gradients (fp32 sums in two orders); the union's bits are
    the same every run, however the entries are ordered within a row."""
    case = union_case(1)
    got = run_union(case)
    for a, b in zip(got, run_per_id(case)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, run_union(case)))
    assert all(torch.equal(a, b) for a, b in zip(got, run_union(case, splits=(4, 7))))


def test_kept_ranks_give_each_chunks_sorted_union_and_positions():
    """``kept_ranks`` / ``union_ids``: each chunk's U is ``cols.unique()`` (ascending, each id once), the last row the
    call's; an entry's column in G_U is its id's position in U; the per-id kernels given these ids group as before."""
    case = union_case(2)
    rows, counts, cols, shifted, coef, hidden, weight = case
    parts = [cols[:9], cols[9:], cols[:0]]
    ranks = union_kernel.kept_ranks(parts, weight.shape[0])
    for c, part in enumerate([*parts, cols]):
        ids = union_kernel.union_ids(ranks[c], int(ranks[c, -1]))
        assert torch.equal(ids, part.long().unique())
        assert torch.equal(ranks[c][part.long()] - 1, torch.searchsorted(ids, part.long()))
    mine = run_per_id(case)
    grads = [torch.zeros_like(g) for g in mine]
    sparse_kernel.sparse_backward(
        rows, counts, cols, shifted, *(coef[k] for k in COEFFICIENTS), hidden, weight, *grads,
        temperature=1.0, softcap=None, logit_scale=1.0, kept_ids=cols.long().unique(),
    )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(grads, mine))


def test_union_kernel_adds_once_to_existing_gradients_in_any_dtype():
    """Added to what the gradients hold; in the weight's own dtype (bf16, as the fused op hands a sparse-only
    backward) each row is read, added to in fp32 and rounded once: within one bf16 rounding of the exact sum."""
    case = union_case(3)
    want = reference_grads(case)
    grads = [torch.full_like(w, 0.5, dtype=torch.bfloat16) for w in want]
    rows, counts, cols, shifted, coef, hidden, weight = case
    ranks = union_kernel.kept_ranks([cols], weight.shape[0])
    chunk = union_kernel.UnionChunk(3, counts, cols, shifted, int(ranks[0, -1]))
    union_kernel.union_backward(
        [chunk], ranks, int(ranks[-1, -1]), *(coef[k] for k in COEFFICIENTS), hidden, weight, *grads,
        temperature=1.0, softcap=None, logit_scale=1.0,
    )  # fmt: skip
    for got, exact in zip(grads, want):
        exact = exact + 0.5
        assert got.dtype == torch.bfloat16 and bool(((got.double() - exact).abs() <= exact.abs() * 2.0**-8).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_union_kernel_half_inputs_accumulate_in_fp32(dtype):
    """bf16/fp16 ``h`` and ``W``: with G_U in fp32 (a CPU, or rows with a full-softmax part) every product and sum is
    fp32, as close to float64 as fp32 allows; with G_U in the inputs' dtype (an accelerator's tensor cores) within
    one rounding of the logits gradient; ``grad_shift`` (fp16 at tiny temperatures) gives the same result."""
    case = union_case(4, dtype=dtype)
    want = reference_grads(case)
    assert_kernel_matches(run_union(case), want, rtol=1e-5)
    for shift in (1.0, 2.0**10):
        got = run_union(case, grad_shift=shift, half_operands=True)
        assert_kernel_matches(got, want, rtol=2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)


# ---------------------------------------------------------------------------------------------- the gate


def test_gate_rule_and_force(monkeypatch):
    """Union while the fill (kept logits over the G_U cells) reaches UNION_MIN_FILL, per-id below; dense once the widest
    union passes DENSE_MIN_UNION of V, only where it may run; FORCE overrides (dense where it may not: union)."""
    v = 100_000
    fill = sparse_gate.UNION_MIN_FILL
    cells = 1024 * 10_000  # 1024 rows, |U| = 10,000
    edge = round(fill * cells)
    assert edge == fill * cells and sparse_gate.choose(edge, cells, 10_000, v, True) == sparse_gate.UNION
    assert sparse_gate.choose(edge - 1, cells, 10_000, v, True) == sparse_gate.PER_ID
    wide = int(sparse_gate.DENSE_MIN_UNION * v) + 1
    assert sparse_gate.choose(cells, cells, wide, v, True) == sparse_gate.DENSE
    assert sparse_gate.choose(cells, cells, wide - 1, v, True) == sparse_gate.UNION
    assert sparse_gate.choose(cells, cells, wide, v, False) == sparse_gate.UNION
    for forced in sparse_gate.BACKWARDS:
        monkeypatch.setattr(sparse_gate, "FORCE", forced)
        assert sparse_gate.choose(1, cells, 10, v, True) == forced
    assert sparse_gate.choose(1, cells, 10, v, False) == sparse_gate.UNION  # dense may not run: union
    monkeypatch.setattr(sparse_gate, "FORCE", "gemm")
    with pytest.raises(ValueError, match="FORCE must be one of"):
        sparse_gate.choose(1, 1, 1, v, True)


# ---------------------------------------------------------------------------------------------- through the fused op


@pytest.fixture
def taken(monkeypatch):
    """The backwards the stored sets took in this test, in order (one a call with stored chunks)."""
    calls = []
    choose = sparse_gate.choose
    monkeypatch.setattr(sparse_gate, "choose", lambda *a, **k: calls.append(choose(*a, **k)) or calls[-1])
    return calls


def run_op(params, targets, rule, loss, **kwargs):
    hidden, weight, bias = params
    out = fused_safe_logprobs(
        hidden, weight, targets, rule, bias=bias, backend="triton", compute_entropy=True, max_chunk_bytes=4096, **kwargs
    )
    return out, grads_of(loss(out), params)


def rl_loss_without_entropy(out, seed=3):
    w = torch.randn(out.logprobs.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return (out.logprobs * w * out.in_safe).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_forced_backward_gives_the_same_gradients(dtype, taken, monkeypatch):
    """Every chunk stored; the RL loss (no row leaves S) with and without the entropy gradient, then the mixed loss
    (targets outside S, log_kept_mass): per-id, union and dense forced (backwards of one forward) agree; dense is
    refused where rows leave S (their full-softmax part is the fused op's: union instead)."""
    set_sparse_max_density(monkeypatch, 1.0)
    accumulators = []  # the dtypes the dense backward of the stored chunks adds into: fp32, whatever the op hands
    dense = triton_backward.dense_backward
    monkeypatch.setattr(triton_backward, "dense_backward",
                        lambda *a: accumulators.extend(g.dtype for g in a[4] if g is not None) or dense(*a))  # fmt: skip
    hidden, weight, bias, targets = make_inputs(n=16, v=64, dtype=dtype, seed=5)
    params = (hidden, weight, bias)
    out = fused_safe_logprobs(hidden, weight, targets, "top_k=5", bias=bias, backend="triton", compute_entropy=True,
                              max_chunk_bytes=2048, temperature=0.7)  # fmt: skip
    for loss in (rl_loss, rl_loss_without_entropy, mixed_loss):
        got = {}
        for forced in sparse_gate.BACKWARDS:
            monkeypatch.setattr(sparse_gate, "FORCE", forced)
            got[forced] = torch.autograd.grad(loss(out), params, retain_graph=True)
        for forced in (sparse_gate.UNION, sparse_gate.DENSE):
            assert_grads_close(got[forced], got[sparse_gate.PER_ID], dtype)
    mixed = [sparse_gate.PER_ID, sparse_gate.UNION, sparse_gate.UNION]  # dense forced where rows leave S: union
    assert taken == [*sparse_gate.BACKWARDS, *sparse_gate.BACKWARDS, *mixed]
    assert accumulators == [torch.float32] * 6  # two calls, three gradients (the op's are bf16 for bf16 inputs)


def test_default_gate_follows_its_constants(taken, monkeypatch):
    """Without FORCE the gate decides from the call's counts: unions wider than DENSE_MIN_UNION of V give dense (a tiny
    vocabulary: the default); with that threshold at V, small sets filling their union give union, and a fill threshold
    above the call's gives per-id."""
    set_sparse_max_density(monkeypatch, 1.0)
    hidden, weight, bias, targets = make_inputs(n=16, v=90, seed=6)
    params = (hidden, weight, bias)
    dense = run_op(params, targets, "min_p=0.1", rl_loss)[1]
    monkeypatch.setattr(sparse_gate, "DENSE_MIN_UNION", 1.0)
    want = run_op(params, targets, "min_p=0.1", rl_loss)[1]
    monkeypatch.setattr(sparse_gate, "UNION_MIN_FILL", 1.0)
    per_id = run_op(params, targets, "min_p=0.1", rl_loss)[1]
    assert taken == [sparse_gate.DENSE, sparse_gate.UNION, sparse_gate.PER_ID]
    for got in (per_id, dense):
        assert_grads_close(got, want, torch.float32)


def test_union_keeps_g_in_fp32_where_rows_leave_s(taken, monkeypatch):
    """Issue 57's T1 under the union backward with half operands switched on (the accelerator's rounding): a replayed
    support with the log_kept_mass gradient has a full-softmax part, so G_U stays fp32 and the gradient is exactly 0
    where S is the whole vocabulary; the RL loss (no such part) takes bf16 operands and stays within bf16 rounding."""
    set_sparse_max_density(monkeypatch, 1.0)
    monkeypatch.setattr(sparse_gate, "FORCE", sparse_gate.UNION)
    monkeypatch.setattr(triton_backward, "_HALF_OPERANDS_ON_CPU", True)
    n, v = 12, 50
    hidden, weight, bias, targets = make_inputs(n=n, v=v, dtype=torch.bfloat16, seed=13)
    params = (hidden, weight, bias)
    whole = SafeSupport.from_lists([list(range(v))] * n)
    for grad in _log_kept_mass_grads("triton", params, targets, whole):
        assert float(grad.abs().max()) <= 4 * torch.finfo(torch.float32).eps, grad.abs().max()
    half = run_op(params, targets, "top_k=5", rl_loss)[1]
    ref = fused_safe_logprobs(*params[:2], targets, "top_k=5", bias=bias, backend="torch", compute_entropy=True)
    assert_grads_close(half, grads_of(rl_loss(ref), params), torch.bfloat16)
    assert taken == [sparse_gate.UNION, sparse_gate.UNION]


def _inputs(dtype, seed, n=9, h=6, v=24, bias=True):
    """``head_inputs``' dict for fixed draws: exact dyadic inputs (ties and GEMMs exact in every dtype)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-8, 9, (n, h), generator=g).double() / 8
    weight = torch.randint(-8, 9, (v, h), generator=g).double() / 8
    b = torch.randint(-16, 17, (v,), generator=g).double() / 8 if bias else None
    raw = hidden @ weight.t() + (0 if b is None else b)
    targets = torch.where(torch.arange(n) % 2 == 0, raw.argmax(-1), torch.randint(0, v, (n,), generator=g))
    return dict(dtype=dtype, exact=True, hidden=hidden, weight=weight, bias=b, targets=targets, loss_seed=seed)


def _loss_seed(entropy: bool, log_kept: bool) -> int:
    """A seed of ``check_fused``'s loss (``loss_weights``) with or without the entropy and log_kept_mass terms and
    unmasked log-probs (targets outside S keep their gradient)."""
    return next(s for s in range(1000) if _loss_terms(s) == (log_kept, entropy, False))


def _loss_terms(seed):
    _, kept, ent, masked = loss_weights(4, seed, masked=False)
    return kept is not None, ent is not None, masked


NO_TRANSFORM = {"temperature": 1.0, "softcap": None, "logit_scale": 1.0}
CAPPED = {**NO_TRANSFORM, **FULL_TRANSFORM}


@pytest.mark.parametrize(
    "parts, dtype, transform, entropy",
    [
        ([("min_p", 0.1)], torch.float32, NO_TRANSFORM, True),
        ([("top_k", 4)], torch.bfloat16, CAPPED, False),
        ([("top_p", 0.8)], torch.float16, {**NO_TRANSFORM, "temperature": 0.5}, True),
        ([], torch.bfloat16, NO_TRANSFORM, False),
        pytest.param([("top_k", 6), ("min_p", 0.05)], torch.float32, CAPPED, False, marks=slow),
        pytest.param([("min_p", 0.2)], torch.float16, CAPPED, True, marks=slow),
        pytest.param([("top_p", 0.9)], torch.bfloat16, NO_TRANSFORM, True, marks=slow),
        pytest.param([], torch.float64, CAPPED, True, marks=slow),
    ],
)
def test_union_backward_matches_float64_reference(parts, dtype, transform, entropy, taken, monkeypatch):
    """The fused op, every chunk stored and the union backward forced: outputs and gradients wrt hidden, weight and
    bias against the float64 reference; half the targets random (often outside S: a full-softmax part beside the
    union's), log_kept_mass in the loss, the entropy gradient on or off."""
    monkeypatch.setattr(sparse_gate, "FORCE", sparse_gate.UNION)
    inputs = {**_inputs(dtype, seed=7), "loss_seed": _loss_seed(entropy, log_kept=True)}
    check_fused(inputs, parts, transform, 300, False, "triton", device=DEVICE.type)
    assert_union_matches_per_id(inputs, parts, transform, monkeypatch)
    assert taken == [sparse_gate.UNION, sparse_gate.UNION, sparse_gate.PER_ID]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_union_backward_replay_matches_float64_reference(dtype, taken, monkeypatch):
    """Replayed supports (unsorted ids, the argmax often left out: S has its own shift), with a rule and without:
    the union backward against the float64 reference (the dense backward may never run on them)."""
    inputs = _inputs(dtype, seed=8)
    g = torch.Generator().manual_seed(9)
    support = [torch.randperm(24, generator=g)[: 2 + i % 7].tolist() for i in range(9)]
    for parts in ([], [("top_k", 12)]):
        monkeypatch.setattr(sparse_gate, "FORCE", sparse_gate.DENSE)  # not allowed under replay: union
        inputs["loss_seed"] = _loss_seed(entropy=True, log_kept=not parts)
        check_fused(inputs, parts, NO_TRANSFORM, 300, False, "triton", device=DEVICE.type, support=support)
        assert_union_matches_per_id(inputs, parts, NO_TRANSFORM, monkeypatch, support=support)
    assert taken == [sparse_gate.UNION, sparse_gate.UNION, sparse_gate.PER_ID] * 2


def assert_union_matches_per_id(inputs, parts, transform, monkeypatch, support=None):
    """The same call's gradients (``check_fused``'s loss) with the union and the per-id backward forced: one summation
    order apart, so within rounding of the gradients' dtype; much tighter than the float64 reference's tolerances for
    half inputs (``check_fused``: a few ulps of the operands' size), which a permuted ``U`` can pass."""
    dtype = inputs["dtype"]
    params = [None if x is None else x.to(dtype).to(DEVICE).requires_grad_() for x in
              (inputs["hidden"], inputs["weight"], inputs["bias"])]  # fmt: skip
    weights = loss_weights(inputs["targets"].numel(), inputs["loss_seed"], masked=False)
    got, previous = {}, sparse_gate.FORCE
    for forced in (sparse_gate.UNION, sparse_gate.PER_ID):
        monkeypatch.setattr(sparse_gate, "FORCE", forced)
        with sparse_max_density(1.0):
            out = fused_safe_logprobs(params[0], params[1], inputs["targets"].to(DEVICE), rule_string(parts),
                                      bias=params[2], compute_entropy=True, max_chunk_bytes=300, backend="triton",
                                      support=None if support is None else SafeSupport.from_lists(support),
                                      **transform)  # fmt: skip
            got[forced] = grads_of(loss_of(out, weights, out.in_safe), params)
    monkeypatch.setattr(sparse_gate, "FORCE", previous)
    if dtype == torch.float64:
        for a, b in zip(got[sparse_gate.UNION], got[sparse_gate.PER_ID]):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    else:
        assert_grads_close(got[sparse_gate.UNION], got[sparse_gate.PER_ID], dtype)


def _union_property(inputs, data, replay):
    parts = data.draw(rule_parts(inputs["weight"].shape[0]))
    transform = data.draw(transforms(inputs["exact"]))
    support = data.draw(supports(inputs)) if replay else None
    saved = sparse_gate.FORCE
    sparse_gate.FORCE = sparse_gate.UNION
    try:
        check_fused(inputs, parts, transform, data.draw(st.integers(1, 4096)), False, "triton", DEVICE.type, support)
    finally:
        sparse_gate.FORCE = saved


_cases = dict(inputs=head_inputs(), data=st.data(), replay=st.booleans())


@settings(fuzz_settings(6), suppress_health_check=list(HealthCheck))
@given(**_cases)
def test_union_backward_property(inputs, data, replay):
    """Random inputs (every dtype), rules, transforms, chunkings and replayed supports, the union backward forced:
    the float64 reference."""
    _union_property(inputs, data, replay)


@slow
@settings(fuzz_settings(150), suppress_health_check=list(HealthCheck))
@given(**_cases)
def test_union_backward_property_ci(inputs, data, replay):
    _union_property(inputs, data, replay)
