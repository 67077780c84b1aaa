"""Safe-vocabulary and training–inference mismatch metrics (pure tensor functions, no trl).

Every function takes local ``[B, T]`` tensors and a mask and returns ``{name: 0-dim fp32 tensor}``. A value is NaN
when it is undefined on this batch (e.g. an empty probability bucket). Names ending in ``_max`` / ``_min`` (or
``/max``, ``/min``) are reduced across processes with max / min, all others with the mean (see :func:`reduction`).

Mismatch definitions follow verl's rollout correction (``rollout_corr_helper.compute_offpolicy_metrics``), with
``log r = log pi_train(y) - log pi_rollout(y)`` per sampled token (see docs/metrics.md for the formulas).
This module is self-contained so that it can move to ``safevocab.mismatch`` unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from safevocab.bounds import sequence_kl, sequence_tv

__all__ = [
    "DEFAULT_BUCKETS",
    "LOG_RATIO_BOUND",
    "bucket_names",
    "reduction",
    "safe_set_metrics",
    "mismatch_metrics",
    "bucket_mismatch_metrics",
    "importance_ratio_metrics",
]

#: Default edges of the probability buckets of :func:`bucket_mismatch_metrics`.
DEFAULT_BUCKETS: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 0.5)

#: Log-ratios are clamped to +-this before exponentiation in chi^2 and raw-ratio statistics (verl's SAFETY_BOUND).
LOG_RATIO_BOUND = 20.0

_NAN = float("nan")


def reduction(name: str) -> str:
    """How a metric is combined across processes: ``"max"``, ``"min"`` or ``"mean"`` (by its name)."""
    if name.endswith(("_max", "/max")):
        return "max"
    if name.endswith(("_min", "/min")):
        return "min"
    return "mean"


def _scalar(x: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32).detach().reshape(())


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum()
    if n == 0:
        return _scalar(_NAN)
    return _scalar((x.double() * mask).sum() / n)


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    vals = x[mask.bool()]
    if vals.numel() == 0:
        return _scalar(_NAN)
    return _scalar(vals.max() if largest else vals.min())


def _check(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    for t in tensors:
        if t.shape != mask.shape:
            raise ValueError(f"tensor of shape {tuple(t.shape)} does not match mask shape {tuple(mask.shape)}")
    if mask.dim() != 2:
        raise ValueError(f"mask has shape {tuple(mask.shape)}: expected [B, T]")
    return mask.to(torch.bool)


def safe_set_metrics(
    in_safe: torch.Tensor, log_kept_mass: torch.Tensor, safe_size: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Statistics of the safe set at the sampled positions.

    Args:
        in_safe: ``[B, T]`` bool, the sampled token is in the trainer's safe set.
        log_kept_mass: ``[B, T]`` ``log(1 - m_t)``.
        safe_size: ``[B, T]`` ``|S_t|``.
        mask: ``[B, T]`` the completion tokens (before any out-of-set masking).

    Returns:
        ``safevocab/out_of_set_frac``, ``pruned_mass_mean``, ``pruned_mass_max``, ``safe_size_mean``,
        ``seq_tv_estimate`` (``1 - mean_b prod_t (1 - m_t)``), ``seq_kl_estimate`` (``mean_b sum_t -log(1 - m_t)``).
    """
    mask = _check(mask, in_safe, log_kept_mass, safe_size)
    m = mask.double()
    log_kept = log_kept_mass.double().clamp(max=0.0) * m
    pruned = -torch.expm1(log_kept)  # m_t, exactly 0 at padding
    if mask.shape[0] == 0:
        seq_tv = seq_kl = _scalar(_NAN)
    else:
        # With rows drawn from the pruned sampler Q, the plain mean over rows of 1 - prod_t (1 - m_t) is an
        # unbiased estimate of TV(P, Q) (DESIGN section 4); padding counts as kept mass 1.
        kept = log_kept.exp()
        seq_tv = _scalar(sequence_tv(kept, mask))
        seq_kl = _scalar(sequence_kl(kept, mask))
    return {
        "safevocab/out_of_set_frac": _masked_mean((~in_safe.bool()).double(), m),
        "safevocab/pruned_mass_mean": _masked_mean(pruned, m),
        "safevocab/pruned_mass_max": _masked_extreme(pruned, mask, largest=True),
        "safevocab/safe_size_mean": _masked_mean(safe_size.double(), m),
        "safevocab/seq_tv_estimate": seq_tv,
        "safevocab/seq_kl_estimate": seq_kl,
    }


def mismatch_metrics(
    train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Training–inference mismatch on the sampled tokens (verl's definitions, prefix ``mismatch/``).

    Tokens whose rollout log-probability is NaN (not reported by the engine) are left out.

    Returns:
        ``kl``, ``k3_kl``, ``training_ppl``, ``rollout_ppl``, ``log_ppl_diff``, ``log_ppl_abs_diff``,
        ``log_ppl_diff_max``, ``log_ppl_diff_min``, ``ppl_ratio``, ``chi2_token``, ``chi2_seq``,
        ``abs_logp_diff_mean``, ``abs_logp_diff_max``.
    """
    mask = _check(mask, train_logps, rollout_logps)
    mask = mask & ~torch.isnan(rollout_logps) & ~torch.isnan(train_logps)
    m = mask.double()
    train = torch.where(mask, train_logps.double(), 0.0)
    rollout = torch.where(mask, rollout_logps.double(), 0.0)
    log_r = train - rollout
    log_r_safe = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)

    counts = m.sum(-1)
    rows = counts > 0
    if bool(rows.any()):
        mean_train = (train * m).sum(-1)[rows] / counts[rows]
        mean_rollout = (rollout * m).sum(-1)[rows] / counts[rows]
        log_ppl_diff = mean_rollout - mean_train
        seq_log_r = (log_r * m).sum(-1)[rows].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        seq = {
            "mismatch/training_ppl": _scalar(torch.exp(-mean_train).mean()),
            "mismatch/rollout_ppl": _scalar(torch.exp(-mean_rollout).mean()),
            "mismatch/log_ppl_diff": _scalar(log_ppl_diff.mean()),
            "mismatch/log_ppl_abs_diff": _scalar(log_ppl_diff.abs().mean()),
            "mismatch/log_ppl_diff_max": _scalar(log_ppl_diff.max()),
            "mismatch/log_ppl_diff_min": _scalar(log_ppl_diff.min()),
            "mismatch/ppl_ratio": _scalar(torch.exp(log_ppl_diff).mean()),
            "mismatch/chi2_seq": _scalar(torch.exp(2.0 * seq_log_r).mean() - 1.0),
        }
    else:
        seq = {
            k: _scalar(_NAN)
            for k in (
                "mismatch/training_ppl",
                "mismatch/rollout_ppl",
                "mismatch/log_ppl_diff",
                "mismatch/log_ppl_abs_diff",
                "mismatch/log_ppl_diff_max",
                "mismatch/log_ppl_diff_min",
                "mismatch/ppl_ratio",
                "mismatch/chi2_seq",
            )
        }
    out = {
        "mismatch/kl": _masked_mean(rollout - train, m),
        "mismatch/k3_kl": _masked_mean(torch.exp(log_r_safe) - log_r_safe - 1.0, m),
        "mismatch/chi2_token": _masked_mean(torch.exp(2.0 * log_r_safe), m) - 1.0,
        "mismatch/abs_logp_diff_mean": _masked_mean(log_r.abs(), m),
        "mismatch/abs_logp_diff_max": _masked_extreme(log_r.abs(), mask, largest=True),
    }
    out.update(seq)
    return out


def _edge(x: float) -> str:
    return f"{x:g}"


def bucket_names(edges: Sequence[float]) -> list[str]:
    """Bucket labels ``"p=lo-hi"`` for the buckets ``[0, e_1), [e_1, e_2), ..., [e_k, 1]``."""
    bounds = [0.0, *edges, 1.0]
    return [f"p={_edge(lo)}-{_edge(hi)}" for lo, hi in zip(bounds[:-1], bounds[1:])]


def bucket_mismatch_metrics(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    edges: Sequence[float] = DEFAULT_BUCKETS,
) -> dict[str, torch.Tensor]:
    """Mismatch by the training probability ``p = exp(train_logps)`` of the sampled token.

    For each bucket ``b = [lo, hi)`` (the last one closed) returns ``mismatch/abs_diff/p=lo-hi`` (mean
    ``|log r|``), ``mismatch/diff/p=lo-hi`` (mean signed ``log r``: its sign shows the direction of the bias)
    and ``mismatch/token_frac/p=lo-hi`` (share of the tokens in the bucket). Empty buckets give NaN for the
    first two.
    """
    mask = _check(mask, train_logps, rollout_logps)
    edges = [float(e) for e in edges]
    if any(not (0.0 < e < 1.0) for e in edges) or any(a >= b for a, b in zip(edges[:-1], edges[1:])):
        raise ValueError(f"edges={edges}: accepted strictly increasing values in (0, 1)")
    mask = mask & ~torch.isnan(rollout_logps) & ~torch.isnan(train_logps)
    train = torch.where(mask, train_logps.double(), 0.0)
    log_r = train - torch.where(mask, rollout_logps.double(), 0.0)
    p = train.exp()
    total = mask.sum()
    bounds = [0.0, *edges, math.inf]
    out: dict[str, torch.Tensor] = {}
    for name, lo, hi in zip(bucket_names(edges), bounds[:-1], bounds[1:]):
        in_bucket = mask & (p >= lo) & (p < hi)
        w = in_bucket.double()
        out[f"mismatch/abs_diff/{name}"] = _masked_mean(log_r.abs(), w)
        out[f"mismatch/diff/{name}"] = _masked_mean(log_r, w)
        out[f"mismatch/token_frac/{name}"] = _scalar(in_bucket.sum() / total) if total > 0 else _scalar(_NAN)
    return out


def importance_ratio_metrics(
    log_raw: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Statistics of an importance-sampling correction, before and after truncation/masking.

    Args:
        log_raw: raw log-ratio ``[B, T]`` (token level) or ``[B, 1]`` (sequence level).
        ratio: the corrected ratio, same shape.
        clipped: bool, same shape, the entry was truncated or masked.
        mask: ``[B, T]`` the tokens that count (a sequence counts when it has one).

    Returns:
        ``mismatch/is_raw_mean``, ``is_raw_min``, ``is_raw_max`` (pre-truncation), ``is_mean``, ``is_min``,
        ``is_max`` (post), ``is_clipped_frac`` (share of tokens or sequences truncated or masked) and ``is_ess``
        (normalised effective sample size ``(sum w)^2 / (n sum w^2)`` of the corrected ratios).
    """
    mask = mask.to(torch.bool)
    valid = mask if log_raw.shape == mask.shape else mask.any(dim=-1, keepdim=True)
    if log_raw.shape != valid.shape or ratio.shape != valid.shape or clipped.shape != valid.shape:
        raise ValueError(
            f"log_raw {tuple(log_raw.shape)}, ratio {tuple(ratio.shape)} and clipped {tuple(clipped.shape)} must be "
            f"[B, T] or [B, 1] for mask {tuple(mask.shape)}"
        )
    raw = torch.exp(log_raw.double().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    w = ratio.double()
    v = valid.double()
    n = v.sum()
    sum_w = (w * v).sum()
    sum_w2 = (w.square() * v).sum()
    ess = _scalar(sum_w.square() / (n * sum_w2)) if n > 0 and sum_w2 > 0 else _scalar(_NAN)
    return {
        "mismatch/is_raw_mean": _masked_mean(raw, v),
        "mismatch/is_raw_min": _masked_extreme(raw, valid, largest=False),
        "mismatch/is_raw_max": _masked_extreme(raw, valid, largest=True),
        "mismatch/is_mean": _masked_mean(w, v),
        "mismatch/is_min": _masked_extreme(w, valid, largest=False),
        "mismatch/is_max": _masked_extreme(w, valid, largest=True),
        "mismatch/is_clipped_frac": _masked_mean(clipped.double(), v),
        "mismatch/is_ess": ess,
    }
