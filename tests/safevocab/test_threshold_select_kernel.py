"""The selection kernel (``safevocab.kernels.threshold_select``): top_k / top_p / composition thresholds computed from
the raw GEMM output equal the rules' own torch code on the same (kernel-transformed) fp32 logits, bit for bit.

Under Triton's interpreter on CPU (as tests/safevocab/test_kernels.py sets it up: ``TRITON_INTERPRET=1`` before the first
``import triton`` of the process), compiled on CUDA. Rows: random, ties at the k-th value, ``-inf`` entries, flat rows
(the radix select, or without it the fallback; the radix select itself: test_radix_select_kernel.py), peaked rows,
``k`` above the sketch's slots, ``q`` near 0 and 1, every engine order, the transforms, bf16 and fp32 inputs; then
``fused_safe_logprobs(backend="triton")`` forward and backward against the torch backend.
"""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

# test_kernels imports Triton under its interpreter on CPU (or skips the module when it cannot) and brings every
# kernel module in through the Triton backend: the same set-up, and its fixture (autouse), for these tests
from test_kernels import DEVICE, kernel_env, triton_package  # noqa: F401
from test_nucleus import tiny_tail_row

import safevocab.backends.triton.route as triton_route
import safevocab.kernels.threshold_select as ts
from safevocab import SafeSupport, fused_safe_logprobs, parse_rule
from safevocab.kernels.candidate_thresholds import MASS_MARGIN
from safevocab.rules import finite_floor

TRANSFORMS = [{}, {"temperature": 0.7}, {"softcap": 2.5, "scale": 1.7, "temperature": 1.3}]
COMPOSITIONS = [
    "top_k=30,top_p=0.9,min_p=0.01",
    "top_k=30,top_p=0.9,min_p=0.01,min_prob=0.002",
    "top_p=0.8,min_p=0.05",
    "top_k=20,top_p=0.7",
    "top_k=5,min_p=0.1",
]


def random_rows(n=12, v=700, seed=0, sd=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * sd).to(dtype).to(DEVICE)


def adversarial_rows(v=700, seed=0, dtype=torch.float32):
    """Ties at every value (integer logits), ``-inf`` entries, a row with 3 finite logits, flat rows, peaked rows."""
    g = torch.Generator().manual_seed(seed)
    ties = (torch.randn(4, v, generator=g) * 2).round()
    neg_inf = torch.randn(3, v, generator=g) * 3
    neg_inf[torch.rand(3, v, generator=g) < 0.4] = -torch.inf
    few = torch.full((1, v), -torch.inf)
    few[0, :3] = torch.tensor([1.0, 2.0, 2.0])
    flat = torch.zeros(2, v)
    flat[1, 5] = 0.5  # flat but one
    peaked = torch.randn(3, v, generator=g)
    peaked[:, 7] += 30.0
    peaked[2, 9] = peaked[2, 7]  # two tied argmaxes
    return torch.cat([ties, neg_inf, few, flat, peaked]).to(dtype).to(DEVICE)


def rows_near_a_mass_boundary(z, q):
    """Rows whose exact (float64) top_p crossing is ambiguous within twice the candidate phase's margin: the first
    entries reaching ``q T -+ 2 MASS_MARGIN T`` differ in value (the candidate phase leaves those to the rule)."""
    z64 = z.double()
    e = (z64 - z64.amax(-1, keepdim=True)).exp()
    total = e.sum(-1, keepdim=True)
    vals, order = z64.sort(-1, descending=True)
    running = e.gather(-1, order).cumsum(-1)
    width = 2 * MASS_MARGIN * total
    low, high = running >= q * total - width, running >= q * total + width
    first = lambda hit: vals.gather(-1, hit.to(torch.uint8).argmax(-1, keepdim=True))  # noqa: E731
    return set((first(low) != first(high)).squeeze(-1).nonzero().squeeze(-1).tolist())


def reference(raw, rule, transform):
    """``rule.threshold_and_max`` on the logits the kernels see: the raw chunk through the kernels' transform."""
    z = ts.transformed_rows(raw, torch.arange(raw.shape[0], device=raw.device), **transform)
    t, m = rule.threshold_and_max(z)
    return z, t.squeeze(-1), m.squeeze(-1)


def select(raw, rule, transform, kcap=None, refine_passes=None, radix=True):
    n = raw.shape[0]
    threshold = torch.empty(n, device=raw.device)
    row_max = torch.empty(n, device=raw.device)
    plan = ts.selection_plan(rule)
    kw = dict(kcap=kcap, refine_passes=refine_passes, radix=radix, **transform)
    fallback, count = ts.select_thresholds(raw, plan, threshold, row_max, **kw)
    return threshold, row_max, fallback, count


def assert_same_thresholds(raw, rule, transform, kcap=None, exact=True, refine_passes=None, radix=True):
    z, t_ref, m_ref = reference(raw, rule, transform)
    t, m, fallback, count = select(raw, rule, transform, kcap, refine_passes, radix)
    assert torch.equal(m, m_ref)
    # the sets, and (without min_prob, whose threshold sums the kept mass in another order) the thresholds
    assert torch.equal(z >= t.unsqueeze(-1), z >= t_ref.unsqueeze(-1)), f"{rule}: sets differ"
    if exact:
        assert torch.equal(t, t_ref), f"{rule}: thresholds {t} != {t_ref}"
    else:
        torch.testing.assert_close(t, t_ref, rtol=1e-6, atol=0)
    return fallback, count


def test_selection_plan_floors_follow_the_engine_order():
    parts = lambda spec, engine="hf": tuple(  # noqa: E731
        p.key for p in ts.selection_plan(parse_rule(spec, engine=engine)).floor_parts(1000)
    )
    assert parts("top_k=5") == ("top_k",) and parts("top_p=0.9") == ("top_p",)
    # a mass-dependent stage after the first needs the whole kept set of the stages before it
    assert parts("top_k=5,top_p=0.9,min_p=0.1") == ("top_k",)
    assert parts("top_p=0.9,min_p=0.1") == ("top_p", "min_p")
    assert parts("top_k=5,top_p=0.9,min_p=0.1", "vllm") == ("min_p", "top_k")
    assert parts("top_k=5,top_p=0.9", "sglang") == ("top_k", "top_p")  # one joint stage
    assert parts("top_k=5,min_p=0.1,min_prob=0.01") == ("top_k", "min_p")
    assert parts("top_k=2000,top_p=0.9") == ("top_p",)  # top_k >= V keeps everything: dropped
    assert ts.selection_plan(parse_rule("min_p=0.1")) is None
    assert ts.selection_plan(parse_rule("top_p=1.0")).active(10) == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_elementary_rules_on_random_rows(dtype, transform):
    raw = random_rows(n=8, v=400, dtype=dtype)
    z = ts.transformed_rows(raw, torch.arange(raw.shape[0]), **transform)
    for spec in ("top_k=1", "top_k=7", "top_k=50", "top_p=0.5", "top_p=0.99"):
        fallback, count = assert_same_thresholds(raw, parse_rule(spec), transform)
        # random rows need no fallback, except top_p rows whose crossing lies within rounding of q T
        allowed = rows_near_a_mass_boundary(z, parse_rule(spec).q) if spec.startswith("top_p") else set()
        assert set(fallback.tolist()) <= allowed, f"{spec}: fallback {fallback.tolist()}, near a boundary {allowed}"
        if spec == "top_k=7":  # the sketch's floor is selective: a few candidates, not the row
            assert int(count.max()) < 40


@pytest.mark.parametrize("engine", ["hf", "vllm", "sglang"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compositions_in_every_engine_order(engine, dtype):
    raw = random_rows(n=6, v=400, seed=1, dtype=dtype)
    for spec in COMPOSITIONS:
        rule = parse_rule(spec, engine=engine)
        assert_same_thresholds(raw, rule, TRANSFORMS[2], exact="min_prob" not in spec)


# fp32 in the slow tier: the bf16 case runs the same rows through the same kernels (bf16 adds the input's rounding)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
def test_adversarial_rows(dtype):
    """Ties at the k-th value are kept, ``-inf`` never is; flat rows overflow a small KCAP: the radix select decides
    them (without it, the torch fallback)."""
    raw = adversarial_rows(dtype=dtype)
    specs = ["top_k=1", "top_k=5", "top_k=40", "top_p=1e-6", "top_p=0.5", "top_p=0.9999", "top_p=1.0"]
    specs += ["top_k=699", "top_k=700", "top_k=5000"] + COMPOSITIONS[:1]
    flat_rows = {8, 9}
    for spec in specs:
        fallback, _ = assert_same_thresholds(raw, parse_rule(spec), {}, kcap=128)
        if spec in ("top_p=0.5", "top_k=40"):
            assert not flat_rows & set(fallback.tolist()), f"{spec}: flat rows decided in the kernel"
            fallback, _ = assert_same_thresholds(raw, parse_rule(spec), {}, kcap=128, radix=False)
            assert flat_rows <= set(fallback.tolist()), f"{spec}: flat rows overflow KCAP=128"
    ties = ts.transformed_rows(raw[:1], torch.tensor([0]))
    t, *_ = select(raw[:1], parse_rule("top_k=30"), {})
    assert int((ties >= t).sum()) > 30  # the tie at the 30th value is kept whole


@pytest.mark.parametrize("transform", [TRANSFORMS[0], TRANSFORMS[2]])
def test_k_above_the_sketch_and_several_column_blocks(transform, monkeypatch):
    """64 slots for 600 columns: the column loop, ``k > slots`` (floor -inf: all finite logits are candidates,
    which overflow KCAP=256: the pivot refinement, or without it the radix select, or without both the fallback),
    ``k`` within the slots."""
    monkeypatch.setattr(ts, "SKETCH_SLOTS", 64)
    raw = random_rows(n=4, v=600, seed=2, dtype=torch.bfloat16)
    spec = parse_rule("top_k=100")
    fallback, count = assert_same_thresholds(raw, spec, transform, kcap=256, refine_passes=0, radix=False)
    assert fallback.numel() == 4 and bool((count == 600).all())
    fallback, count = assert_same_thresholds(raw, spec, transform, kcap=256, refine_passes=0)
    assert fallback.numel() == 0 and bool((count == 600).all())
    # the pivot refinement raises the floor until the candidates fit
    fallback, count = assert_same_thresholds(raw, parse_rule("top_k=100"), transform, kcap=256)
    assert fallback.numel() == 0 and bool((count <= 256).all())
    fallback, count = assert_same_thresholds(raw, parse_rule("top_k=100"), transform, kcap=600)
    assert fallback.numel() == 0  # the whole row fits: decided from the candidates
    fallback, count = assert_same_thresholds(raw, parse_rule("top_k=10"), transform, kcap=256)
    assert fallback.numel() == 0 and int(count.max()) < 256
    for spec in ("top_p=0.9", COMPOSITIONS[0]):
        assert_same_thresholds(raw, parse_rule(spec), transform, kcap=256)


@pytest.mark.parametrize("spec", ["top_p=0.3", "top_k=150,top_p=0.9"])
def test_pivot_refinement_of_flat_rows(spec, monkeypatch):
    """Flattish rows, 64 sketch slots for 900 columns: the sketch's bound lies far below the threshold and overflows
    KCAP=200; a few pivot passes raise it until the candidates fit, and the set is still exact. Rows whose kept set
    itself is wider than KCAP go to the radix select, here off: to the rule's code."""
    monkeypatch.setattr(ts, "SKETCH_SLOTS", 64)
    raw = random_rows(n=4, v=900, seed=3, sd=1.0, dtype=torch.bfloat16)
    *_, count0 = select(raw, parse_rule(spec), {}, kcap=200, refine_passes=0)
    assert bool((count0 > 200).any()), f"the sketch's bound alone overflows: {count0}"
    assert_same_thresholds(raw, parse_rule(spec, engine="vllm"), {}, kcap=200, radix=False)
    fallback, count = assert_same_thresholds(raw, parse_rule(spec), {}, kcap=200, radix=False)
    z = ts.transformed_rows(raw, torch.arange(4))
    kept = (z >= parse_rule(spec).threshold(z)).sum(-1)
    wide = set((kept > 200).nonzero().squeeze(-1).tolist())  # rows whose kept set itself exceeds KCAP
    assert wide <= set(fallback.tolist()) and len(fallback) < int((count0 > 200).sum()), (fallback, count0, kept)
    # the raised floor is still a floor: every kept logit is a candidate (a floor above t would send the row to the
    # fallback, exact but slow)
    assert bool((count >= kept).all()), (count, kept)


def test_flat_rows_top_p_take_the_radix_select_or_the_flat_floor():
    """All-equal rows: the nucleus is every tied token. With V > KCAP the row overflows and the radix select decides
    it (without it, the rule's code); with room, the candidates do."""
    raw = torch.zeros(3, 900, device=DEVICE)
    raw[1] = torch.linspace(0, 1e-3, 900)
    for kcap, radix, expect_fallback in ((64, False, True), (64, True, False), (900, False, False)):
        fallback, _ = assert_same_thresholds(raw, parse_rule("top_p=0.9"), {}, kcap=kcap, radix=radix)
        assert (fallback.numel() > 0) == expect_fallback


def test_unread_fallback_flags_the_rows_the_read_gives_to_the_rule():
    """``fallback=False`` (the GPU plan's price of the read): the rows left to the rule's code come back as ``[n]``
    flags, with no read of the device, and the other rows' thresholds are those of the read path."""
    from safevocab.testing.host_syncs import HostSyncs

    raw = torch.zeros(3, 900, device=DEVICE)
    raw[1] = torch.linspace(0, 1e-3, 900)
    rule = parse_rule("top_p=0.9")
    t_read, _, rows, _ = select(raw, rule, {}, kcap=64, radix=False)
    assert rows.numel() > 0
    threshold, row_max = torch.empty(3, device=DEVICE), torch.empty(3, device=DEVICE)
    with HostSyncs() as reads:
        flags, _ = ts.select_thresholds(raw, ts.selection_plan(rule), threshold, row_max, kcap=64, radix=False,
                                        fallback=False)  # fmt: skip
    assert reads.count == 0, reads.report()
    assert flags.dtype == torch.bool and torch.equal(flags.nonzero().squeeze(-1), rows)
    assert torch.equal(threshold[~flags], t_read[~flags])
    # a rule without a mass stage (the radix select decides every row): flags too, none set
    flags, _ = ts.select_thresholds(raw, ts.selection_plan(parse_rule("top_k=5")), threshold, row_max, fallback=False)
    assert flags.dtype == torch.bool and flags.shape == (3,) and not bool(flags.any())


def _flagged_rows(n_rows: int, flagged: list[int]) -> torch.Tensor:
    """``[n_rows, 900]`` rows whose ``top_p=0.9`` candidates overflow ``kcap=64`` where ``flagged`` (near-flat rows:
    with the radix select off they go to the rule's code), and a single dominant token elsewhere (decided)."""
    g = torch.Generator().manual_seed(7)
    raw = torch.zeros(n_rows, 900)
    raw[:, 0] = 20.0
    raw[flagged] = torch.rand(len(flagged), 900, generator=g) * 1e-2
    return raw.to(DEVICE)


@pytest.mark.parametrize("flagged", [[5, 70, 129], [0, 2, 64, 65, 100]])
def test_bounded_batch_decides_the_rule_rows_without_a_read(flagged):
    """``undecided=`` (the Triton forward's default on mass rules): the rows left to the rule's code are decided in one
    batch of ``ceil(n / BATCH_DIVISOR)`` rows (3 of 130) with no read of the device, as the read path decides them;
    the flagged rows past the batch are set in ``undecided``, and no other row's threshold moves (the padding goes to
    a scratch slot)."""
    from safevocab.testing.host_syncs import HostSyncs

    raw, rule = _flagged_rows(130, flagged), parse_rule("top_p=0.9")
    t_read, m_read, rows, _ = select(raw, rule, {}, kcap=64, radix=False)
    assert rows.tolist() == flagged  # the read path's rows: the ones made to overflow
    threshold = torch.full((130,), 123.0, device=DEVICE)
    row_max, undecided = torch.empty_like(threshold), torch.ones(130, dtype=torch.bool, device=DEVICE)
    with HostSyncs() as reads:
        flags, _ = ts.select_thresholds(raw, ts.selection_plan(rule), threshold, row_max, kcap=64, radix=False,
                                        undecided=undecided)  # fmt: skip
    assert reads.count == 0, reads.report()
    assert flags.dtype == torch.bool and flags.nonzero().squeeze(-1).tolist() == flagged
    past = flagged[3:]  # the batch holds the first three
    assert undecided.nonzero().squeeze(-1).tolist() == past
    decided = ~undecided
    assert torch.equal(threshold[decided], t_read[decided]) and torch.equal(row_max, m_read)
    assert all(float(threshold[row]) != float(t_read[row]) for row in past)  # the kernels' estimates, not the rule's


def test_bounded_batch_leaves_a_row_decided_by_the_summation_order_to_the_read():
    """A row where the batch's sort and the read path's radix select sum the same masses in orders that put ``q T`` on
    different sides: the batch marks it ``undecided`` (the forward folds its chunk again with the read), so the set
    taken is the read path's (the rule's own ``threshold``)."""
    raw, rule = tiny_tail_row().to(DEVICE), parse_rule("top_p=0.9999999999985")
    t_read, _, rows, _ = select(raw, rule, {})
    assert rows.tolist() == [0] and torch.equal(t_read, rule.threshold(raw).squeeze(-1))
    threshold, row_max = torch.empty(1, device=DEVICE), torch.empty(1, device=DEVICE)
    undecided = torch.zeros(1, dtype=torch.bool, device=DEVICE)
    ts.select_thresholds(raw, ts.selection_plan(rule), threshold, row_max, undecided=undecided)
    assert undecided.tolist() == [True] and not torch.equal(threshold, t_read)  # the sort's, not taken


@settings(max_examples=12, deadline=None)
# Found by the random profile: T's rounding in the kernel and in the rule put a top_p=0.999 crossing (2.2e-8 relative
# below q T) one token apart, until the candidate phase certified masses with a margin (MASS_MARGIN).
@example(seed=2238, v=257, sd=3.0, k=1, q=0.999, engine="hf")
@given(
    seed=st.integers(0, 10_000),
    v=st.integers(257, 1200),
    sd=st.sampled_from([0.3, 3.0, 10.0]),
    k=st.integers(1, 300),
    q=st.sampled_from([1e-4, 0.3, 0.9, 0.999]),
    engine=st.sampled_from(["hf", "vllm", "sglang"]),
)
def test_property_random_rows(seed, v, sd, k, q, engine):
    raw = random_rows(n=4, v=v, seed=seed, sd=sd, dtype=torch.bfloat16)
    for spec in (f"top_k={k}", f"top_p={q}", f"top_k={k},top_p={q},min_p=0.02"):
        assert_same_thresholds(raw, parse_rule(spec, engine=engine), {"temperature": 0.9}, kcap=128)


# ---------------------------------------------------------------------------------------------- the fused op


def make_inputs(n=24, h=16, v=400, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 3 / h**0.5).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["top_k=10", "top_p=0.8", "top_k=30,top_p=0.9,min_p=0.01"])
def test_fused_forward_backward_match_the_torch_backend(spec, dtype, monkeypatch):
    """The Triton backend takes the selection kernel (no fp32 ChunkLogits copy) and matches the torch backend."""
    calls = []
    original = triton_route.select_thresholds
    monkeypatch.setattr(triton_route, "select_thresholds", lambda *a, **k: calls.append(1) or original(*a, **k))

    def no_copy(*args, **kwargs):
        raise AssertionError("the selection path builds no fp32 ChunkLogits copy")

    monkeypatch.setattr(triton_route, "ChunkLogits", no_copy)
    hidden, weight, targets = make_inputs(dtype=dtype)
    outs, grads = [], []
    for backend in ("triton", "torch"):
        out = fused_safe_logprobs(
            hidden, weight, targets, spec, backend=backend, compute_entropy=True, max_chunk_bytes=8192, temperature=0.8
        )
        loss = (out.logprobs.double() * torch.linspace(-1, 1, len(targets), dtype=torch.float64)).sum()
        loss = loss + out.entropy.double().sum() + out.log_kept_mass.double().sum()
        outs.append(out)
        grads.append(torch.autograd.grad(loss, (hidden, weight)))
    assert calls, "the selection kernel ran"
    tri, ref = outs
    assert torch.equal(tri.in_safe, ref.in_safe) and torch.equal(tri.safe_size, ref.safe_size)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for field in ("logprobs", "log_kept_mass", "entropy"):
        torch.testing.assert_close(getattr(tri, field), getattr(ref, field), **tol)
    for a, b in zip(*grads):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-5 if dtype == torch.float32 else 3e-2, rtol=1e-3)


def _every_top_p_row_to_the_rule(monkeypatch) -> dict:
    """Widen the mass margin to a quarter of the mass (every ``top_p`` row is then left to the rule's code, so the
    bounded batch overflows) and give the test its own ``MASS_BATCH_REDOS``, returned."""
    from safevocab.backends.triton import forward as triton_forward
    from safevocab.kernels import candidate_decide, radix_select

    for module in (candidate_decide, radix_select):
        monkeypatch.setattr(module, "MASS_MARGIN", 0.25)
    redos = {"chunks": 0, "read_from_now_on": set()}
    monkeypatch.setattr(triton_forward, "MASS_BATCH_REDOS", redos)
    return redos


def _support_lists(hidden, weight) -> list[list[int]]:
    """Every third id from a row-dependent start, and each row's argmax (kept by every rule)."""
    top = (hidden.detach().double() @ weight.detach().double().t()).argmax(-1).tolist()
    return [sorted(set(range(i % 5, weight.shape[0], 3)) | {top[i]}) for i in range(hidden.shape[0])]


@pytest.mark.parametrize("stored", [False, True], ids=["dense", "stored"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_folds_again_the_chunks_whose_rule_rows_overflow_the_batch(dtype, stored, monkeypatch):
    """With the mass margin widened to a quarter of the mass, every ``top_p`` row is left to the rule's code: the
    bounded batch (one row of a chunk) overflows, each chunk is folded again with those rows read (counted in
    ``MASS_BATCH_REDOS``), and values and gradients are the torch backend's, for the rule's sets and a replayed
    support alike. The next call of the same rule reads from the start (no chunk folded again); with a batch as large
    as the chunk, nothing is folded again either. ``stored``: every chunk's set is stored for the sparse backward (a
    folded chunk's first pool must give way to its second)."""
    from backward_path import set_sparse_max_density

    from safevocab.kernels import rule_rows

    if stored:
        set_sparse_max_density(monkeypatch, 1.0)
    redos = _every_top_p_row_to_the_rule(monkeypatch)
    hidden, weight, targets = make_inputs(dtype=dtype)
    weights = torch.linspace(-1, 1, len(targets), dtype=torch.float64)
    support = SafeSupport.from_lists(_support_lists(hidden, weight), device=DEVICE)

    def run(backend, replay=False):
        out = fused_safe_logprobs(hidden, weight, targets, "top_p=0.8", backend=backend, compute_entropy=True,
                                  max_chunk_bytes=8192, support=support if replay else None)  # fmt: skip
        loss = (out.logprobs.double() * weights).sum() + out.entropy.double().sum()
        return out, torch.autograd.grad(loss, (hidden, weight))

    ref, ref_grads = run("torch")
    replay_ref = run("torch", replay=True)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)

    def assert_matches(out, grads, expected=(ref, ref_grads)):
        assert torch.equal(out.in_safe, expected[0].in_safe) and torch.equal(out.safe_size, expected[0].safe_size)
        for field in ("logprobs", "entropy"):
            torch.testing.assert_close(getattr(out, field), getattr(expected[0], field), **tol)
        for a, b in zip(grads, expected[1]):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-5 if dtype == torch.float32 else 3e-2, rtol=1e-3)

    assert_matches(*run("triton"))
    folded_again = redos["chunks"]
    assert folded_again >= 2 and len(redos["read_from_now_on"]) == 1  # every chunk (24 rows, several chunks)
    assert_matches(*run("triton"))
    assert redos["chunks"] == folded_again  # read from the start
    redos["read_from_now_on"].clear()
    assert_matches(*run("triton", replay=True), expected=replay_ref)  # a replayed support: the same chunks again
    assert redos["chunks"] == 2 * folded_again
    redos["read_from_now_on"].clear()
    monkeypatch.setattr(rule_rows, "BATCH_DIVISOR", 1)  # the batch holds every row of a chunk
    assert_matches(*run("triton"))
    assert redos["chunks"] == 2 * folded_again


def test_a_replayed_row_that_keeps_nothing_is_refused_after_its_chunk_is_folded_again(monkeypatch):
    """Row 1's replayed support holds one token outside the rule's set; with every ``top_p`` row left to the rule's
    code, row 1 lies past its chunk's batch, whose estimate keeps every token: the op's check of an empty row must see
    the chunk folded again (found by an outside review: it returned ``safe_size[1] = 0`` instead of raising)."""
    redos = _every_top_p_row_to_the_rule(monkeypatch)
    hidden, weight, targets = make_inputs()
    z = (hidden.detach() @ weight.detach().t()).double()
    lists = _support_lists(hidden, weight)
    lists[1] = [int((z[1] < parse_rule("top_p=0.8").threshold(z[1:2])).nonzero()[0, 1])]
    support = SafeSupport.from_lists(lists, device=DEVICE)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="support row 1 keeps no token"):
            fused_safe_logprobs(hidden, weight, targets, "top_p=0.8", backend=backend, max_chunk_bytes=8192,
                                support=support)  # fmt: skip
    assert redos["chunks"] > 0


def test_chunk_rows_count_two_bytes_a_logit_for_selection_rules(monkeypatch):
    rule = parse_rule("top_k=50,top_p=0.9")
    budget, vocab = 64 << 20, 151936
    backend = triton_package.TritonBackend()
    rows = backend.rows_per_chunk(10**6, vocab, rule, 2, budget)
    assert rows == budget // (vocab * 2 + 4 * ts.KCAP + 32)
    monkeypatch.setattr(triton_route, "_KERNEL_SELECTION", False)  # the old path: fp32 copy + the rule's scratch
    assert backend.rows_per_chunk(10**6, vocab, rule, 2, budget) < rows // 3


def test_floor_is_finite_floor_for_rows_of_few_finite_logits():
    raw = torch.full((1, 300), -torch.inf, device=DEVICE)
    raw[0, 4] = 0.0
    t, m, fallback, _ = select(raw, parse_rule("top_k=5"), {})
    assert float(t) == min(finite_floor(torch.float32), 0.0) and float(m) == 0.0 and fallback.numel() == 0
