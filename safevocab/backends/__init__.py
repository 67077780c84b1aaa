"""The backends of the fused op: the per-chunk arithmetic of :class:`safevocab.fused_op.FusedSafeLogProbs`.

- :mod:`safevocab.backends.protocol`: what a backend implements (:class:`FusedBackend`);
- :mod:`safevocab.backends.registry`: the table of backends, ``backend="auto"`` and the checks of a named one;
- :mod:`safevocab.backends.torch_backend`: torch passes on cached row blocks (any device);
- :mod:`safevocab.backends.triton_backend`: the Triton kernels of :mod:`safevocab.kernels` (CUDA, or CPU under
  Triton's interpreter); imported only when used, as it imports Triton.

A new backend is one module and one entry in :data:`safevocab.backends.registry.BACKENDS`.
"""

from safevocab.backends.protocol import FusedBackend
from safevocab.backends.registry import (
    BACKEND_CHOICES,
    BACKENDS,
    BackendEntry,
    get_backend,
    replay_backend,
    resolve_backend,
)

__all__ = [
    "FusedBackend",
    "BackendEntry",
    "BACKENDS",
    "BACKEND_CHOICES",
    "resolve_backend",
    "get_backend",
    "replay_backend",
]
