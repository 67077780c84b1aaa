"""The backends of the fused op: the per-chunk arithmetic of :class:`safevocab.fused.op.FusedSafeLogProbs`.

- :mod:`safevocab.backends.registry`: the table of backends, ``backend="auto"`` and the checks of a named one;
- :mod:`safevocab.backends.torch_backend`: torch passes on cached row blocks (any device);
- :mod:`safevocab.backends.triton`: the Triton kernels of :mod:`safevocab.kernels` (CUDA, or CPU under
  Triton's interpreter), a package (route, forward, backward); imported only when used, as it imports Triton.

A backend implements :class:`safevocab.fused.protocol.FusedBackend` (the op's contract, beside the op). A new backend
is one module (or one package) and one entry in :data:`safevocab.backends.registry.BACKENDS`; every
per-chunk call takes the call's :class:`~safevocab.fused.chunking.ChunkJob`.
"""

from safevocab.backends.registry import (
    BACKEND_CHOICES,
    BACKENDS,
    BackendEntry,
    get_backend,
    replay_backend,
    resolve_backend,
)
from safevocab.fused.protocol import FusedBackend

__all__ = [
    "FusedBackend",
    "BackendEntry",
    "BACKENDS",
    "BACKEND_CHOICES",
    "resolve_backend",
    "get_backend",
    "replay_backend",
]
