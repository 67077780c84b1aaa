"""The fused op runs its element-wise passes on one thread and gives the caller its thread count back."""

import pytest
import torch

from safevocab import fused_safe_logprobs
from safevocab.threads import single_threaded


def test_single_threaded_restores_the_thread_count_also_on_error():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with single_threaded(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"), single_threaded(torch.device("cpu")):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rule", ["none", "min_p=0.1", "top_p=0.9"])
def test_the_fused_op_leaves_the_callers_thread_count(rule):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        hidden = torch.randn(40, 8, requires_grad=True)
        weight = torch.randn(50, 8, requires_grad=True)
        out = fused_safe_logprobs(hidden, weight, torch.randint(0, 50, (40,)), rule, max_chunk_bytes=16 * 50 * 4)
        assert torch.get_num_threads() == 2
        out.logprobs.sum().backward()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
