"""Constants and masked-reduction helpers shared by the mismatch formulas and metric dictionaries."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from safevocab.validation import float_tensor

#: Default edges of the probability buckets of `bucket_mismatch` / `bucket_mismatch_metrics`.
DEFAULT_BUCKETS: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 0.5)

#: Log-ratios are clamped to +-this before exponentiation in chi^2, k3 and raw-ratio statistics (verl's SAFETY_BOUND).
LOG_RATIO_BOUND = 20.0

NAN = float("nan")


def as_scalar(x: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32).detach().reshape(())


# The metrics run every training step on small tensors, where each torch call costs more than its arithmetic:
# the helpers below are branch-free (no host sync on a GPU) and compute several statistics per call.


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the 0/1 weights ``mask``; NaN (0/0) when nothing counts."""
    return as_scalar((x.double() * mask).sum() / mask.sum())


def masked_max(x: torch.Tensor, mask: torch.Tensor, dims: int | None = None) -> torch.Tensor:
    """Max of ``x`` over the bool ``mask`` in ``x``'s dtype; NaN when nothing counts. Reduces the last ``dims``
    dimensions (default: all, a 0-dim result); the leading ones stay (e.g. a stack of batches)."""
    dims = mask.dim() if dims is None else dims
    if x.numel() == 0:
        return torch.full(x.shape[: x.dim() - dims], NAN, dtype=x.dtype, device=x.device)
    masked = torch.where(mask, x, -math.inf)
    return torch.where(_flat(mask, dims).any(-1), _flat(masked, dims).amax(-1), NAN)


def masked_max_min(
    xs: Sequence[torch.Tensor], mask: torch.Tensor, dims: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([K, ...] maxima, [K, ...] minima)`` of each of the ``K`` tensors ``xs`` (each of ``mask``'s shape) over the
    bool ``mask``, in one reduction (the max over ``[x_1..x_K, -x_1..-x_K]``); NaN where nothing counts. Reduces the
    last ``dims`` dimensions (default: all); the leading ones stay."""
    k = len(xs)
    dims = mask.dim() if dims is None else dims
    if mask.numel() == 0:
        nan = torch.full((k, *mask.shape[: mask.dim() - dims]), NAN, dtype=xs[0].dtype, device=xs[0].device)
        return nan, nan
    signed = _flat(torch.where(mask, torch.stack([*xs, *(-x for x in xs)]), -math.inf), dims).amax(-1)
    signed = torch.where(_flat(mask, dims).any(-1), signed, NAN)
    return signed[:k], -signed[k:]


def _flat(x: torch.Tensor, dims: int) -> torch.Tensor:
    """``x`` with its last ``dims`` dimensions flattened into one (a new one of size 1 when ``dims`` is 0)."""
    return x.unsqueeze(-1) if dims == 0 else x.flatten(-dims)


def masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (``largest``) or min of ``x`` over ``mask`` as a 0-dim fp32 tensor; NaN when nothing counts."""
    mask = mask.bool()
    return as_scalar(masked_max(x, mask) if largest else -masked_max(-x, mask))


def check_mask(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    for t in tensors:
        if t.shape != mask.shape:
            raise ValueError(f"tensor of shape {tuple(t.shape)} does not match mask shape {tuple(mask.shape)}")
    if mask.dim() != 2:
        raise ValueError(f"mask has shape {tuple(mask.shape)}: expected [B, T]")
    return mask.to(torch.bool)


def paired_log_ratio(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor):
    """Validated float64 ``(train, rollout, log_r, mask)`` with NaN tokens removed from the mask and zeroed."""
    float_tensor("train_logps", train_logps)
    float_tensor("rollout_logps", rollout_logps)
    return zero_filled_pair(train_logps, rollout_logps, check_mask(mask, train_logps, rollout_logps))


def zero_filled_pair(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor):
    """`paired_log_ratio` on inputs already checked (bool ``mask``; any leading dimensions, e.g. a stack of
    batches ``[S, B, T]``)."""
    mask = mask & ~torch.isnan(rollout_logps) & ~torch.isnan(train_logps)
    train = torch.where(mask, train_logps.double(), 0.0)
    rollout = torch.where(mask, rollout_logps.double(), 0.0)
    return train, rollout, train - rollout, mask


def check_edges(edges: Sequence[float]) -> list[float]:
    edges = [float(e) for e in edges]
    if any(not (0.0 < e < 1.0) for e in edges) or any(a >= b for a, b in zip(edges[:-1], edges[1:])):
        raise ValueError(f"edges={edges}: accepted strictly increasing values in (0, 1)")
    return edges


def bucket_names(edges: Sequence[float]) -> list[str]:
    """Labels of the probability buckets ``[0, e_1), [e_1, e_2), ..., [e_k, 1]``.

    Args:
        edges: the inner bucket edges, strictly increasing in ``(0, 1)``.

    Returns:
        ``["p=0-e_1", "p=e_1-e_2", ..., "p=e_k-1"]``, the edges printed with ``%g``.
    """
    bounds = [0.0, *edges, 1.0]
    return [f"p={lo:g}-{hi:g}" for lo, hi in zip(bounds[:-1], bounds[1:])]
