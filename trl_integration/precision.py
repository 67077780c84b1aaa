"""Which mixed precision this machine can run: what the config's precision defaults and warnings ask.

- ``bf16``: transformers refuses ``bf16=True`` without a bf16-capable accelerator (or ``use_cpu=True``), with
  "Your setup doesn't support bf16/gpu"; trl reads an unset ``bf16`` as ``True``. :func:`bf16_supported` is the
  very check transformers raises on, so the config can default ``bf16`` to ``False`` exactly where it would fail.
- ``fp16``: accelerate runs fp16 autocast and loss scaling on an accelerator only, never on CPU.
"""

from __future__ import annotations

import torch

__all__ = ["bf16_supported", "fp16_amp_supported"]


def bf16_supported() -> bool:
    """Whether transformers accepts ``bf16=True`` without ``use_cpu`` here (a bf16 GPU/XPU/NPU/MPS, or XLA)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return is_torch_bf16_gpu_available() or is_torch_xla_available()


def fp16_amp_supported(use_cpu: bool = False) -> bool:
    """Whether accelerate can run fp16 mixed precision (autocast + GradScaler) here: any non-CPU device."""
    if use_cpu:
        return False
    xpu, mps = getattr(torch, "xpu", None), getattr(torch.backends, "mps", None)
    return bool(torch.cuda.is_available() or (xpu and xpu.is_available()) or (mps and mps.is_available()))
