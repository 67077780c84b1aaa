"""Importance-ratio bands and shares below the rule's cut: metrics that the engine-vs-trainer comparison
(:func:`~trl_integration.lab.engine.run_diagnose`) and the batch-shape control (:mod:`trl_integration.lab.batch_shape`)
report in the same way.

For each scored token ``y``, ``log r = log pi(y) - log mu(y)`` and ``r = exp(log r)`` (float64). ``pi`` is the
reference side: in the comparison, the training side; in the control, the pair's first shape. Then:

- ``frac_ratio_outside_{lo}_{hi} = mean 1[r < lo or r > hi]`` for each band ``[lo, hi]`` of :data:`RATIO_BANDS`,
  ``[0.9, 1.1]`` (trl issue 6789's measure) and ``[0.8, 1.25]`` (``|log r| > log 1.25``, symmetric in ``log r``);
  the bounds are printed with ``%g``, so the keys are ``frac_ratio_outside_0.9_1.1`` and
  ``frac_ratio_outside_0.8_1.25``.

With a rule, ``O`` is the set of scored tokens outside the reference side's safe set (below the cut, the tokens DVP
masks out of the loss), and :func:`cut_shares` gives how much of each quantity those tokens carry:

- ``abs_diff_share_outside = sum_O |log r| / sum |log r|``;
- ``ratio_outside_{lo}_{hi}_share_outside = #(O and r outside [lo, hi]) / #(r outside [lo, hi])``;
- ``bucket_abs_diff_share_outside``: per training-probability bucket, ``sum_{O, bucket} |log r| / sum_bucket |log r|``.

Each share is ``None`` when its denominator is 0 (no gap, no token outside the band, an empty bucket).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["RATIO_BANDS", "band_name", "outside_band", "ratio_band_fracs", "cut_shares"]

#: The importance-ratio bands ``[lo, hi]`` whose outside share is reported.
RATIO_BANDS: tuple[tuple[float, float], ...] = ((0.9, 1.1), (0.8, 1.25))


def band_name(lo: float, hi: float) -> str:
    """``"0.9_1.1"`` for the band ``[0.9, 1.1]`` (the bounds printed with ``%g``)."""
    return f"{lo:g}_{hi:g}"


def outside_band(log_r: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Bool ``r < lo or r > hi`` per token, ``r = exp(log r)`` in float64."""
    r = log_r.double().exp()
    return (r < lo) | (r > hi)


def ratio_band_fracs(log_r: torch.Tensor) -> dict[str, float | None]:
    """``{"frac_ratio_outside_{lo}_{hi}": share}`` for each band of :data:`RATIO_BANDS` (``None`` for no token)."""
    n = log_r.numel()
    return {
        f"frac_ratio_outside_{band_name(lo, hi)}": float(outside_band(log_r, lo, hi).double().mean()) if n else None
        for lo, hi in RATIO_BANDS
    }


def _share(part: torch.Tensor, whole: torch.Tensor) -> float | None:
    total = float(whole.sum())
    return float(part.sum()) / total if total else None


def cut_shares(
    log_r: torch.Tensor, outside: torch.Tensor, p: torch.Tensor, edges: Sequence[float]
) -> dict[str, float | list[float | None] | None]:
    """The shares of the gap and of the out-of-band tokens carried by the tokens ``outside`` the safe set.

    Args:
        log_r: ``[N]`` ``log pi - log mu`` per scored token.
        outside: ``[N]`` bool, the token is outside the reference side's safe set.
        p: ``[N]`` reference probability ``pi(y)``, for the buckets.
        edges: inner bucket edges (the buckets ``[0, e_1), ..., [e_k, 1]``).

    Returns:
        ``abs_diff_share_outside``, ``ratio_outside_{lo}_{hi}_share_outside`` per band and
        ``bucket_abs_diff_share_outside`` (a list, one share per bucket); see the module docstring.
    """
    gap = log_r.double().abs()
    out = outside.bool()
    shares: dict[str, float | list[float | None] | None] = {"abs_diff_share_outside": _share(gap[out], gap)}
    for lo, hi in RATIO_BANDS:
        off = outside_band(log_r, lo, hi).double()
        shares[f"ratio_outside_{band_name(lo, hi)}_share_outside"] = _share(off[out], off)
    which = torch.bucketize(p.double(), torch.tensor(list(edges), dtype=torch.float64), right=True)
    shares["bucket_abs_diff_share_outside"] = [
        _share(gap[out & (which == j)], gap[which == j]) for j in range(len(edges) + 1)
    ]
    return shares
