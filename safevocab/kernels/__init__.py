"""Optional Triton kernels for :func:`safevocab.fused_safe_logprobs` (``backend="triton"``).

The LM-head GEMMs stay in torch (cuBLAS); the kernels *fold* each ``[rows, V]`` logits chunk, Liger
style, one file per op:

- :mod:`safevocab.kernels.forward_fold`: one program per row reads the chunk once or twice and writes
  the row's fp32 statistics: maximum, threshold, ``logsumexp`` over ``S`` and over the vocabulary,
  target logit, ``in_safe``, ``|S|`` and the entropy of ``pi_S``. The logit transform (scale, softcap,
  temperature) runs in the kernel too.
- :mod:`safevocab.kernels.backward_fold`: turns a recomputed logits chunk into the logits gradient in
  place (the two gradient GEMMs follow in torch).
- :mod:`safevocab.kernels.common`: the logit transform both kernels apply.

The per-chunk driver that calls them is :class:`safevocab.backends.triton.TritonBackend`; which backend
runs is chosen in :mod:`safevocab.backends.registry`, from the probes of the Triton runtime defined here
(:func:`triton_import_error`, :func:`interpreter_on`, :func:`compiled_kernels_loaded`).

Thresholds: ``NoPruning``, ``MinP`` and ``MinProb`` are computed inside the forward kernel
(:func:`kernel_threshold`). ``TopK``, ``TopP`` and their compositions (bf16/fp16/fp32 inputs) get theirs from
:mod:`safevocab.kernels.threshold_select` (a slot-max sketch bounds the threshold from below, the few candidates above
it are compacted and decided exactly, in one kernel, by :mod:`safevocab.kernels.candidate_decide`, whose decision
:mod:`safevocab.kernels.candidate_thresholds` states in torch; rows whose kept set
is wider than the candidate buffer, flat ones, by the radix select of :mod:`safevocab.kernels.radix_select` on the
whole row; no sort of the vocabulary, no fp32 copy). Other rules (subclasses, fp64 inputs) compute their per-row
threshold in torch with the rule's own code, on logits transformed in torch, and the kernels fold the rest (logged at
DEBUG level on the ``"safevocab"`` logger). :class:`safevocab.backends.triton.route.Route` decides which, once per call.

Sparse backward (chunks whose ``S`` the forward stored, and every replayed support): the forward fold's last pass
writes ``S``'s entries into a bounded pool that :mod:`safevocab.kernels.kept_entries` puts in CSR order (it also
gathers a replayed support's logits with the forward's own transform, and keeps the separate compaction as the
fallback of an overflowing pool), and :mod:`safevocab.kernels.sparse_backward` (per kept id) or
:mod:`safevocab.kernels.union_backward` (two GEMMs over the union of a chunk's kept ids) turns them into the input
gradients without ``[rows, V]``.

This package's ``__init__`` never imports Triton: ``safevocab`` imports (and ``backend="auto"`` works)
without it; the op modules import it (:mod:`~safevocab.kernels.candidate_thresholds`, torch only, does not). Triton
runs on CUDA; on CPU only through its interpreter (``TRITON_INTERPRET=1``, set before ``triton`` is first imported
in the process), which the tests use.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

from safevocab.rules import MinP, MinProb, NoPruning, SafeVocabRule

__all__ = ["kernel_threshold", "triton_import_error", "triton_available", "interpreter_on", "compiled_kernels_loaded"]

#: Threshold modes of the forward kernel (``MODE`` constexpr).
MODE_GIVEN, MODE_NONE, MODE_MIN_P, MODE_MIN_PROB = 0, 1, 2, 3

_KERNEL_MODULES = (
    "safevocab.kernels.common",
    "safevocab.kernels.forward_fold",
    "safevocab.kernels.backward_fold",
    "safevocab.kernels.threshold_select",
    "safevocab.kernels.radix_select",
    "safevocab.kernels.candidate_decide",
    "safevocab.kernels.sparse_backward",
    "safevocab.kernels.union_backward",
    "safevocab.kernels.kept_entries",
)


@functools.lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """Why ``import triton`` fails here (``"ImportError: ..."``), or ``None`` when it works (checked once, lazily)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as err:  # ImportError, or a broken install raising something else
        return f"{type(err).__name__}: {err}"
    return None


def triton_available() -> bool:
    """Whether ``import triton`` works here (checked once, lazily)."""
    return triton_import_error() is None


def interpreter_on() -> bool:
    """Whether ``@triton.jit`` defines interpreted functions now: ``TRITON_INTERPRET`` as Triton reads it."""
    try:
        from triton import knobs  # Triton >= 3.4
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
    return bool(knobs.runtime.interpret)


def compiled_kernels_loaded() -> bool:
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
