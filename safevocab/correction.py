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

from safevocab.validation import not_meta, real

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
        mask: ``[B, T]`` bool or 0/1 values, the tokens that count (any other value is refused: it would scale the
            log-ratio).
        mode: one of :data:`IS_MODES`.
        clip_min: lower bound, a real ``>= 0`` (``None``: unbounded below).
        clip_max: upper bound, a real ``> clip_min`` (``None`` or ``inf``: unbounded above). ``None, None`` leaves the
            ratio unbounded in every mode (``*_truncate`` truncates nothing, ``*_mask`` masks nothing).

    Infinite log-probabilities are taken token by token: a token the training engine gives ``-inf`` has ratio 0, one
    the rollout engine gives ``-inf`` (it sampled a token it calls impossible) has ratio ``+inf`` (truncated or masked
    like any ratio above ``clip_max``), one both give ``-inf`` ratio 1. A sequence holding both of the first two kinds
    has no defined ratio (``0 * inf``): its ``log_raw`` is NaN, its ratio 0 and it counts as clipped, in every mode.

    Returns:
        :class:`ImportanceRatio`.

    Raises:
        ValueError: an unknown ``mode``, shapes that differ, a NaN/negative bound or ``clip_min >= clip_max``, a
            mask value other than 0 or 1 (one line naming the argument).
        TypeError: a bound that is not a real number (``"3"``), inputs that are not tensors.
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode={mode!r} is not accepted: accepted one of {IS_MODES}")
    for name, value in (("train_logps", train_logps), ("rollout_logps", rollout_logps), ("mask", mask)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        not_meta(name, value)
    if train_logps.shape != rollout_logps.shape or train_logps.shape != mask.shape:
        raise ValueError(
            f"train_logps {tuple(train_logps.shape)}, rollout_logps {tuple(rollout_logps.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [B, T] shape"
        )
    if clip_min is not None:
        clip_min = real("clip_min", clip_min, lambda x: x >= 0, "None (unbounded) or a finite ratio >= 0")
    if clip_max is not None:
        clip_max = real(
            "clip_max", clip_max, lambda x: x > 0, "None (unbounded) or a ratio > 0 (inf: unbounded)", finite=False
        )
        if math.isnan(clip_max):
            raise ValueError(f"clip_max={clip_max!r} is out of range: accepted None (unbounded) or a ratio > 0")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"clip_min={clip_min!r} with clip_max={clip_max!r}: accepted clip_min < clip_max")
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"mask has value {mask[where].item()!r} at {where}: accepted a bool mask or 0/1 values")
    valid = mask.bool()
    diff = train_logps.float() - rollout_logps.float()
    # NaN: the rollout engine gave no log-prob (ratio 1, as in trl), or both engines gave -inf. Infinities stay:
    # trl's nan_to_num turned them into +-3.4e38, which cancel in a sequence's sum (ratio 1, unclipped)
    diff = torch.where(valid & ~torch.isnan(diff), diff, 0.0)
    sequence_level = mode.startswith("sequence")
    log_raw = diff.sum(dim=-1, keepdim=True) if sequence_level else diff
    raw = torch.exp(log_raw)
    undefined = torch.isnan(raw)  # a sequence with a ratio-0 and a ratio-inf token
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    outside = (raw < lo) | (raw > hi) | undefined
    if mode.endswith("truncate"):
        ratio = raw.clamp(min=lo, max=hi).masked_fill(undefined, 0.0)
    else:
        ratio = raw.masked_fill(outside, 0.0)
    if not sequence_level:
        outside = outside & valid
    return ImportanceRatio(ratio=ratio, log_raw=log_raw, clipped=outside, sequence_level=sequence_level)
