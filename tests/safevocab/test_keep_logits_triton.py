"""``keep_logits_bytes`` on the Triton backend: kept chunks' buffers folded by the backward kernels instead of a
recomputation, on every route (the raw GEMM output of the in-kernel and selection routes, the fp32 transformed copy of
the torch-threshold route), for the dense backward, the full-softmax part of stored chunks and the dense choice of the
sparse gate; bit for bit the ``keep_logits_bytes=0`` call's, with no new host read.

Under Triton's interpreter on CPU (as tests/safevocab/test_kernels.py sets it up), compiled on CUDA. The helpers are
``test_keep_logits.py``'s (the torch backend's tests).
"""

import pytest
import torch
from backward_path import set_sparse_max_density
from test_keep_logits import (  # the torch backend's tests' helpers: they import no Triton
    GemmSpy,
    V,
    assert_same_bits,
    check_second_backward,
    chunk_bytes,
    chunk_sizes,
    first_chunk_cap,
    make_inputs,
    mixed_loss,
    n_chunks,
    rl_loss,
    run,
)

# test_kernels imports Triton under its interpreter on CPU (or skips the module when it cannot): the same set-up here
from test_kernels import DEVICE, ON_CUDA, kernel_env  # noqa: F401

import safevocab.backends.triton.route as triton_route
from safevocab import fused_safe_logprobs, parse_rule
from safevocab.backends.triton import sparse_gate
from safevocab.testing.host_syncs import HostSyncs


@pytest.fixture
def spy(monkeypatch):
    return GemmSpy(monkeypatch, more=((triton_route.ChunkGemm, "__call__"),))


#: (rule, dtype, route): the in-kernel threshold, the selection kernel, and the torch threshold (the selection switched
#: off: a bf16 GEMM output, its fp32 transformed copy kept, a reused bf16 destination for the gradient).
ROUTES = [
    ("min_p=0.05", torch.float32, triton_route.IN_KERNEL),
    ("min_p=0.05", torch.float16, triton_route.IN_KERNEL),
    ("top_k=5", torch.bfloat16, triton_route.SELECTION),
    ("top_k=5", torch.bfloat16, triton_route.TORCH),
]


@pytest.mark.parametrize("rule, dtype, route", ROUTES)
def test_triton_kept_chunks_give_the_same_bits_with_one_gemm_fewer(rule, dtype, route, spy, monkeypatch):
    """Dense chunks, each route: every chunk kept, only the first (forward order: the cap's rest would hold the smaller
    last chunk) or none; the same bits, and the backward recomputes exactly the chunks not kept. The cap counts the
    kept buffer's real bytes: the inputs' dtype on the raw routes, fp32 on the torch route."""
    set_sparse_max_density(monkeypatch, 0.0)
    monkeypatch.setattr(triton_route, "_KERNEL_SELECTION", route != triton_route.TORCH)
    assert triton_route.Route.of(parse_rule(rule), dtype.itemsize).kind == route
    params, targets = make_inputs(dtype, DEVICE)
    sizes = chunk_sizes("triton", rule, dtype)
    itemsize = dtype.itemsize if route != triton_route.TORCH else 4
    ref = run(spy, params, targets, rule, 0, backend="triton", temperature=0.7, softcap=3.0)
    assert spy.calls == {"forward": len(sizes), "backward": len(sizes)}
    for cap, kept in ((10**9, len(sizes)), (first_chunk_cap(sizes, itemsize), 1)):
        got = run(spy, params, targets, rule, cap, backend="triton", temperature=0.7, softcap=3.0)
        assert_same_bits(got, ref)
        assert spy.calls == {"forward": len(sizes), "backward": len(sizes) - kept}, cap
        assert got[2].reserved == sum(sizes[:kept]) * V * itemsize and len(got[2]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_stored_chunks_fold_their_kept_logits(dtype, spy, monkeypatch):
    """Stored chunks (every one sparse): the full-softmax part of rows whose gradient leaves S (out-of-set targets,
    ``log_kept_mass``) folds the kept logits; the sparse gate's dense choice (the RL loss, forced) too. No GEMM in
    either backward, the same bits as recomputing."""
    set_sparse_max_density(monkeypatch, 1.0)
    monkeypatch.setattr(sparse_gate, "FORCE", sparse_gate.PER_ID)
    params, targets = make_inputs(dtype, DEVICE)
    chunks = n_chunks("triton", "top_k=5", dtype)
    ref = run(spy, params, targets, "top_k=5", 0, backend="triton")
    assert not bool(ref[0].in_safe.all()) and spy.calls["backward"] == chunks
    assert_same_bits(got := run(spy, params, targets, "top_k=5", 10**9, backend="triton"), ref)
    assert spy.calls["backward"] == 0 and len(got[2]) == 0
    monkeypatch.setattr(sparse_gate, "FORCE", sparse_gate.DENSE)
    ref = run(spy, params, targets, "top_k=5", 0, backend="triton", loss=rl_loss)
    assert spy.calls["backward"] == chunks
    assert_same_bits(run(spy, params, targets, "top_k=5", 10**9, backend="triton", loss=rl_loss), ref)
    assert spy.calls["backward"] == 0


def test_triton_second_backward_recomputes_and_gives_the_same_gradients(spy, monkeypatch):
    set_sparse_max_density(monkeypatch, 0.0)
    check_second_backward(spy, make_inputs(torch.bfloat16, DEVICE), "min_p=0.05", "triton")


@pytest.mark.parametrize("rule", ["min_p=0.05", "top_k=5"])
def test_kept_logits_add_no_host_read(rule, monkeypatch):
    """The cap's bookkeeping is shapes only: the forward reads the device as often as without it (the call's one read;
    the selection route's one a chunk), and the backward no more (tests/safevocab/test_host_syncs.py)."""
    set_sparse_max_density(monkeypatch, 0.0)
    (hidden, weight, bias), targets = make_inputs(torch.float32, DEVICE)
    budget = chunk_bytes("triton", rule, torch.float32, 8)
    mode = "warn" if ON_CUDA else None
    counts = []
    for cap in (0, 10**9):
        with HostSyncs(cuda_mode=mode) as forward:
            out = fused_safe_logprobs(hidden, weight, targets, rule, bias=bias, compute_entropy=True, backend="triton",
                                      max_chunk_bytes=budget, keep_logits_bytes=cap)  # fmt: skip
        loss = mixed_loss(out)
        with HostSyncs(cuda_mode=mode) as backward:
            loss.backward()
        counts.append((forward.count, backward.count))
    assert counts[1] == counts[0], counts
