"""The trainer-side groups of a batch's metric row and the table the trainer gathers across processes.

A batch's metrics are one :class:`~safevocab.mismatch.MetricRow` (built by
:meth:`trl_integration.grpo.step.StepMetricInputs.row`): every value with the number of items it averages over, so
that the reduction over processes and micro-batches (:func:`safevocab.mismatch.reduce_gathered`) is the value of
the whole batch, not a mean of means. Most groups come from :mod:`safevocab.mismatch`; the two here are the
trainer's own:

- ``safevocab/masked_token_frac = |n & ~keep| / |n|`` over the counted tokens ``n``;
- trl's ``sampling/*`` metrics (``|log pi - log mu|`` and the importance ratio), which trl logs only on its vLLM
  path, over the loss tokens.

These run every training step on small tensors, where each torch call costs more than its arithmetic: each group is
a few stacked reductions into one vector, the groups are concatenated, and a row stays two vectors until
:func:`metric_rows` reads it back, once per batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from safevocab.correction import ImportanceRatio
from safevocab.mismatch import reduce_gathered
from safevocab.mismatch.common import masked_max_min
from safevocab.mismatch.row import MetricRow, counts_vector

#: Metric: share of the counted tokens that the out-of-set masking removed from the loss.
MASKED_TOKEN_FRAC = "safevocab/masked_token_frac"

#: trl's ``sampling/*`` metrics, in the order of :func:`trl_sampling_row`'s values.
_SAMPLING_KEYS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def metric_rows(rows: list[MetricRow | tuple[dict, dict]]) -> tuple[list[str], torch.Tensor]:
    """``(names, table)``: the metric names of ``rows`` (first-seen order) and a CPU float64 ``[rows, 2, names]``
    table of each row's values (NaN where a row lacks the metric) and counts (1 where it has none), ready for one
    gather across processes and :func:`safevocab.mismatch.reduce_gathered`. A row is a :class:`MetricRow` or a
    ``(values, counts)`` pair of dictionaries."""
    rows = [row if isinstance(row, MetricRow) else MetricRow.from_dicts(*row) for row in rows]
    names = list(dict.fromkeys(name for row in rows for name in row.names))
    table = torch.empty(len(rows), 2, len(names), dtype=torch.float64)
    table[:, 0], table[:, 1] = float("nan"), 1.0
    for i, row in enumerate(rows):
        pair = torch.stack([row.values.double(), row.counts.double()]).cpu()
        if list(row.names) == names:
            table[i] = pair
        else:
            table[i, :, [names.index(n) for n in row.names]] = pair
    return names, table


def reduce_across_processes(
    rows: list[MetricRow | tuple[dict, dict]], gather: Callable[[torch.Tensor], torch.Tensor], device: torch.device
) -> dict[str, float]:
    """The values of the whole batch from each process's local metric rows (of a batch, or of each of its
    micro-batches): one ``gather`` (e.g. ``accelerator.gather``, which concatenates the processes' tables) of the
    :func:`metric_rows` table, then :func:`safevocab.mismatch.reduce_gathered` (count-weighted means, max, min).

    Every process gets the same values, equal to what one process would compute on the whole batch. A metric
    without a count weighs every row equally. NaN (undefined here) values and zero counts are ignored; a metric
    undefined everywhere is left out. Returns ``{name: value}`` in the rows' order of names.
    """
    names, table = metric_rows(rows) if rows else ([], None)
    if not names:
        return {}
    # float64 (exact counts, full-precision weighted sums), except where the device has none (MPS).
    dtype = torch.float32 if device.type == "mps" else torch.float64
    gathered = gather(table.to(device=device, dtype=dtype))
    reduced = reduce_gathered(names, gathered[:, 0], gathered[:, 1])
    return {name: reduced[name] for name in names if name in reduced}


def masked_token_row(counted: torch.Tensor, keep: torch.Tensor) -> MetricRow:
    """``safevocab/masked_token_frac`` (share of the ``counted`` tokens not kept) over the counted tokens, from
    ``[..., B, T]`` bool masks (leading dimensions give one row per batch of a stack)."""
    n = counted.sum(dim=(-2, -1))
    frac = (counted & ~keep).sum(dim=(-2, -1)).double() / n  # 0/0 = NaN when nothing counts
    return MetricRow((MASKED_TOKEN_FRAC,), frac.float().unsqueeze(-1), n.double().unsqueeze(-1))


def trl_sampling_row(
    train_logps: torch.Tensor, rollout_logps: torch.Tensor, ratio: ImportanceRatio, mask: torch.Tensor
) -> MetricRow:
    """trl's ``sampling/*`` metrics (post-truncation), which trl logs only on the vLLM path: ``|log pi - log mu|``
    over the loss tokens with a rollout log-probability, the ratio over its entries (every sequence's at sequence
    level, the loss tokens' at token level); ``[..., B, T]`` inputs, leading dimensions give one row per batch."""
    m = mask.bool() & ~torch.isnan(rollout_logps)
    delta = (train_logps - rollout_logps).abs().double()  # the difference in the log-probabilities' dtype, as trl
    r = ratio.ratio.double()
    r_mask = torch.ones_like(r, dtype=torch.bool) if ratio.sequence_level else mask.bool()
    n_delta, n_ratio = m.sum(dim=(-2, -1)), r_mask.sum(dim=(-2, -1))
    (delta_max,), _ = masked_max_min([delta], m, dims=2)
    (r_max,), (r_min,) = masked_max_min([r], r_mask, dims=2)
    sum_delta = torch.where(m, delta, 0.0).sum(dim=(-2, -1))
    sum_r = torch.where(r_mask, r, 0.0).sum(dim=(-2, -1))
    values = torch.stack([sum_delta / n_delta, delta_max, r_min, sum_r / n_ratio, r_max], dim=-1).float()
    return MetricRow(_SAMPLING_KEYS, values, counts_vector((0, 0, 1, 1, 1), n_delta, n_ratio))
