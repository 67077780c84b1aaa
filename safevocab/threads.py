"""One intra-op thread for the fused op's element-wise passes, whatever the caller's thread count.

The row-block passes of :mod:`safevocab.backends.torch_backend` are many small torch ops (a few MiB each). With several
intra-op threads each one is an OpenMP parallel region that ends in a barrier; when another process holds one of the
cores, every barrier waits for the thread the OS preempted, so the element-wise work slowed down about three times
more than the GEMMs around it (2 threads, one core busy elsewhere). On one thread those passes have no barrier to
wait at; the chunk GEMMs keep the caller's threads. The caller's count is restored when the block ends, also on an
error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["single_threaded"]


@contextlib.contextmanager
def single_threaded(device: torch.device) -> Iterator[None]:
    """Run the block with one intra-op thread when ``device`` is the CPU (CUDA ops do not use them)."""
    before = torch.get_num_threads()
    if device.type != "cpu" or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
