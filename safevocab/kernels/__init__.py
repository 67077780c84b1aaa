"""Optional Triton kernels for :func:`safevocab.fused_safe_logprobs` (``backend="triton"``).

The LM-head GEMMs stay in torch (cuBLAS); the kernels *fold* each ``[rows, V]`` logits chunk, Liger
style, one file per op:

- :mod:`safevocab.kernels.forward_fold`: one program per row reads the chunk once or twice and writes
  the row's fp32 statistics: maximum, threshold, ``logsumexp`` over ``S`` and over the vocabulary,
  target logit, ``in_safe``, ``|S|`` and the entropy of ``pi_S``. The logit transform (scale, softcap,
  temperature) runs in the kernel too.
- :mod:`safevocab.kernels.backward_fold`: turns a recomputed logits chunk into the logits gradient in
  place (the two gradient GEMMs follow in torch).
- :mod:`safevocab.kernels.fused`: the per-chunk driver the autograd function in
  :mod:`safevocab.fused_op` calls through :class:`safevocab.kernels.fused.TritonBackend`.

Thresholds: ``NoPruning``, ``MinP`` and ``MinProb`` are computed inside the forward kernel. The other
rules (``TopK``, ``TopP`` and compositions) need a selection or a sort: their per-row threshold is
computed in torch with the rule's own code, on logits transformed in torch, and the kernels fold the
rest (logged at DEBUG level on the ``"safevocab"`` logger). The sparse backward stays in torch.

This module never imports Triton at import time: ``safevocab`` imports (and ``backend="auto"`` works)
without it. Triton runs on CUDA; on CPU only through its interpreter (``TRITON_INTERPRET=1``, set
before ``triton`` is first imported in the process), which the tests use.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys

import torch

from safevocab.rules import MinP, MinProb, NoPruning, SafeVocabRule

__all__ = ["triton_available", "resolve_backend", "kernel_threshold", "triton_chunk_rows", "interpreter_on"]

logger = logging.getLogger("safevocab")

#: Threshold modes of the forward kernel (``MODE`` constexpr).
MODE_GIVEN, MODE_NONE, MODE_MIN_P, MODE_MIN_PROB = 0, 1, 2, 3

_KERNEL_MODULES = ("safevocab.kernels.common", "safevocab.kernels.forward_fold", "safevocab.kernels.backward_fold")


@functools.lru_cache(maxsize=1)
def _triton_import_error() -> str | None:
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as err:  # ImportError, or a broken install raising something else
        return f"{type(err).__name__}: {err}"
    return None


def triton_available() -> bool:
    """Whether ``import triton`` works here (checked once, lazily)."""
    return _triton_import_error() is None


def interpreter_on() -> bool:
    """Whether ``@triton.jit`` defines interpreted functions now: ``TRITON_INTERPRET`` as Triton reads it."""
    try:
        from triton import knobs  # Triton >= 3.4
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
    return bool(knobs.runtime.interpret)


def _loaded_compiled() -> bool:
    """True when Triton itself or the kernel modules were imported *without* the interpreter.

    Triton decides interpreted vs compiled when a ``@triton.jit`` function is defined (at import, for
    Triton's own ``tl.max`` & co. too), so a later ``TRITON_INTERPRET=1`` does not make them interpreted.
    """
    if any(name in sys.modules and not sys.modules[name].INTERPRETED for name in _KERNEL_MODULES):
        return True
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # cannot tell on this Triton version: let Triton report
        return False
    return not isinstance(getattr(tl, "max", None), InterpretedFunction)


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for ``backend`` in ``("auto", "torch", "triton")`` and the tensors' device.

    ``"auto"`` picks Triton for CUDA tensors when Triton imports, torch otherwise. ``"triton"`` forces it.

    Raises:
        ValueError: ``backend="triton"`` without an importable ``triton``, or with CPU tensors when the
            Triton interpreter is off (``TRITON_INTERPRET=1``), or on a device Triton does not run on.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    error = _triton_import_error()
    if error is not None:
        raise ValueError(
            f"backend='triton' needs the triton package, which does not import here ({error}); "
            "install it (pip install 'safevocab[triton]') or use backend='auto' or 'torch'"
        )
    if device.type == "cpu":
        if not interpreter_on():
            raise ValueError(
                "backend='triton' got CPU tensors: the Triton kernels run on CUDA, and on CPU only under "
                "Triton's interpreter (set TRITON_INTERPRET=1 before triton is first imported; for tests). "
                "Move the tensors to CUDA or use backend='torch'"
            )
        if _loaded_compiled():
            raise ValueError(
                "backend='triton' on CPU: triton (or safevocab.kernels) was imported before TRITON_INTERPRET=1 "
                "was set, so its kernels are compiled (CUDA) ones; set TRITON_INTERPRET=1 before the first "
                "`import triton` in the process"
            )
        return "triton"
    if device.type != "cuda":
        raise ValueError(
            f"backend='triton' supports CUDA tensors (and CPU under TRITON_INTERPRET=1), got device={device}; "
            "use backend='auto' or 'torch'"
        )
    return "triton"


def kernel_threshold(rule: SafeVocabRule) -> tuple[int, float] | None:
    """``(MODE, log parameter)`` when the forward kernel computes ``rule``'s threshold itself, else ``None``.

    ``NoPruning``: ``t = finite floor``; ``MinP(rho)``: ``t = max + log rho``; ``MinProb(tau)``:
    ``t = min(max, lse + log tau)``. Exact types only: a subclass may change the threshold.
    """
    import math

    if type(rule) is NoPruning:
        return MODE_NONE, 0.0
    if type(rule) is MinP:
        return MODE_MIN_P, math.log(rule.rho)
    if type(rule) is MinProb:
        return MODE_MIN_PROB, math.log(rule.tau)
    return None


def triton_chunk_rows(n_rows: int, vocab: int, rule: SafeVocabRule, in_bytes: int, max_chunk_bytes: int) -> int:
    """Rows per chunk for the Triton backend so that one chunk's scratch fits ``max_chunk_bytes``.

    The kernels read the GEMM output in the inputs' dtype and write the gradient over it, so a rule
    with an in-kernel threshold needs only that buffer (plus a bool mask for the sparse backward of
    fp32/fp64 inputs). A torch-computed threshold also needs the fp32 transformed copy and the rule's
    own scratch.
    """
    stat_bytes = 8 if in_bytes >= 8 else 4
    mask = 1 if in_bytes >= 4 else 0  # keep-mask of the sparse backward (fp32/fp64 inputs only)
    if kernel_threshold(rule) is not None:
        per_logit = in_bytes + mask
    else:
        per_logit = stat_bytes + (in_bytes if in_bytes < 4 else 0) + mask + rule.scratch_bytes_per_logit
    return max(1, min(n_rows, max_chunk_bytes // max(1, vocab * per_logit)))
