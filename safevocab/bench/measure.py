"""How the benchmark measures one step: its peak extra memory and its time.

- Memory on a CPU: :class:`LiveTensorBytes`, a ``TorchDispatchMode`` that records every op's output storages and drops
  those freed, so the peak of tensor storage alive at once inside a block is counted exactly (inputs excluded);
  on CUDA, ``torch.cuda.max_memory_allocated`` above the memory allocated before the step.
- Time: wall-clock of one call, synchronised on CUDA before and after.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensorBytes", "peak_bytes", "timed"]


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage allocated inside the ``with`` block and alive at the same time.

    The CPU counterpart of ``torch.cuda.max_memory_allocated``: every op's outputs are recorded by
    storage, and storages whose tensors were freed are dropped before the next op runs. Tensors that
    existed before the block (the inputs) are not counted; gradients and autograd's saved tensors
    are. Deterministic, unlike the process RSS, which depends on the allocator's caching.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Peak extra memory of one call of ``step`` (inputs excluded)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with LiveTensorBytes() as tracker:
        step()
    return tracker.peak


def timed(step: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0
