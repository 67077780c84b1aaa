"""Reduction of per-process metric values across processes (count-weighted means, max/min, ESS)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def reduction(name: str) -> str:
    """How a metric is combined across processes, read from its name.

    Args:
        name: the metric key.

    Returns:
        ``"max"`` for names ending in ``_max`` or ``/max``, ``"min"`` for ``_min`` or ``/min``, else ``"mean"``.
    """
    if name.endswith(("_max", "/max")):
        return "max"
    if name.endswith(("_min", "/min")):
        return "min"
    return "mean"


#: The normalised effective sample size and the mean whose sums it is rebuilt from (`reduce_gathered`).
_ESS_KEY, _ESS_MEAN_KEY = "mismatch/is_ess", "mismatch/is_mean"


def reduce_gathered(names: Sequence[str], values: torch.Tensor, counts: torch.Tensor | None = None) -> dict[str, float]:
    """Combine per-process metric values into the value of the whole (all-process) batch.

    ``values[p, k]`` is metric ``names[k]`` computed by process ``p`` on its share of the batch and
    ``counts[p, k]`` the number of items it is computed over (from the ``*_metrics`` functions with
    ``return_counts=True``). Per metric, by `reduction` of its name:

    - ``"mean"``: ``sum_p c_p v_p / sum_p c_p``, the mean over all items, not the mean of the per-process means
      (which would depend on how the batch was split when the processes hold different numbers of tokens);
    - ``"max"`` / ``"min"``: the max / min over the processes;
    - ``mismatch/is_ess`` = ``(sum w)^2 / (n sum w^2)`` is not a mean: it is rebuilt from each process's sums,
      ``sum w = n * is_mean`` and ``sum w^2 = n * is_mean^2 / is_ess`` (``0`` when ``is_ess`` is undefined on a
      process that counts entries: all its ratios are 0), when ``mismatch/is_mean`` is among ``names``.

    Processes with a NaN value or a zero count are left out of a metric. A metric left out everywhere is
    absent from the result.

    Args:
        names: the ``K`` metric keys.
        values: ``[P, K]`` per-process values (any float dtype; combined in float64).
        counts: ``[P, K]`` per-process counts, or ``None`` for equal weights (a plain mean over processes).

    Returns:
        ``{name: float}`` for the metrics defined on at least one process.

    Raises:
        ValueError: on shapes that do not match ``names``.
    """
    names = list(names)
    values = torch.as_tensor(values).detach().to("cpu", torch.float64)
    if values.dim() != 2 or values.shape[1] != len(names):
        raise ValueError(f"values has shape {tuple(values.shape)}: accepted [P, K] with K = len(names) = {len(names)}")
    counts = torch.ones_like(values) if counts is None else torch.as_tensor(counts).detach().to("cpu", torch.float64)
    if counts.shape != values.shape:
        raise ValueError(f"counts has shape {tuple(counts.shape)}: accepted the shape of values {tuple(values.shape)}")
    if values.shape[0] <= 2:  # one process (a row or two): the same sums in plain Python, a fraction of the ops
        return _reduce_rows(names, values.tolist(), counts.tolist())
    # All columns at once (one pass of tensor ops, then one conversion to Python): this runs every step.
    ok = (counts > 0) & ~torch.isnan(values)
    defined = ok.any(dim=0).tolist()
    weights = torch.where(ok, counts, 0.0)
    means = (torch.where(ok, values, 0.0) * weights).sum(dim=0) / weights.sum(dim=0)
    maxima = torch.where(ok, values, -math.inf).amax(dim=0)
    minima = torch.where(ok, values, math.inf).amin(dim=0)
    how = [reduction(name) for name in names]
    reduced = torch.stack([means, maxima, minima]).tolist()
    pick = {"mean": 0, "max": 1, "min": 2}
    out = {name: reduced[pick[h]][j] for j, (name, h) in enumerate(zip(names, how)) if defined[j]}
    if _ESS_KEY in names and _ESS_MEAN_KEY in names:
        out.pop(_ESS_KEY, None)
        j = names.index(_ESS_KEY)
        n, mean, ess = counts[:, j], values[:, names.index(_ESS_MEAN_KEY)], values[:, j]
        keep = (n > 0) & ~torch.isnan(mean)
        n, mean, ess = n[keep], mean[keep], ess[keep]
        sum_w = n * mean
        sum_w2 = torch.where(torch.isnan(ess) | (ess <= 0), 0.0, n * mean.square() / ess)
        if bool(keep.any()) and bool(sum_w2.sum() > 0):
            out[_ESS_KEY] = float(sum_w.sum().square() / (n.sum() * sum_w2.sum()))
    return out


def _reduce_rows(names: list[str], values: list[list[float]], counts: list[list[float]]) -> dict[str, float]:
    """`reduce_gathered` of at most two rows, in Python floats: the same float64 operations in the same order."""
    out: dict[str, float] = {}
    for j, name in enumerate(names):
        kept = [(v[j], c[j]) for v, c in zip(values, counts) if c[j] > 0 and not math.isnan(v[j])]
        if not kept:
            continue
        how = reduction(name)
        if how == "max":
            out[name] = max(v for v, _ in kept)
        elif how == "min":
            out[name] = min(v for v, _ in kept)
        else:
            out[name] = sum(v * c for v, c in kept) / sum(c for _, c in kept)
    if _ESS_KEY in names and _ESS_MEAN_KEY in names:
        out.pop(_ESS_KEY, None)
        j, k = names.index(_ESS_KEY), names.index(_ESS_MEAN_KEY)
        rows = [(c[j], v[k], v[j]) for v, c in zip(values, counts) if c[j] > 0 and not math.isnan(v[k])]
        sum_w = sum(n * mean for n, mean, _ in rows)
        sum_w2 = sum(0.0 if math.isnan(ess) or ess <= 0 else n * (mean * mean) / ess for n, mean, ess in rows)
        if rows and sum_w2 > 0:
            out[_ESS_KEY] = sum_w * sum_w / (sum(n for n, _, _ in rows) * sum_w2)
    return out
