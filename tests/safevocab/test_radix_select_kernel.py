"""The radix select (``safevocab.kernels.radix_select``): rows whose kept set is wider than the candidate buffer (flat
logits) are decided in the kernel, with the rule's own thresholds, and no longer take the torch fallback.

Under Triton's interpreter on CPU (as tests/safevocab/test_kernels.py sets it up), compiled on CUDA. ``kcap`` is
lowered (512-1024 candidates for 4096-8192 columns) so that flat rows overflow cheaply. Every selection is checked
twice: thresholds equal to ``rule.threshold_and_max`` on the kernel-transformed logits (as
test_threshold_select_kernel.py does), and kept sets equal to a float64 full-sort reference written here from the
definitions (in each engine's order) on the rows it does not call ambiguous.
"""

import math

import pytest
import torch

# the interpreter set-up and its fixture (autouse), and the selection helpers of the candidate-buffer tests
from test_kernels import DEVICE, kernel_env  # noqa: F401
from test_nucleus import reference_keep
from test_threshold_select_kernel import random_rows, reference, select

import safevocab.kernels.threshold_select as ts
from safevocab import fused_safe_logprobs, parse_rule
from safevocab.kernels.radix_select import radix_thresholds
from safevocab.rules import TopK, TopP

#: The engines' stages (safevocab/engine_order.py's table, restated).
STAGES = {
    "hf": (("top_k",), ("top_p",), ("min_p",), ("min_prob",)),
    "vllm": (("min_p",), ("top_k",), ("top_p",), ("min_prob",)),
    "sglang": (("top_k", "top_p"), ("min_prob",)),
}
#: Relative width (of the kept mass, or of a logit) inside which the float64 reference calls a row ambiguous.
TOL = 2e-6


def float64_keep(z: torch.Tensor, spec: str, engine: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [R, V], ambiguous [R]) of ``spec`` on the fp32 logits ``z``, in float64, stage by stage: each part on the
    distribution renormalised over what the stages before kept, the argmax (and its ties) always kept."""
    parts = {key: float(value) for key, _, value in (item.partition("=") for item in spec.split(","))}
    stages = STAGES["hf"] if engine == "sglang" and "min_p" in parts else STAGES[engine]
    zd = z.double()
    keep = zd > -math.inf
    top = zd.amax(-1, keepdim=True)
    ambiguous = torch.zeros(z.shape[0], dtype=torch.bool)
    for stage in stages:
        new = keep.clone()
        masked = zd.masked_fill(~keep, -math.inf)
        for key in (key for key in stage if key in parts):
            value = parts[key]
            if key == "top_k":
                k = int(value)
                if k < z.shape[-1]:
                    new &= zd >= masked.topk(k, -1).values[:, -1:]  # ties kept; fewer than k kept: -inf
            elif key == "top_p":
                kept_p, near = reference_keep(z, value, keep, tol=TOL)
                new &= kept_p
                ambiguous |= near
            else:
                if key == "min_p":
                    t = top + math.log(value)
                else:  # min_prob: p >= tau over the kept tokens
                    t = torch.logsumexp(masked, -1, keepdim=True) + math.log(value)
                new &= zd >= t
                ambiguous |= (keep & ((zd - t).abs() <= TOL * (1 + t.abs()))).any(-1)
        keep = new | (keep & (zd == top))
    return keep, ambiguous


def check(raw, spec, engine="hf", transform=None, kcap=512, exact=True, **kw):
    """The rule's thresholds (bit for bit; ``exact=False``: its sets, and thresholds to 1e-6), and the float64
    reference's sets on its unambiguous rows; returns the fallback rows and the kept counts."""
    transform = transform or {}
    rule = parse_rule(spec, engine=engine)
    z, t_ref, m_ref = reference(raw, rule, transform)
    t, m, fallback, _ = select(raw, rule, transform, kcap=kcap, **kw)
    assert torch.equal(m, m_ref)
    got = z >= t.unsqueeze(-1)
    assert torch.equal(got, z >= t_ref.unsqueeze(-1)), f"{spec} ({engine}): sets differ from the rule's"
    if exact:
        assert torch.equal(t, t_ref), f"{spec} ({engine}): thresholds {t} != {t_ref}"
    else:
        torch.testing.assert_close(t, t_ref, rtol=1e-6, atol=0)
    keep, ambiguous = float64_keep(z.cpu(), spec, engine)
    got = got.cpu()
    assert torch.equal(got[~ambiguous], keep[~ambiguous]), f"{spec} ({engine}): sets differ from the reference"
    return set(fallback.tolist()), got.sum(-1)


HALF_FP32 = (torch.float16, torch.float32)


# fp16/fp32 in the slow tier: the bf16 case and test_fused_op_on_flat_rows_matches_the_torch_backend guard the same path
@pytest.mark.parametrize("dtype", [torch.bfloat16, *(pytest.param(d, marks=pytest.mark.slow) for d in HALF_FP32)])
def test_flat_top_p_rows_are_decided_in_the_kernel(dtype):
    """``top_p=0.9`` over 8192 flat logits keeps ~6900 tokens, far past the buffer: every row took the torch
    fallback; the radix select decides them all, exactly."""
    raw = random_rows(n=3, v=8192, seed=4, sd=0.3, dtype=dtype)
    fallback, kept = check(raw, "top_p=0.9", kcap=1024)
    assert bool((kept > 1024).all()), kept
    assert fallback == set(), f"flat rows took the fallback: {fallback}"
    fallback, _ = check(raw, "top_p=0.9", kcap=1024, radix=False)
    assert fallback == {0, 1, 2}


@pytest.mark.parametrize("transform", [{"temperature": 0.7}, {"softcap": 2.5, "scale": 1.7, "temperature": 1.3}])
def test_transforms_on_flat_rows(transform):
    raw = random_rows(n=2, v=4096, seed=5, sd=0.4, dtype=torch.bfloat16)
    for spec in ("top_p=0.9", "top_k=1500"):
        fallback, kept = check(raw, spec, transform=transform, refine_passes=0)
        assert fallback == set() and bool((kept > 512).all()), (spec, fallback, kept)


COMPOSITIONS = [
    "top_k=50,top_p=0.9",
    "top_k=2000,top_p=0.9",
    "min_p=0.01,top_p=0.9",
    "min_p=0.3,top_p=0.9",
    "top_k=2000,top_p=0.95,min_p=0.3",
    "top_p=0.95,min_prob=0.0002",
]


# hf and sglang in the slow tier: the vllm case, test_the_engine_order_changes_the_flat_rows_set and
# test_threshold_select_kernel.py's compositions in every engine order guard the same stages
@pytest.mark.parametrize(
    "engine", [pytest.param("hf", marks=pytest.mark.slow), "vllm", pytest.param("sglang", marks=pytest.mark.slow)]
)
def test_compositions_in_every_engine_order(engine):
    """Overflowing stages anywhere in the order: ``top_k`` by count, ``top_p`` on the mass kept by the stages before
    it (vLLM's ``min_p`` first, HF's after), SGLang's joint stage, ``min_prob`` last."""
    raw = random_rows(n=2, v=4096, seed=6, sd=0.3, dtype=torch.bfloat16)
    for spec in COMPOSITIONS:
        fallback, kept = check(raw, spec, engine, exact="min_prob" not in spec, refine_passes=0)
        assert fallback == set(), f"{spec} ({engine}): fallback {fallback}"
        if spec == "min_p=0.3,top_p=0.9":
            assert bool((kept > 512).all()), kept  # past the buffer in every order


def test_the_engine_order_changes_the_flat_rows_set():
    """The order matters on these rows (so the test above tells the orders apart): vLLM's ``top_p`` sees the
    ``min_p``-renormalised distribution and keeps fewer."""
    raw = random_rows(n=2, v=4096, seed=6, sd=0.3, dtype=torch.bfloat16)
    _, kept_hf = check(raw, "min_p=0.3,top_p=0.9", "hf", refine_passes=0)
    _, kept_vllm = check(raw, "min_p=0.3,top_p=0.9", "vllm", refine_passes=0)
    assert bool((kept_vllm < kept_hf).all()), (kept_hf, kept_vllm)


def test_ties_wider_than_the_buffer():
    """Logits on a coarse grid (tie groups of hundreds): the k-th value and the top_p crossing fall inside a tie
    group wider than the buffer, which is kept whole; a row with ``-inf`` entries and fewer finite logits than k;
    all-equal rows (one tie: ``q`` near 0 keeps it whole too, nothing lies above it), one of ``-0`` and ``+0``."""
    g = torch.Generator().manual_seed(7)
    grid = (torch.randn(2, 4096, generator=g) * 2.4).round() / 8  # 0.3 sd, steps of 1/8
    sparse = torch.randn(1, 4096, generator=g) * 0.3
    sparse[:, 1024:] = -torch.inf  # 1024 finite logits
    signed_zeros = torch.zeros(1, 4096)
    signed_zeros[:, ::2] = -0.0
    raw = torch.cat([grid, sparse, torch.zeros(1, 4096), signed_zeros]).to(DEVICE)
    for spec in ("top_p=1e-6", "top_p=0.5", "top_p=0.9", "top_k=1000", "top_k=2000,top_p=0.9"):
        fallback, kept = check(raw, spec, kcap=256, refine_passes=0)
        assert fallback == set() and kept[3:].tolist() == [4096, 4096], f"{spec}: fallback {fallback}, kept {kept}"
        if spec == "top_p=1e-6":
            continue
        z = ts.transformed_rows(raw[:2], torch.arange(2, device=DEVICE))
        t, *_ = select(raw[:2], parse_rule(spec), {}, kcap=256)
        assert bool((z == t.unsqueeze(-1)).sum(-1).gt(256).all()), f"{spec}: a tie group wider than the buffer"
    fallback, kept = check(raw, "top_k=3000", kcap=256, refine_passes=0)
    assert fallback == set() and int(kept[2]) == 1024  # fewer finite logits than k: all kept, no -inf


def test_a_crossing_within_the_margin_still_takes_the_fallback():
    """Half the row at 0, half at -1: ``q`` putting ``q T`` on the top group's mass (to rounding) is ambiguous, and
    the row goes to the rule's code; ``q = 0.5`` is not, and keeps the whole top group."""
    raw = torch.zeros(1, 4096, device=DEVICE)
    raw[:, 2048:] = -1.0
    q = 2048.0 / float(torch.exp(raw.cpu()).double().sum())  # q T = 2048, the top group's mass, to rounding
    fallback, kept = check(raw, f"top_p={q!r}", kcap=256, refine_passes=0)
    assert fallback == {0}, "a crossing within MASS_MARGIN of q T is left to the rule"
    fallback, kept = check(raw, "top_p=0.5", kcap=256, refine_passes=0)
    assert fallback == set() and int(kept[0]) == 2048


def test_radix_thresholds_checks_its_arguments():
    z = torch.zeros(2, 8, device=DEVICE)
    one = torch.ones(2, dtype=torch.int8, device=DEVICE)
    out = torch.empty(2, device=DEVICE)
    with pytest.raises(ValueError, match="stages"):
        radix_thresholds(z, ((TopP(0.5),), (TopP(0.9),)), one, out, out, one.clone())
    with pytest.raises(ValueError, match="stride"):
        radix_thresholds(z.t(), ((TopK(2),),), one, out, out, one.clone())


def test_fused_op_on_flat_rows_matches_the_torch_backend(monkeypatch):
    """The whole op on flat logits past a small buffer: forward and backward as the torch backend's."""
    monkeypatch.setattr(ts, "KCAP", 64)
    decided = []
    original = ts.radix_thresholds
    monkeypatch.setattr(ts, "radix_thresholds", lambda z, stages, active, *a, **k: decided.append(int(active.sum()))
                        or original(z, stages, active, *a, **k))  # fmt: skip
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(6, 8, generator=g).to(DEVICE).requires_grad_()
    weight = (torch.randn(600, 8, generator=g) * 0.1).to(DEVICE).requires_grad_()
    targets = torch.randint(0, 600, (6,), generator=g).to(DEVICE)
    outs, grads = [], []
    for backend in ("triton", "torch"):
        rule = parse_rule("min_p=0.01,top_p=0.9", engine="vllm")
        out = fused_safe_logprobs(hidden, weight, targets, rule, backend=backend)
        outs.append(out)
        grads.append(torch.autograd.grad(out.logprobs.sum(), (hidden, weight)))
    tri, ref = outs
    assert torch.equal(tri.in_safe, ref.in_safe) and torch.equal(tri.safe_size, ref.safe_size)
    assert bool((ref.safe_size > 64).all()) and sum(decided) >= 6, (ref.safe_size, decided)
    torch.testing.assert_close(tri.logprobs, ref.logprobs, atol=2e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-3)
