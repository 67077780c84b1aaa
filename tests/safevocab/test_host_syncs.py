"""Host synchronisations of the fused op on the Triton route (issue 56, point 2), counted by
:class:`safevocab.testing.host_syncs.HostSyncs`.

The forward reads the device once per call (:class:`safevocab.fused.row_stats.CallReads`: the input checks, the
non-finite flags and which chunks are stored; the selection route's mass fallback rows in a bounded batch, with no read
of their own; a replayed support's ids checked and its chunks' entries found from what it read when it was built).
Each budget below is today's figure: a new synchronisation in the forward fails its test. The backward's count is
asserted apart (the sparse backward is being rewritten). Under Triton's interpreter on CPU (as
tests/safevocab/test_kernels.py sets it up); on CUDA the same tests also run under ``torch.cuda.set_sync_debug_mode``
(``"error"`` where the budget is 0, else ``"warn"``, whose reports must stay within the budget).
"""

import pytest
import torch
from backward_path import set_sparse_max_density

# test_kernels imports Triton under its interpreter on CPU (or skips the module when it cannot): the same set-up here
from test_kernels import DEVICE, ON_CUDA, kernel_env  # noqa: F401

import safevocab.kernels.threshold_select as ts
from safevocab import SafeSupport, fused_safe_logprobs, validation
from safevocab.testing.host_syncs import HostSyncs

N, V, H = 12, 48, 8
#: Rows per chunk 4 (``max_chunk_bytes`` over ``V`` times the route's bytes a logit): three chunks a call.
CHUNK_BYTES = {"in-kernel": 4 * V * 5, "selection": 4 * (V * 5 + 4 * V + 32)}
CHUNKS = 3
#: Forward: the call's one read. The selection route's rows within ``MASS_MARGIN`` of a mass boundary (``top_p``,
#: ``min_prob``) are decided in a bounded batch with no read (one read a chunk before); a replayed support checks its
#: ids against ``V`` and finds where each chunk's entries start from its host copies (two reads more before).
FORWARD_BUDGET = {
    "none": 1,
    "min_p=0.05": 1,
    "min_prob=0.01": 1,
    "top_k=7": 1,
    "top_p=0.8": 1,
    "replay": 1,
    "replay,top_p=0.8": 1,
}
#: Backward (stored chunks, every one sparse): one read, the rows whose gradient leaves ``S`` per forward chunk
#: (``safevocab.fused.chunking.rows_per_chunk``) with the sparse gate's values (every chunk's ``|U|``, queued by the
#: backend's ``queue_sparse_reads``) in ``Coefficients.reads``; 5 before.
BACKWARD_BUDGET = 1


def _cuda_mode(budget: int) -> str | None:
    return ("error" if budget == 0 else "warn") if ON_CUDA else None


def _assert_within(syncs: HostSyncs, budget: int, what: str) -> None:
    assert syncs.count == budget, f"{what}: {syncs.count} host syncs, budget {budget}:\n{syncs.report()}"
    assert len(syncs.cuda) <= budget, f"{what}: CUDA reported {len(syncs.cuda)}, budget {budget}:\n{syncs.report()}"


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(DEVICE).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(DEVICE).requires_grad_()
    bias = (torch.randn(V, generator=g) * 0.5).to(DEVICE).requires_grad_()
    return hidden, weight, bias, torch.randint(0, V, (N,), generator=g).to(DEVICE)


def test_the_detector_counts_safevocab_frames_only():
    flag = torch.tensor(True, device=DEVICE)
    with HostSyncs() as syncs:
        assert validation.boolean("flag", flag)  # safevocab's own code: bool(value.item())
        flag.item()  # this test's frame: not counted
        # a kernel launch: Triton's interpreter reads every tensor into numpy on CPU, in its own frames
        ts.transformed_rows(torch.randn(3, 5, device=DEVICE), torch.arange(3, device=DEVICE))
    assert [(r.kind, r.file, r.function) for r in syncs.records] == [
        ("Tensor.item", "safevocab/validation.py", "boolean")
    ], syncs.report()
    with HostSyncs() as again:  # patches undone on exit, installed again on entry
        validation.boolean("flag", flag)
    assert again.count == 1 and "validation.py" in again.report()
    with pytest.raises(ValueError, match="cuda_mode"):
        HostSyncs(cuda_mode="always")


@pytest.mark.parametrize("rule", list(FORWARD_BUDGET))
def test_triton_forward_and_backward_stay_within_their_host_syncs(rule, monkeypatch):
    set_sparse_max_density(monkeypatch, 1.0)  # every chunk stored: the forward decides it, the sparse backward runs
    hidden, weight, bias, targets = _inputs()
    support, spec = None, rule
    if rule.startswith("replay"):
        support = SafeSupport.from_lists([list(range(i % 4, V, 3)) for i in range(N)], device=DEVICE)
        spec = rule.partition(",")[2] or "none"
    route = "selection" if spec.startswith("top") else "in-kernel"
    budget = FORWARD_BUDGET[rule]
    with HostSyncs(cuda_mode=_cuda_mode(budget)) as forward:
        out = fused_safe_logprobs(hidden, weight, targets, spec, bias=bias,
                                  backend="triton", compute_entropy=True, max_chunk_bytes=CHUNK_BYTES[route],
                                  support=support)  # fmt: skip
    _assert_within(forward, budget, f"{rule} forward")
    loss = (out.logprobs * out.in_safe).sum() + 0.1 * out.entropy.sum() + out.log_kept_mass.sum()
    with HostSyncs(cuda_mode=_cuda_mode(BACKWARD_BUDGET)) as backward:
        loss.backward()
    _assert_within(backward, BACKWARD_BUDGET, f"{rule} backward")


def test_in_kernel_forward_without_stored_chunks_reads_once():
    """The default gate stores no chunk of these small rows: the op's own read is the call's only one, and the dense
    backward reads nothing (no stored chunk: no row's full-softmax part to find)."""
    hidden, weight, bias, targets = _inputs(1)
    with HostSyncs(cuda_mode=_cuda_mode(1)) as forward:
        out = fused_safe_logprobs(hidden, weight, targets, "min_p=0.05", bias=bias, backend="triton",
                                  max_chunk_bytes=CHUNK_BYTES["in-kernel"], compute_entropy=True)  # fmt: skip
    _assert_within(forward, 1, "min_p forward, dense backward")
    assert [r.function for r in forward.records] == ["read"]
    loss = (out.logprobs * out.in_safe).sum() + 0.1 * out.entropy.sum() + out.log_kept_mass.sum()
    with HostSyncs(cuda_mode=_cuda_mode(0)) as backward:
        loss.backward()
    _assert_within(backward, 0, "min_p dense backward")
