"""``safevocab.backends.triton.route``: the Triton backend's one decision per call, the route of a rule and an input
dtype (in-kernel threshold, selection kernel or torch threshold), and what follows from it.

Under Triton's interpreter on CPU (as tests/safevocab/test_kernels.py sets it up), compiled on CUDA; the decision
itself launches nothing.
"""

import math

import pytest
import torch

# test_kernels imports Triton under its interpreter on CPU (or skips the module when it cannot): the same set-up here
from test_kernels import DEVICE, kernel_env  # noqa: F401

import safevocab.backends.triton.route as triton_route
from safevocab import MinP, TopK, parse_rule
from safevocab.fused.chunking import ChunkJob
from safevocab.fused.transform import Transform
from safevocab.kernels import MODE_GIVEN, MODE_MIN_P, MODE_MIN_PROB, MODE_NONE
from safevocab.kernels.threshold_select import KCAP
from safevocab.rules import finite_floor


class SubclassedTopK(TopK):
    """A subclass may change the threshold: neither kernel takes it."""


@pytest.mark.parametrize(
    "rule, mode, log_param",
    [
        ("none", MODE_NONE, 0.0),
        ("min_p=0.05", MODE_MIN_P, math.log(0.05)),
        ("min_prob=0.01", MODE_MIN_PROB, math.log(0.01)),
    ],
)
@pytest.mark.parametrize("in_bytes", [2, 4, 8])
def test_in_kernel_rules_take_the_forward_kernels_threshold_for_every_dtype(rule, mode, log_param, in_bytes):
    route = triton_route.Route.of(parse_rule(rule), in_bytes)
    assert (route.kind, route.mode, route.log_param, route.plan) == (triton_route.IN_KERNEL, mode, log_param, None)
    assert route.transform_in_kernel


@pytest.mark.parametrize("rule", ["top_k=7", "top_p=0.8", "top_k=20,min_p=0.02", "top_p=0.9,min_prob=0.01"])
def test_top_k_top_p_and_compositions_take_the_selection_kernel_but_fp64_the_torch_threshold(rule):
    for in_bytes in (2, 4):
        route = triton_route.Route.of(parse_rule(rule), in_bytes)
        assert route.kind == triton_route.SELECTION and route.plan is not None and route.mode == MODE_GIVEN
        assert route.transform_in_kernel
    route = triton_route.Route.of(parse_rule(rule), 8)  # fp64 statistics: the rule's own torch code
    assert (route.kind, route.plan, route.transform_in_kernel) == (triton_route.TORCH, None, False)


def test_subclasses_and_the_switch_take_the_torch_threshold(monkeypatch):
    assert triton_route.Route.of(SubclassedTopK(5), 2).kind == triton_route.TORCH
    assert triton_route.Route.of(MinP(0.1) & SubclassedTopK(5), 2).kind == triton_route.TORCH
    monkeypatch.setattr(triton_route, "_KERNEL_SELECTION", False)
    assert triton_route.Route.of(parse_rule("top_k=7"), 2).kind == triton_route.TORCH
    assert (
        triton_route.Route.of(parse_rule("min_p=0.1"), 2).kind == triton_route.IN_KERNEL
    )  # the switch: selection only


def test_chunk_rows_count_each_routes_scratch():
    vocab, budget = 151936, 64 << 20
    assert triton_route.Route.of(parse_rule("none"), 2).chunk_rows(10**6, vocab, budget) == budget // (vocab * 2)
    selection = triton_route.Route.of(parse_rule("top_k=50"), 4).chunk_rows(10**6, vocab, budget)
    assert selection == budget // (vocab * 5 + 4 * KCAP + 32)  # fp32 chunk + keep-mask, candidates and row scalars
    rule = parse_rule("top_k=50")
    torch_rows = triton_route.Route.of(rule, 8).chunk_rows(10**6, vocab, budget)
    assert torch_rows == budget // (vocab * (8 + 1 + rule.scratch_bytes_per_logit))


@pytest.mark.parametrize(
    "rule, dtype", [("min_p=0.1", torch.bfloat16), ("top_k=3", torch.float32), ("top_k=3", torch.float64)]
)
def test_route_logits_are_the_gemm_output_or_the_torch_copy_and_fold_fills_every_row(rule, dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 5, generator=g).to(DEVICE, dtype)
    weight = torch.randn(11, 5, generator=g).to(DEVICE, dtype)
    targets = torch.randint(0, 11, (6,), generator=g).to(DEVICE)
    transform = Transform(temperature=0.7, softcap=None, logit_scale=1.0)
    job = ChunkJob(hidden, weight, None, targets, parse_rule(rule), transform, chunk_rows=4)
    route = triton_route.Route.of(job.rule, hidden.element_size())
    logits_of = route.chunk_logits(job)
    z, out = logits_of(hidden[:4])
    raw = hidden[:4] @ weight.t()
    if route.transform_in_kernel:  # the raw GEMM output, which the backward kernel overwrites with the gradient
        assert z.dtype == dtype and z is out and torch.equal(z, raw)
    else:  # the torch-transformed fp64 copy
        assert z.dtype == torch.float64 and torch.equal(z, raw / 0.7)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    rows = {name: torch.full((4,), math.nan, dtype=stat, device=DEVICE) for name in ("threshold", "row_max")}
    rows |= {
        name: torch.empty(4, dtype=stat, device=DEVICE) for name in ("target_shift", "log_sum_safe", "log_sum_full")
    }
    rows |= {"entropy": None, "in_safe": torch.empty(4, dtype=torch.bool, device=DEVICE)}
    rows["safe_size"] = torch.empty(4, dtype=torch.int64, device=DEVICE)
    route.fold(z, targets[:4].contiguous(), rows, transform)
    expected = parse_rule(rule).keep_mask(raw.to(stat) / 0.7).sum(-1)
    assert torch.equal(rows["safe_size"], expected.to(torch.int64))
    assert bool((rows["threshold"] >= finite_floor(stat)).all()) and not bool(rows["row_max"].isnan().any())
