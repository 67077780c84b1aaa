"""Which backend runs the fused op: the table of backends, ``backend="auto"``, and the checks of a named one.

:data:`BACKENDS` maps each name to a :class:`BackendEntry`: how to build the backend (its module is imported only
then: the Triton one imports Triton), why it cannot run on a device when asked for by name, and whether
``backend="auto"`` may take it there. The table's order is ``"auto"``'s preference: it takes the first entry that
accepts the tensors' device (Triton for CUDA tensors when ``triton`` imports; torch, last, accepts every device).
So a new backend is one module (or package) implementing :class:`~safevocab.fused.protocol.FusedBackend` and one
entry here.

``fused_safe_logprobs`` calls :func:`resolve_backend` on the name it was given, :func:`get_backend` on the result,
and :func:`replay_backend` when it replays a support (both backends take one now).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from safevocab import kernels
from safevocab.fused.protocol import FusedBackend

__all__ = ["BackendEntry", "BACKENDS", "BACKEND_CHOICES", "resolve_backend", "get_backend", "replay_backend"]


@dataclass(frozen=True)
class BackendEntry:
    """One backend of :data:`BACKENDS`."""

    #: Builds the backend object (imports its module: nothing is imported before a backend is used).
    build: Callable[[], FusedBackend]
    #: Why the backend cannot run on tensors of this device when asked for by name; ``None`` when it can.
    refusal: Callable[[torch.device], str | None]
    #: Whether ``backend="auto"`` takes it for tensors of this device.
    auto: Callable[[torch.device], bool]


def _build_triton() -> FusedBackend:
    from safevocab.backends.triton import TritonBackend  # imports Triton: only when asked for

    return TritonBackend()


def _build_torch() -> FusedBackend:
    from safevocab.backends.torch_backend import TorchBackend

    return TorchBackend()


def _triton_refusal(device: torch.device) -> str | None:
    """Why the kernels cannot run: they need ``triton``, and CUDA tensors or CPU ones under Triton's interpreter
    (with kernels defined under it)."""
    # read through the module: tests replace kernels.triton_import_error to play an install without triton
    error = kernels.triton_import_error()
    if error is not None:
        return (
            f"backend='triton' needs the triton package, which does not import here ({error}); "
            "install it (pip install 'safevocab[triton]') or use backend='auto' or 'torch'"
        )
    if device.type == "cpu":
        if not kernels.interpreter_on():
            return (
                "backend='triton' got CPU tensors: the Triton kernels run on CUDA, and on CPU only under "
                "Triton's interpreter (set TRITON_INTERPRET=1 before triton is first imported; for tests). "
                "Move the tensors to CUDA or use backend='torch'"
            )
        if kernels.compiled_kernels_loaded():
            return (
                "backend='triton' on CPU: triton (or safevocab.kernels) was imported before TRITON_INTERPRET=1 "
                "was set, so its kernels are compiled (CUDA) ones; set TRITON_INTERPRET=1 before the first "
                "`import triton` in the process"
            )
        return None
    if device.type != "cuda":
        return (
            f"backend='triton' supports CUDA tensors (and CPU under TRITON_INTERPRET=1), got device={device}; "
            "use backend='auto' or 'torch'"
        )
    return None


#: Every backend by name, in ``backend="auto"``'s order of preference (torch, which runs anywhere, last).
BACKENDS: dict[str, BackendEntry] = {
    # auto never picks the interpreter: Triton on CPU is for tests
    "triton": BackendEntry(
        build=_build_triton,
        refusal=_triton_refusal,
        auto=lambda device: device.type == "cuda" and kernels.triton_available(),
    ),
    "torch": BackendEntry(build=_build_torch, refusal=lambda device: None, auto=lambda device: True),
}

#: The accepted values of ``fused_safe_logprobs(backend=...)``.
BACKEND_CHOICES: tuple[str, ...] = ("auto", *sorted(BACKENDS))


def resolve_backend(backend: str, device: torch.device) -> str:
    """The name of the backend that runs ``backend`` (one of :data:`BACKEND_CHOICES`) on tensors of ``device``.

    ``"auto"`` takes the first entry of :data:`BACKENDS` that accepts ``device``: Triton for CUDA tensors when
    ``triton`` imports, torch otherwise. A backend named explicitly is used, or refused with the reason.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKEND_CHOICES`; or ``backend="triton"`` without an importable
            ``triton``, or with CPU tensors when the Triton interpreter is off (``TRITON_INTERPRET=1``), or on a
            device Triton does not run on.
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={backend!r} is not accepted: accepted one of {BACKEND_CHOICES}")
    if backend == "auto":
        return next(name for name, entry in BACKENDS.items() if entry.auto(device))  # torch accepts every device
    reason = BACKENDS[backend].refusal(device)
    if reason is not None:
        raise ValueError(reason)
    return backend


def get_backend(name: str) -> FusedBackend:
    """The backend object for a resolved name (:func:`resolve_backend`): a key of :data:`BACKENDS`."""
    entry = BACKENDS.get(name) if isinstance(name, str) else None
    if entry is None:
        *others, last = map(repr, sorted(BACKENDS))
        accepted = f"{', '.join(others)} or {last}" if others else last
        raise ValueError(f"backend={name!r} is not accepted: accepted {accepted}")
    return entry.build()


def replay_backend(backend: FusedBackend) -> FusedBackend:
    """The backend that runs a replayed ``SafeSupport``: ``backend`` when it takes one (``supports_replay``: the torch
    and Triton backends), else the torch backend."""
    return backend if backend.supports_replay else get_backend("torch")
