"""The two sides the mismatch lab compares: the *training* side (the model in the training dtype) and the
*rollout* side (the model in the rollout dtype, optionally with its weights rounded to ``k`` mantissa bits).

Weights are cast per side from one load and copied only when they change, so the caller's model is never modified;
buffers (e.g. RoPE's float32 ``inv_freq``) keep their dtype, as ``from_pretrained(..., dtype=...)`` leaves them.
Rounding to ``k`` mantissa bits (:func:`trl_integration.rollout.mantissa.round_mantissa`) is what a training run with
``rollout_mantissa_bits=k`` samples with: the rounded weights of the current policy.
"""

from __future__ import annotations

import copy

import torch

from trl_integration.options import MANTISSA_BITS_RANGE
from trl_integration.rollout.mantissa import round_mantissa

__all__ = ["check_mantissa_bits", "model_in", "rollout_side"]


def check_mantissa_bits(mantissa_bits: int | None, rollout_dtype: torch.dtype) -> None:
    """``ValueError`` (one line) unless ``mantissa_bits`` is ``None`` or an integer in ``[1, 23]`` and the rollout
    dtype is one :func:`~trl_integration.rollout.mantissa.round_mantissa` rounds (float32, bfloat16, float16)."""
    if mantissa_bits is None:
        return
    lo, hi = MANTISSA_BITS_RANGE
    if isinstance(mantissa_bits, bool) or not isinstance(mantissa_bits, int) or not lo <= mantissa_bits <= hi:
        raise ValueError(
            f"--rollout_mantissa_bits {mantissa_bits!r} is not accepted: accepted an integer in [{lo}, {hi}]"
        )
    if rollout_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"--rollout_mantissa_bits {mantissa_bits} rounds float32, bfloat16 or float16 weights, not a "
            f"{str(rollout_dtype).replace('torch.', '')} rollout side"
        )


def model_in(base: torch.nn.Module, dtype: torch.dtype, cache: dict) -> torch.nn.Module:
    """``base`` with its floating parameters in ``dtype`` (a copy unless they already are), cached by dtype."""
    if dtype not in cache:
        params = [p for p in base.parameters() if p.is_floating_point()]
        if all(p.dtype == dtype for p in params):
            model = base
        else:
            model = copy.deepcopy(base)
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        cache[dtype] = model.eval()
    return cache[dtype]


def rollout_side(base: torch.nn.Module, dtype: torch.dtype, mantissa_bits: int | None, cache: dict) -> torch.nn.Module:
    """The rollout side's model: ``base`` in ``dtype`` (`model_in`), with its floating parameters rounded to
    ``mantissa_bits`` mantissa bits when given (a copy, cached under ``(dtype, mantissa_bits)``)."""
    model = model_in(base, dtype, cache)
    if mantissa_bits is None:
        return model
    key = (dtype, mantissa_bits)
    if key not in cache:
        rounded = copy.deepcopy(model)
        with torch.no_grad():
            for p in rounded.parameters():
                if p.is_floating_point():
                    p.data = round_mantissa(p.data, mantissa_bits)
        cache[key] = rounded.eval()
    return cache[key]
