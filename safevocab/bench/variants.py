"""The benchmark's variants: each one's forward + backward step on the process's one set of inputs.

:func:`make_step` builds the step of a variant (:data:`VARIANTS`; the package docstring of :mod:`safevocab.bench`
says what each one runs) on :func:`shared_inputs`, built once per process on the device that runs it. ``trl`` and
``liger`` are imported only when their step is built (:func:`trl_available`, :func:`liger_available` tell whether
they import here).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

import torch

from safevocab.bench.inputs import draw_logit_factors, replay_support, sample_targets

__all__ = [
    "DEFAULT_VARIANTS",
    "DTYPES",
    "OPTIONAL_VARIANTS",
    "VARIANTS",
    "liger_available",
    "make_step",
    "shared_inputs",
    "trl_available",
]

VARIANTS = ("floor", "recompute_floor", "fused", "fused_torch", "fused_replay", "naive", "trl", "liger")
#: Variants run when ``--variants`` is not given, per device type.
DEFAULT_VARIANTS = {
    "cpu": ("floor", "fused", "naive", "trl"),
    "cuda": ("floor", "fused", "fused_torch", "naive", "trl", "liger"),
}
#: Comparison variants whose failure is reported in the table rather than raised.
OPTIONAL_VARIANTS = ("naive", "trl", "liger")
#: ``--dtype`` values.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shared_inputs(args: argparse.Namespace, device: torch.device):
    """Each variant's own leaves over one set of inputs, built once per process on ``device``.

    Built where they are used, with the device's generator: built on the CPU (a 151936 x 4096 weight drawn on one
    core, targets drawn by CPU ``multinomial`` over softmaxes copied back) and rebuilt for every variant, the GPU
    preset's setup took about 55 s per variant on an H200 against 0.06 s for the step it sets up. Fresh leaves
    (``detach().requires_grad_()``, storage shared) give each variant its own ``.grad``, so its peak memory
    still counts allocating the gradients. The logits follow ``--logits-profile`` (:mod:`safevocab.bench.inputs`).
    """
    key = (args.n, args.h, args.v, args.dtype, args.rule, args.seed, str(device), args.logits_profile)
    if key not in _INPUTS:
        _INPUTS.clear()  # one shape at a time: a GPU holds a few GB per set
        gen = torch.Generator(device=device).manual_seed(args.seed)
        dtype = DTYPES[args.dtype]
        hidden, weight = draw_logit_factors(args.n, args.h, args.v, profile=args.logits_profile, generator=gen,
                                            device=device)  # fmt: skip
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        targets = sample_targets(hidden, weight, args.rule, gen)
        grad_out = torch.randn(args.n, generator=gen, device=device)
        _INPUTS[key] = (hidden, weight, targets, grad_out)
    hidden, weight, targets, grad_out = _INPUTS[key]
    return hidden.detach().requires_grad_(), weight.detach().requires_grad_(), targets, grad_out


_INPUTS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def make_step(variant: str, args: argparse.Namespace, device: torch.device) -> Callable[[], None]:
    """The forward + backward step of ``variant`` (one of :data:`VARIANTS`) on :func:`shared_inputs`."""
    from safevocab.logprobs import fused_safe_logprobs, safe_log_softmax

    hidden, weight, targets, grad_out = shared_inputs(args, device)
    if variant in ("floor", "recompute_floor"):
        grad_logits = torch.randn(args.n, args.v, device=device).to(hidden.dtype)
        h, w = hidden.detach(), weight.detach()
        # recompute_floor: the logits again in the backward, as a head that keeps none recomputes them
        forward_gemms = 2 if variant == "recompute_floor" else 1

        def step() -> None:
            for _ in range(forward_gemms):
                h @ w.t()
            grad_logits @ w
            grad_logits.t() @ h

        return step
    if variant in ("fused", "fused_torch", "fused_replay"):
        backend = "torch" if variant == "fused_torch" else args.backend
        replay = variant == "fused_replay"
        # fused_replay: the rule's own sets (built once, outside the timing) replayed as an engine's kept ids, no rule
        support = replay_support(hidden.detach(), weight.detach(), args.rule) if replay else None
        rule = None if replay else args.rule

        def step() -> None:
            out = fused_safe_logprobs(
                hidden,
                weight,
                targets,
                rule,
                max_chunk_bytes=args.max_chunk_bytes,
                keep_logits_bytes=args.keep_logits_bytes,
                support=support,
                backend=backend,
            ).logprobs
            out.backward(grad_out)

        return step
    if variant == "naive":

        def step() -> None:
            logits = hidden @ weight.t()
            safe_log_softmax(logits, targets, args.rule).logprobs.backward(grad_out)

        return step
    if variant == "trl":
        chunked = _trl_function()

        def step() -> None:
            logprobs = chunked.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, ())[0]
            logprobs.backward(grad_out)

        return step
    if variant == "liger":
        return _liger_step(args, hidden, weight, targets)
    raise ValueError(f"variant={variant!r}: accepted one of {VARIANTS}")


def _liger_step(args: argparse.Namespace, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Liger's fused linear GRPO loss on the same rows, as ``[B, T]`` sequences (``T = --liger-seq-len``).

    ``beta=0`` (no reference model) and no old log-probabilities (on-policy ratio 1), so the head's work is
    what is timed: Liger streams 2048-token x 4096-vocab tiles and computes the gradients inside its forward;
    ``backward`` only scales them. ``compiled=False``: its loss math is elementwise on ``[B, T]``, negligible
    next to the GEMMs, and skipping ``torch.compile`` keeps the comparison free of compile-time effects.
    """
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    seq = args.liger_seq_len if args.n % args.liger_seq_len == 0 else args.n
    batch = args.n // seq
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False, loss_type="grpo")
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    advantages = torch.randn(batch, generator=gen).to(hidden.device)
    mask = torch.ones(batch, seq, device=hidden.device, dtype=torch.long)
    h3, y2 = hidden.view(batch, seq, -1), targets.view(batch, seq)

    def step() -> None:
        loss, _metrics = loss_fn(h3, weight, y2, mask, advantages)
        loss.backward()

    return step


def _trl_function():
    return importlib.import_module("trl.kernels").ChunkedLogProbFunction


def _imports(load: Callable[[], object]) -> bool:
    """Whether ``load()`` runs: the comparison's package imports here."""
    try:
        load()
    except Exception:  # the package missing or broken: the comparison is skipped, and the table says so
        return False
    return True


def trl_available() -> bool:
    """Whether trl's ``ChunkedLogProbFunction`` imports here (the ``trl`` variant)."""
    return _imports(_trl_function)


def liger_available() -> bool:
    """Whether Liger-Kernel's chunked losses import here (the ``liger`` variant)."""
    return _imports(lambda: importlib.import_module("liger_kernel.chunked_loss"))
