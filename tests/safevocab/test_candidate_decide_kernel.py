"""The candidate phase as one kernel (``safevocab.kernels.candidate_decide``): its ``(threshold, fallback)`` equal the
torch statement, ``safevocab.kernels.candidate_thresholds.decide_thresholds``, bit for bit.

Under Triton's interpreter on CPU (as tests/safevocab/test_kernels.py sets it up), compiled on CUDA. Both functions get
the same candidate buffers, built here from logit rows and per-row floors (or written by hand: non-finite maxima and
totals, overflowing counts, columns past the count filled with NaN): random rows (hypothesis), adversarial rows (ties
at the k-th value and across the top_p crossing, crossings inside and outside ``MASS_MARGIN``, a candidate at the
min_prob value, floors above and below the threshold, complete rows), and every composition of the four kinds in every
engine's order. Thresholds are compared with ``torch.equal`` (NaN where both are NaN), the fallback flags exactly;
under the interpreter a ``min_prob`` value may differ from torch's CPU one by an ulp (the kernel's ``exp``/``log``
there are float64 ones rounded, torch's CPU ones SLEEF's: module docstring of ``candidate_decide``), so there those
rows are held to 2 ulps and the same kept candidates. Each case runs the kernel twice: sorting the candidates itself
(``tl.sort``, compiled default) and sorted by torch before it (the interpreter's default, which the kernel tests of
the other files run). The interpreter runs ``tl.sort`` element by element (~8 ms a row at 16 columns), hence small
``kcap`` and few rows in the fast tier.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# test_kernels imports Triton under its interpreter on CPU (or skips the module when it cannot) and brings every kernel
# module in through the Triton backend: the same set-up, and its fixture (autouse), for these tests
from test_kernels import DEVICE, ON_CUDA, kernel_env  # noqa: F401
from test_threshold_select_kernel import assert_same_thresholds, random_rows

import safevocab.kernels.threshold_select as ts
from safevocab import parse_rule
from safevocab.kernels import candidate_decide
from safevocab.kernels.candidate_decide import decide_thresholds_kernel
from safevocab.kernels.candidate_thresholds import MASS_MARGIN, decide_thresholds, selection_plan
from safevocab.rules import MinProb, TopK, finite_floor

FF = finite_floor(torch.float32)
ENGINES = ("hf", "vllm", "sglang")
#: One value per kind for the compositions (each part decides on some of the rows below).
PARTS = ("top_k=6", "top_p=0.8", "min_p=0.05", "min_prob=0.01")


def stages_of(spec: str, engine: str = "hf", vocab: int = 1 << 20):
    """``selection_plan(rule).active(vocab)``; a lone ``min_p``/``min_prob`` (no plan of its own) as the one stage of
    an intersection with a ``top_k`` that keeps everything."""
    plan = selection_plan(parse_rule(spec, engine=engine))
    if plan is None:
        plan = selection_plan(parse_rule(f"top_k={vocab},{spec}", engine=engine))
    return plan.active(vocab)


def phase_inputs(z: torch.Tensor, floor: torch.Tensor, kcap: int, total: torch.Tensor | None = None):
    """The candidate phase's inputs for the fp32 rows ``z`` ``[n, V]`` and floors ``c``: the first ``kcap`` of the
    ``z >= c`` in column order (NaN past them, and two NaN columns past ``kcap``: neither function may read them),
    the counts (past ``kcap``: overflow), ``m`` and (unless given) ``T = sum e`` in float64 of the fp32 ``e``."""
    z, floor = z.float(), floor.float()
    n = z.shape[0]
    m = z.amax(-1)
    if total is None:
        total = torch.where(z > -math.inf, (z - m.unsqueeze(-1)).exp(), 0.0).double().sum(-1)
    hit = z >= floor.unsqueeze(-1)
    cand = torch.full((n, kcap + 2), math.nan)
    for i in range(n):
        values = z[i][hit[i]][:kcap]
        cand[i, : values.numel()] = values
    args = (cand, hit.sum(-1).to(torch.int32), floor, m, total.double())
    return tuple(a.to(DEVICE) for a in args)


def assert_same_decision(stages, cand, count, floor, m, total, kcap, label=""):
    """The kernel's ``(threshold, fallback)`` are the torch phase's (module docstring for ``min_prob`` on CPU), with the
    candidates sorted in the kernel (``tl.sort``, the compiled default) and before it (the interpreter's default)."""
    label = f"{label} {stages}" if label else str(stages)
    t_ref, bad_ref = decide_thresholds(stages, cand, count, floor, m, total, kcap)
    for sort_in_kernel in (True, False):
        t, bad = decide_thresholds_kernel(stages, cand, count, floor, m, total, kcap, sort_in_kernel=sort_in_kernel)
        _assert_same(stages, cand, count, m, kcap, t, bad, t_ref, bad_ref, f"{label} (sort_in_kernel={sort_in_kernel})")


def _assert_same(stages, cand, count, m, kcap, t, bad, t_ref, bad_ref, label):
    assert t.dtype == t_ref.dtype == torch.float32 and bad.dtype == bad_ref.dtype == torch.bool
    assert torch.equal(bad, bad_ref), f"{label}: fallback {bad.tolist()} != {bad_ref.tolist()}"
    nan = t_ref.isnan()
    assert torch.equal(t.isnan(), nan), f"{label}: NaN thresholds {t.tolist()} != {t_ref.tolist()}"
    t, t_ref = t.masked_fill(nan, 0.0), t_ref.masked_fill(nan, 0.0)
    if ON_CUDA or not any(type(part) is MinProb for stage in stages for part in stage):
        assert torch.equal(t, t_ref), f"{label}: thresholds {t.tolist()} != {t_ref.tolist()}"
        return
    # min_prob under the interpreter: ``(m + log kept) + log tau`` within an ulp or two of each of its terms (the
    # fp32 sum rounds them), the same kept candidates
    log_tau = abs(math.log(stages[-1][-1].tau))
    m_abs = m.masked_fill(~torch.isfinite(m), 0.0).abs()
    near = (t == t_ref) | ((t - t_ref).abs() <= 2.0**-21 * (m_abs + t_ref.abs() + log_tau))
    assert bool(near.all()), f"{label}: {t.tolist()} != {t_ref.tolist()}"
    valid = torch.arange(kcap, device=cand.device) < count.clamp(max=kcap).unsqueeze(-1)
    vals = cand[:, :kcap]
    assert torch.equal((vals >= t.unsqueeze(-1)) & valid, (vals >= t_ref.unsqueeze(-1)) & valid), f"{label}: sets"


def random_inputs(n: int, vocab: int, kcap: int, seed: int, sd: float = 2.0):
    """Rows with ties (rounded logits) and ``-inf`` entries; each row's floor is one of its values (above or below
    the threshold, the counts under or over ``kcap``) or the finite floor (a complete row)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g) * sd
    z[::3] = z[::3].round(decimals=0)  # ties, at the k-th value and across the crossing among them
    z[1::4][torch.rand(z[1::4].shape, generator=g) < 0.3] = -math.inf
    z[:, 0] = z[:, 0].clamp_min(0.0)  # a finite maximum
    pick = torch.randint(0, vocab, (n, 1), generator=g)
    floor = z.sort(-1, descending=True).values.gather(-1, pick).squeeze(-1).clamp_min(FF)
    floor[torch.rand(n, generator=g) < 0.25] = FF
    return phase_inputs(z, floor, kcap)


# ------------------------------------------------------------------------------------------------- random rows


def _random_case(seed, vocab, kcap, sd, parts, engine, k, q, rho, tau, n):
    values = {"top_k": f"top_k={k}", "top_p": f"top_p={q}", "min_p": f"min_p={rho}", "min_prob": f"min_prob={tau}"}
    stages = stages_of(",".join(values[key] for key in parts), engine, vocab)
    assert_same_decision(stages, *random_inputs(n, vocab, kcap, seed, sd), kcap)


_RANDOM = dict(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 60),
    kcap=st.integers(1, 32),
    sd=st.sampled_from([0.3, 2.0, 8.0]),
    parts=st.lists(st.sampled_from(["top_k", "top_p", "min_p", "min_prob"]), min_size=1, max_size=4, unique=True),
    engine=st.sampled_from(ENGINES),
    k=st.integers(1, 70),  # k >= V: dropped by SelectionPlan.active; k > kcap: -inf past the candidates
    q=st.sampled_from([1e-4, 0.3, 0.9, 0.999]),
    rho=st.sampled_from([1e-3, 0.1, 0.7]),
    tau=st.sampled_from([1e-4, 0.01, 0.2]),
)


@settings(max_examples=6, deadline=None)
@given(**_RANDOM)
def test_random_rows(seed, vocab, kcap, sd, parts, engine, k, q, rho, tau):
    _random_case(seed, vocab, kcap, sd, parts, engine, k, q, rho, tau, n=4)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(**{**_RANDOM, "kcap": st.integers(1, 96), "vocab": st.integers(2, 200)})
def test_random_rows_slow(seed, vocab, kcap, sd, parts, engine, k, q, rho, tau):
    _random_case(seed, vocab, kcap, sd, parts, engine, k, q, rho, tau, n=8)


# -------------------------------------------------------------------------------------------- adversarial rows


def _pad(prefix, vocab=24, low=-6.0):
    """A row of ``vocab`` logits: ``prefix`` then distinct values from ``low`` down."""
    return list(prefix) + [low - 0.25 * i for i in range(vocab - len(prefix))]


def generic_rows():
    """``(z, floor, total or None)``: rows that any rule meets (fp32 values; ``vocab = 24``)."""
    return [
        (_pad([3.0, 2.0, 2.0, 2.0, 2.0, 1.0]), FF, None),  # ties at the k-th value (k = 2..5), complete
        (_pad([3.0, 2.0, 2.0, 2.0, 2.0, 1.0]), 2.0, None),  # the floor at the tie
        (_pad([3.0, 2.0, 2.0, 2.0, 2.0, 1.0]), 2.5, None),  # the floor above the k-th: unknown, fallback
        (_pad([0.0] * 4 + [-3.0] * 4), -3.5, None),  # ties across a top_p crossing (4 of e = 1, then e = 0.05)
        (_pad([0.0] * 6, low=-1.0), FF, None),  # six tied maxima, a flat tail: overflows kcap when complete
        (_pad([1.0, 0.5, 0.25]), -9.0, None),  # a floor far below the threshold: 16 candidates
        (_pad([1.0, 0.5, 0.25]), 0.25, None),  # three candidates, mass incomplete
        (_pad([0.0, -0.0, 0.0, -1.0]), -1.0, None),  # signed zeros
        ([2.0, 1.0, 0.5] + [-math.inf] * 21, FF, None),  # three finite logits: complete, the rest never kept
        (_pad([1.0, 0.0]), 0.0, torch.tensor(math.inf)),  # T = inf
        (_pad([1.0, 0.0]), 0.0, torch.tensor(math.nan)),  # T = NaN
        (_pad([1.0, 0.0]), 0.0, torch.tensor(0.0)),  # T = 0: the first candidate reaches q T
        (_pad([1.0, 0.0]), 0.0, torch.tensor(1e-30)),  # T far below the candidates' mass
    ]


def nonfinite_inputs(kcap):
    """Hand-written buffers: ``m = -inf`` (no finite logit: no candidate, ``T = 0``), ``m = NaN``, ``m = +inf``,
    ``count = 0`` with a finite ``m``, a count far past ``kcap``, and ``m`` and the floor below candidates (no
    buffer of the select kernel's: the one row where a stage's cap at ``m`` shows, in the next stage's flags)."""
    n = 6
    cand = torch.full((n, kcap + 2), math.nan)
    cand[1:, :3] = torch.tensor([1.0, 0.5, 0.0])
    cand[4, :kcap] = torch.linspace(1.0, -1.0, kcap)  # an overflow: the buffer full
    cand[5, :5] = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.25])
    count = torch.tensor([0, 3, 3, 0, 10**6, 5], dtype=torch.int32)
    floor = torch.tensor([FF, FF, 0.0, 0.0, -1.0, -0.4])
    m = torch.tensor([-math.inf, math.nan, math.inf, 1.0, 1.0, -0.5])
    total = torch.tensor([0.0, math.nan, math.nan, 1.0, 5.0, 30.0], dtype=torch.float64)
    return tuple(a.to(DEVICE) for a in (cand, count, floor, m, total))


def margin_rows(stages):
    """Rows whose top_p crossing lies inside ``MASS_MARGIN`` of ``q T_prev`` (relative ``-+5e-7``: the fallback) or
    just outside (``-+8e-6``: decided), for a first-stage top_p (``T`` given: mass below the floor) or a top_p after a
    ``top_k=4`` (``T_prev`` the four kept masses: the fourth logit solved for it). ``[]`` for other stages."""
    kinds = [tuple(type(p).__name__ for p in stage) for stage in stages]
    q = next((p.q for stage in stages for p in stage if type(p).__name__ == "TopP"), None)
    rows, expect = [], []
    for delta in (5e-7, -5e-7, 8e-6, -8e-6):
        if "TopP" in kinds[0]:
            z = torch.tensor(_pad([0.0, -0.1, -0.2, -2.0, -2.2]))
            e = (z[:3] - z[0]).exp().double()
            # q T = R_2 (1 - delta): R_2 reaches q T (delta > 0) or just misses it (delta < 0); T above the
            # candidates' mass (q <= 0.8: mass below the floor)
            total = e.sum() * (1 - delta) / q
            rows.append((z.tolist(), -2.5, total))
        elif len(kinds) > 1 and kinds[0] == ("TopK",) and "TopP" in kinds[1] and stages[0][0].k == 4:
            # q = 0.8: the fourth mass, R_2 / 4, below the third
            prefix = torch.tensor([0.0, -0.1, -0.2])
            running = (prefix - prefix[0]).exp().double().sum()
            z3 = math.log(running * (1 - delta) / q - running)  # T_prev = R_2 + e_3 with q T_prev = R_2 (1 - delta)
            rows.append((_pad([0.0, -0.1, -0.2, z3]), -2.0, None))
        else:
            return [], []
        expect.append(abs(delta) < MASS_MARGIN)
    return rows, expect


def min_prob_near_row(stages):
    """``(z, floor, total)``: a candidate at ``min_prob``'s value over the kept set (``top_k=5``, or everything,
    ``T`` given), or ``None`` for other stages. The torch phase sends it to the fallback."""
    kinds = [tuple(type(p).__name__ for p in stage) for stage in stages]
    if kinds not in ([("TopK",), ("MinProb",)], [("MinProb",)]):
        return None
    tau = stages[-1][0].tau
    z = torch.tensor(_pad([0.0, -0.2, -0.4, -0.6, -0.8], vocab=24, low=-20.0))
    kept = z[:5] if len(kinds) == 2 else z
    mass = (kept - z[0]).exp().double().sum()
    z[6] = (z[0] + mass.float().log()) + math.log(tau)  # in fp32, as the rule; the sixth largest
    return z.tolist(), FF, mass if len(kinds) == 1 else None


def adversarial_inputs(stages, kcap):
    rows = generic_rows()
    margin, expect = margin_rows(stages)
    near = min_prob_near_row(stages)
    rows += margin + ([near] if near else [])
    z = torch.tensor([r[0] for r in rows])
    floor = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    args = phase_inputs(z, floor, kcap)
    total = args[4].clone()
    for i, (_, _, given_total) in enumerate(rows):
        if given_total is not None:
            total[i] = torch.as_tensor(given_total, dtype=torch.float64)
    return (*args[:4], total), len(generic_rows()), expect, near is not None


ADVERSARIAL = [
    ("top_k=3", "hf"),  # ties at the k-th value
    ("top_k=14", "hf"),  # kcap < k <= the block
    ("top_k=20", "hf"),  # k past the block
    ("top_p=0.5", "hf"),  # ties across the crossing, the margin on T
    ("top_k=4,top_p=0.8", "hf"),  # the margin on the kept mass
    ("top_k=4,top_p=0.8", "sglang"),  # one joint stage: the margin on T
    ("top_k=5,min_prob=0.05", "hf"),  # a candidate at min_prob's value
    (f"top_k={1 << 20},min_prob=0.05", "hf"),  # min_prob first: kept = T
    ("top_k=3,top_p=0.5,min_p=0.3,min_prob=0.02", "vllm"),
]


@pytest.mark.parametrize("kcap", [12, pytest.param(16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("spec,engine", ADVERSARIAL, ids=[f"{s}-{e}" for s, e in ADVERSARIAL])
def test_adversarial_rows(spec, engine, kcap):
    """kcap 12 (a 16-column block, masked past 12) and 16 (the block exact); vocab 24."""
    stages = stages_of(spec, engine, 24)
    args, n_generic, expect, near = adversarial_inputs(stages, kcap)
    assert_same_decision(stages, *args, kcap)
    assert_same_decision(stages, *nonfinite_inputs(kcap), kcap)
    # the constructed rows are what they claim: the torch phase sends the in-margin crossings and the near
    # min_prob candidate to the fallback, and decides the others
    _, bad = decide_thresholds(stages, *args, kcap)
    assert bad[n_generic : n_generic + len(expect)].tolist() == expect
    if near:
        assert bool(bad[-1])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_adversarial_rows_in_every_composition(engine):
    for r in range(1, 5):
        for parts in itertools.combinations(("top_k=3", "top_p=0.5", "min_p=0.3", "min_prob=0.02"), r):
            stages = stages_of(",".join(parts), engine, 24)
            args, *_ = adversarial_inputs(stages, 12)
            assert_same_decision(stages, *args, 12)


# --------------------------------------------------------------------------------------------- compositions


def every_composition():
    """Every non-empty set of the four kinds in every engine's order, once per distinct stage structure (the kernel
    is specialised on it; the same stages decide the same)."""
    seen = set()
    for r in range(1, 5):
        for parts in itertools.combinations(PARTS, r):
            for engine in ENGINES:
                stages = stages_of(",".join(parts), engine, 40)
                key = tuple(tuple(p.key for p in stage) for stage in stages)
                if key not in seen:
                    seen.add(key)
                    yield ",".join(parts), engine, stages


COMPOSITIONS = list(every_composition())


def test_every_stage_structure_is_covered():
    assert len(COMPOSITIONS) == 23  # 21 compositions and a lone min_p / min_prob stage


@pytest.mark.parametrize(
    "kcap,n", [(12, 4), pytest.param(24, 16, marks=pytest.mark.slow), pytest.param(64, 12, marks=pytest.mark.slow)]
)
def test_every_composition_in_every_engine_order(kcap, n):
    for index, (spec, engine, stages) in enumerate(COMPOSITIONS):
        assert_same_decision(stages, *random_inputs(n, 40, kcap, seed=index, sd=1.5), kcap, f"{spec} ({engine})")


# ------------------------------------------------------------------------------------------- wiring, inputs


def test_select_thresholds_decides_with_the_kernel(monkeypatch):
    """``select_thresholds`` takes the kernel, on the select kernel's own buffers its decision is the torch phase's,
    and the thresholds are still the rule's (the other end-to-end checks: test_threshold_select_kernel.py)."""
    calls = []

    def checked(stages, cand, count, floor, m, total, kcap):
        calls.append(kcap)
        assert_same_decision(stages, cand, count, floor, m, total, kcap)
        return decide_thresholds_kernel(stages, cand, count, floor, m, total, kcap)

    monkeypatch.setattr(ts, "decide_thresholds_kernel", checked)
    raw = random_rows(n=3, v=64, seed=4, dtype=torch.bfloat16)
    assert_same_thresholds(raw, parse_rule("top_k=5,top_p=0.8", engine="vllm"), {}, kcap=16)
    assert calls == [16]


def test_bad_inputs_are_refused_in_one_line():
    args = random_inputs(2, 8, 4, seed=0)
    stages = stages_of("top_k=3")
    with pytest.raises(ValueError, match="kcap=0"):
        decide_thresholds_kernel(stages, *args, 0)
    with pytest.raises(ValueError, match="^cand: "):
        decide_thresholds_kernel(stages, *args, 7)  # wider than the buffer
    with pytest.raises(ValueError, match="^cand: "):
        decide_thresholds_kernel(stages, args[0].double(), *args[1:], 4)
    with pytest.raises(ValueError, match="^count: "):
        decide_thresholds_kernel(stages, args[0], args[1].long(), *args[2:], 4)
    with pytest.raises(ValueError, match="^total: "):
        decide_thresholds_kernel(stages, *args[:4], args[4].float(), 4)
    with pytest.raises(ValueError, match="^stages: "):
        decide_thresholds_kernel(((TopK(2),), (TopK(3),)), *args, 4)
    with pytest.raises(ValueError, match="^stages: "):
        decide_thresholds_kernel(((),), *args, 4)
    empty = random_inputs(0, 8, 4, seed=0)
    t, bad = decide_thresholds_kernel(stages, *empty, 4)
    assert t.shape == bad.shape == (0,) and bad.dtype == torch.bool
    assert candidate_decide.INTERPRETED != ON_CUDA
