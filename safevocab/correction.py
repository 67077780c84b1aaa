"""Importance-sampling correction between rollout and training log-probabilities (pure tensor functions).

Reproduces trl's ``vllm_importance_sampling_mode`` semantics (``token_truncate``, ``token_mask``,
``sequence_truncate``, ``sequence_mask`` with ``clip_min``/``clip_max``) and also returns the raw,
pre-truncation ratio and which entries were truncated or masked, which trl does not expose (trl issue 5231).
Used for both the vLLM and the ``generate`` path; torch only, like the rest of the core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["IS_MODES", "ImportanceRatio", "importance_sampling_ratio"]

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

#: Bound on a log-ratio before exponentiation for the raw statistics (verl's SAFETY_BOUND).


@dataclass
class ImportanceRatio:
    """Result of :func:`importance_sampling_ratio`.

    Attributes:
        ratio: the corrected ratio, ``[B, T]`` (token modes) or ``[B, 1]`` (sequence modes): truncated
            (``*_truncate``) or zeroed outside ``[clip_min, clip_max]`` (``*_mask``).
        log_raw: the raw log-ratio ``log pi_train - log pi_rollout`` (summed over the sequence in sequence
            modes), same shape as ``ratio``, fp32; 0 at padding.
        clipped: bool, same shape: the entry was truncated or masked.
        sequence_level: whether the ratio is per sequence.
    """

    ratio: torch.Tensor
    log_raw: torch.Tensor
    clipped: torch.Tensor
    sequence_level: bool


def importance_sampling_ratio(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> ImportanceRatio:
    """Importance ratio ``pi_train / pi_rollout`` for rollouts sampled from ``pi_rollout``.

    Args:
        train_logps: ``[B, T]`` training-engine log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` rollout-engine log-probabilities (NaN where the engine gave none: such tokens
            get ratio 1, as in trl).
        mask: ``[B, T]`` bool/0-1, the tokens that count.
        mode: one of :data:`IS_MODES`.
        clip_min: lower bound (``None``: unbounded below).
        clip_max: upper bound (``None``: unbounded above).

    Returns:
        :class:`ImportanceRatio`.
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode={mode!r} is not accepted: accepted one of {IS_MODES}")
    if train_logps.shape != rollout_logps.shape or train_logps.shape != mask.shape:
        raise ValueError(
            f"train_logps {tuple(train_logps.shape)}, rollout_logps {tuple(rollout_logps.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [B, T] shape"
        )
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"clip_min={clip_min} must be < clip_max={clip_max}")
    m = mask.to(torch.float32)
    diff = torch.nan_to_num((train_logps.float() - rollout_logps.float()) * m, nan=0.0)
    sequence_level = mode.startswith("sequence")
    log_raw = diff.sum(dim=-1, keepdim=True) if sequence_level else diff
    raw = torch.exp(log_raw)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    outside = (raw < lo) | (raw > hi)
    if mode.endswith("truncate"):
        ratio = raw.clamp(min=clip_min, max=clip_max)
    else:
        ratio = raw.masked_fill(outside, 0.0)
    if not sequence_level:
        outside = outside & mask.bool()
    return ImportanceRatio(ratio=ratio, log_raw=log_raw, clipped=outside, sequence_level=sequence_level)
