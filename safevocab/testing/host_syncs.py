"""Count the calls in safevocab's own code that make the host wait for the device (device -> host reads).

On a GPU, ``torch.cuda.set_sync_debug_mode("warn" | "error")`` reports synchronising CUDA calls; it needs CUDA. On CPU
(the tests run the Triton kernels under ``TRITON_INTERPRET=1``) nothing synchronises, so :class:`HostSyncs` records
instead, while active, every call that *would* force a read of a device result, when it is made from a frame of the
``safevocab`` package (frames of torch's own Python code are looked through; Triton's interpreter, which reads every
tensor into numpy, and the caller's code are not counted). Each record names the kind and ``file:line``.

Counted (:data:`SYNC_KINDS`): ``Tensor.item``/``tolist``/``__bool__``/``__int__``/``__float__``/``__index__``,
``Tensor.cpu``/``numpy``/``to("cpu")`` (or ``to`` a CPU device of a tensor that is not there), ``torch.equal``,
``nonzero`` (``torch.``/``Tensor.``, ``torch.argwhere``, the one-argument ``torch.where``), ``masked_select``,
``unique``/``unique_consecutive``, ``repeat_interleave`` of tensor repeats without ``output_size``, ``bincount``
(CUDA reads its maximum), boolean-mask indexing (``x[mask]``, and ``x[mask] = values`` unless the value is a Python
scalar, which torch turns into ``masked_fill_``), ``torch.tensor``/``torch.as_tensor`` of host data with a ``device=``
(a blocking host -> device copy on CUDA) and ``torch.cuda.synchronize``. Conversions done in C++ (a tensor passed where
torch wants an ``int``) are not seen: the GPU's ``set_sync_debug_mode`` is the complete check, and ``cuda_mode=`` runs
both together.

Usage (the fused op's forward and backward counted apart)::

    from safevocab.testing.host_syncs import HostSyncs

    with HostSyncs() as forward:
        out = fused_safe_logprobs(hidden, weight, targets, "min_p=0.1", backend="triton")
    with HostSyncs() as backward:
        out.logprobs.sum().backward()
    assert forward.count <= 1, forward.report()

On CUDA, ``HostSyncs(cuda_mode="warn")`` also sets ``torch.cuda.set_sync_debug_mode("warn")`` inside the block and
records each synchronisation CUDA reports (kind ``"cuda"``, at the Python line that made it; torch warns once per
line, so these count lines) in :attr:`HostSyncs.cuda`; ``cuda_mode="error"`` makes the first one raise (a
synchronisation-free block, what a CUDA graph can capture). Off CUDA ``cuda_mode`` is ignored.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from collections import Counter
from dataclasses import dataclass

import torch

import safevocab

__all__ = ["HostSync", "HostSyncs", "SYNC_KINDS"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(safevocab.__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_THIS_FILE = os.path.abspath(__file__)
_state = threading.local()


@dataclass(frozen=True)
class HostSync:
    """One recorded call: ``kind`` (e.g. ``"Tensor.item"``), where (``file`` relative to the package's parent
    folder, ``line``, ``function``)."""

    kind: str
    file: str
    line: int
    function: str

    @property
    def site(self) -> str:
        return f"{self.file}:{self.line}"

    def __str__(self) -> str:
        return f"{self.site} ({self.function}): {self.kind}"


def _is_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor)


def _has_bool_mask(index: object) -> bool:
    if _is_tensor(index):
        return index.dtype == torch.bool
    if isinstance(index, tuple):
        return any(_is_tensor(i) and i.dtype == torch.bool for i in index)
    return False


def _names_cpu(device: object) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cpu"
    return isinstance(device, torch.device) and device.type == "cpu"


def _to_cpu(self, *args, **kwargs) -> bool:
    # a copy to the host: a device tensor to the CPU, or the string "cpu" (what code that reads a result writes; a
    # torch.device is code following its inputs' device, which is the CPU under the interpreter)
    target = kwargs.get("device", args[0] if args else None)
    return _names_cpu(target) and (isinstance(target, str) or self.device.type != "cpu")


def _repeat_interleave_syncs(*args, **kwargs) -> bool:
    # torch.repeat_interleave(input, repeats, dim=None, *, output_size=None), or torch.repeat_interleave(repeats): the
    # output's length is the sum of tensor repeats, read on the host unless output_size gives it
    if kwargs.get("output_size") is not None:
        return False
    if len(args) + len(kwargs) == 1:
        return True
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    return _is_tensor(repeats)


def _tensor_repeat_interleave_syncs(self, repeats=None, *args, **kwargs) -> bool:
    return _is_tensor(kwargs.get("repeats", repeats)) and kwargs.get("output_size") is None


def _setitem_syncs(self, index, value) -> bool:
    return _has_bool_mask(index) and _is_tensor(value)


def _host_data_to_device(data=None, *args, **kwargs) -> bool:
    return kwargs.get("device") is not None and not _is_tensor(data)


def _always(*args, **kwargs) -> bool:
    return True


#: ``(owner, attribute, kind, predicate)``: the patched callables and when a call synchronises.
_PATCHES = (
    (torch.Tensor, "item", "Tensor.item", _always),
    (torch.Tensor, "tolist", "Tensor.tolist", _always),
    (torch.Tensor, "__bool__", "Tensor.__bool__", _always),
    (torch.Tensor, "__int__", "Tensor.__int__", _always),
    (torch.Tensor, "__float__", "Tensor.__float__", _always),
    (torch.Tensor, "__index__", "Tensor.__index__", _always),
    (torch.Tensor, "cpu", "Tensor.cpu", _always),
    (torch.Tensor, "numpy", "Tensor.numpy", _always),
    (torch.Tensor, "to", "Tensor.to('cpu')", _to_cpu),
    (torch.Tensor, "nonzero", "Tensor.nonzero", _always),
    (torch.Tensor, "masked_select", "Tensor.masked_select", _always),
    (torch.Tensor, "unique", "Tensor.unique", _always),
    (torch.Tensor, "unique_consecutive", "Tensor.unique_consecutive", _always),
    (torch.Tensor, "repeat_interleave", "Tensor.repeat_interleave", _tensor_repeat_interleave_syncs),
    (torch.Tensor, "bincount", "Tensor.bincount", _always),
    (torch.Tensor, "__getitem__", "boolean-mask indexing", lambda self, index: _has_bool_mask(index)),
    (torch.Tensor, "__setitem__", "boolean-mask assignment", _setitem_syncs),
    (torch, "equal", "torch.equal", _always),
    (torch, "nonzero", "torch.nonzero", _always),
    (torch, "argwhere", "torch.argwhere", _always),
    (torch, "where", "torch.where(condition)", lambda *args, **kwargs: len(args) + len(kwargs) == 1),
    (torch, "masked_select", "torch.masked_select", _always),
    (torch, "unique", "torch.unique", _always),
    (torch, "unique_consecutive", "torch.unique_consecutive", _always),
    (torch, "repeat_interleave", "torch.repeat_interleave", _repeat_interleave_syncs),
    (torch, "bincount", "torch.bincount", _always),
    (torch, "tensor", "torch.tensor(host data, device=)", _host_data_to_device),
    (torch, "as_tensor", "torch.as_tensor(host data, device=)", _host_data_to_device),
    (torch.cuda, "synchronize", "torch.cuda.synchronize", _always),
)
#: The kinds :class:`HostSyncs` records (and ``"cuda"``: one reported by ``set_sync_debug_mode``).
SYNC_KINDS = tuple(kind for _, _, kind, _ in _PATCHES)


def _package_frame():
    """The first frame outside torch's own Python code and this module, if it lies in the safevocab package (else
    ``None``)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path == _THIS_FILE or path.startswith(_TORCH_DIR + os.sep):
            frame = frame.f_back
            continue
        return frame if _in_package(path) else None
    return None


def _in_package(path: str) -> bool:
    path = os.path.abspath(path)
    return path != _THIS_FILE and path.startswith(_PACKAGE_DIR + os.sep)


def _relative(path: str) -> str:
    return os.path.relpath(os.path.abspath(path), os.path.dirname(_PACKAGE_DIR))


class HostSyncs(contextlib.AbstractContextManager):
    """While active, records the host synchronisations made from safevocab's code (module docstring).

    Args:
        cuda_mode: ``None`` (default), ``"warn"`` or ``"error"``: on CUDA, also run the block under
            ``torch.cuda.set_sync_debug_mode(cuda_mode)`` (``"warn"``: each reported synchronisation recorded in
            :attr:`cuda`; ``"error"``: the first one raises). Ignored where CUDA is not available.

    Attributes:
        records: the recorded calls (:class:`HostSync`), in order.
        cuda: the synchronisations CUDA reported under ``cuda_mode="warn"`` (kind ``"cuda"``).
    """

    def __init__(self, cuda_mode: str | None = None):
        if cuda_mode not in (None, "warn", "error"):
            raise ValueError(f"cuda_mode={cuda_mode!r}: accepted None, 'warn' or 'error'")
        self.cuda_mode = cuda_mode if torch.cuda.is_available() else None
        self.records: list[HostSync] = []
        self.cuda: list[HostSync] = []
        self._saved: list[tuple[object, str, bool, object]] = []
        self._warnings = None
        self._caught = None
        self._previous_mode = None

    # ------------------------------------------------------------------------------------------ results

    @property
    def count(self) -> int:
        """The recorded calls."""
        return len(self.records)

    def sites(self) -> Counter:
        """``Counter`` of ``"file:line: kind"`` over the records."""
        return Counter(f"{r.site}: {r.kind}" for r in self.records)

    def report(self) -> str:
        """One line per site (``count x file:line (function): kind``), for assertion messages."""
        counts = Counter(str(r) for r in self.records + self.cuda)
        return "\n".join(f"{n} x {site}" for site, n in counts.items()) or "no host synchronisation"

    # ------------------------------------------------------------------------------------------ patching

    def _site(self, kind: str) -> HostSync | None:
        frame = _package_frame()
        if frame is None:
            return None
        code = frame.f_code
        return HostSync(kind, _relative(code.co_filename), frame.f_lineno, code.co_name)

    def _cuda_reports(self, caught: list[warnings.WarningMessage], site: HostSync | None) -> None:
        """Keep CUDA's synchronisation reports made from safevocab's frames (at ``site``, the patched call's, where
        the report names this module's wrapper); show any other warning as it would have been."""
        for w in caught:
            if "synchronizing" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            elif site is not None:
                self.cuda.append(HostSync("cuda", site.file, site.line, site.function))
            elif _in_package(w.filename):
                self.cuda.append(HostSync("cuda", _relative(w.filename), w.lineno, ""))

    def _wrap(self, original, kind: str, predicate):
        recorder = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if getattr(_state, "inside", False):  # a patched call made by another one (Tensor.unique -> torch.unique)
                return original(*args, **kwargs)
            _state.inside = True
            try:
                counted = predicate(*args, **kwargs)
                site = recorder._site(kind) if counted or recorder.cuda_mode == "warn" else None
                if counted and site is not None:
                    recorder.records.append(site)
                if recorder.cuda_mode != "warn":
                    return original(*args, **kwargs)
                with warnings.catch_warnings(record=True) as caught:  # CUDA's report names this wrapper: re-sited
                    warnings.simplefilter("always")
                    result = original(*args, **kwargs)
                recorder._cuda_reports(caught, site)
                return result
            finally:
                _state.inside = False

        return wrapper

    def __enter__(self) -> HostSyncs:
        if getattr(_state, "active", False):
            raise RuntimeError("HostSyncs blocks do not nest")
        _state.active = True
        for owner, name, kind, predicate in _PATCHES:
            own = name in vars(owner)
            original = getattr(owner, name)
            self._saved.append((owner, name, own, vars(owner).get(name)))
            setattr(owner, name, self._wrap(original, kind, predicate))
        if self.cuda_mode is not None:
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            if self.cuda_mode == "warn":
                self._caught = warnings.catch_warnings(record=True)
                self._warnings = self._caught.__enter__()
                warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(self.cuda_mode)
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda_mode is not None:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
            if self._caught is not None:
                self._caught.__exit__(None, None, None)
                self._cuda_reports(self._warnings, None)  # unpatched calls: sited by CUDA's report itself
        for owner, name, own, value in reversed(self._saved):
            if own:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        self._saved.clear()
        _state.active = False
