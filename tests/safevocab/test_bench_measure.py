"""``safevocab.bench.measure``: the CPU memory tracker counts what it should (storage alive at once, backward's too)."""

import torch

from safevocab.bench.measure import LiveTensorBytes


def test_live_tensor_bytes_counts_only_concurrently_live_storage():
    outside = torch.randn(256, 256)  # allocated before: not counted
    with LiveTensorBytes() as tracker:
        a = outside * 2  # 256 KiB
        b = a + 1  # 512 KiB live
        del a
        c = b * 3  # b and c: 512 KiB live
        c.add_(1)  # in place: no new storage
        view = c[:10]  # a view: same storage
    assert tracker.peak == 2 * 256 * 256 * 4
    assert view.shape == (10, 256)


def test_live_tensor_bytes_sees_backward_allocations():
    w = torch.randn(100, 50, requires_grad=True)
    h = torch.randn(200, 50, requires_grad=True)
    with LiveTensorBytes() as tracker:
        (h @ w.t()).sum().backward()
    assert tracker.peak >= 200 * 100 * 4 + w.numel() * 4  # the logits and at least one gradient
