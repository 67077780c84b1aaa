"""A metric row: named values and the number of items each averages over, as two ``[K]`` vectors.

The metrics run every training step on small tensors, where each torch call costs more than its arithmetic: a
group of metrics is computed with a few stacked reductions into one vector and stays one vector on its way to the
logger (one tensor per row, not one 0-dim tensor per metric). ``counts[k]`` is the number of items ``values[k]``
is computed over (tokens, sequences, ratio entries), by which `reduce_gathered` weighs means across processes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MetricRow:
    """Metric values and their item counts.

    Attributes:
        names: the ``K`` metric keys.
        values: ``[K]`` fp32 values (NaN where undefined); ``[..., K]`` for a stack of batches (one row each).
        counts: ``[K]`` (``[..., K]``) float64 number of items each value is computed over.
    """

    names: tuple[str, ...]
    values: torch.Tensor
    counts: torch.Tensor

    def dicts(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(metrics, counts)`` as ``{name: 0-dim tensor}`` views of the two vectors (the ``return_counts`` form)."""
        if self.values.dim() != 1:
            raise ValueError(f"values has shape {tuple(self.values.shape)}: dicts() takes one row, [K]")
        return dict(zip(self.names, self.values.unbind())), dict(zip(self.names, self.counts.unbind()))

    def select(self, names: Sequence[str], rename: Sequence[str] | None = None) -> MetricRow:
        """The metrics ``names`` of this row, in that order, optionally under the new names ``rename``."""
        index = _index(tuple(self.names.index(n) for n in names), self.values.device)
        values, counts = self.values.index_select(-1, index), self.counts.index_select(-1, index)
        return MetricRow(tuple(rename or names), values, counts)

    def unstack(self) -> list[MetricRow]:
        """The rows of a ``[S, K]`` stack, one per batch."""
        return [MetricRow(self.names, v, c) for v, c in zip(self.values.unbind(), self.counts.unbind())]

    @classmethod
    def cat(cls, rows: Iterable[MetricRow]) -> MetricRow:
        """One row holding the metrics of ``rows`` (whose names must not repeat)."""
        rows = list(rows)
        if len(rows) == 1:
            return rows[0]
        names = tuple(n for row in rows for n in row.names)
        if len(set(names)) != len(names):
            raise ValueError(f"names={names}: accepted rows without a repeated metric name")
        return cls(names, torch.cat([r.values for r in rows], dim=-1), torch.cat([r.counts for r in rows], dim=-1))

    @classmethod
    def from_dicts(cls, metrics: dict, counts: dict) -> MetricRow:
        """A row from ``{name: value}`` and ``{name: count}`` (0-dim tensors or numbers; a missing count is 1)."""
        names = tuple(metrics)
        return cls(
            names,
            _vector([metrics[n] for n in names], torch.float32),
            _vector([counts.get(n, 1.0) for n in names], torch.float64),
        )


def counts_vector(pattern: tuple[int, ...], *counts: torch.Tensor | int) -> torch.Tensor:
    """``[..., K]`` float64 counts, ``counts[pattern[k]]`` for metric ``k`` (e.g. tokens for the token metrics,
    sequences for the sequence metrics of a group); each count a ``[...]`` tensor (one per batch of a stack) or
    a number."""
    tensors = [c for c in counts if isinstance(c, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    shape = tensors[0].shape if tensors else torch.Size()
    base = torch.stack([torch.as_tensor(c, dtype=torch.float64, device=device).expand(shape) for c in counts], dim=-1)
    return base.index_select(-1, _index(pattern, device))


@functools.lru_cache(maxsize=256)
def _index(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # A fixed index per metric group and device, made once (making a small tensor costs more than using it); made
    # outside inference mode so that it can be used in and out of it.
    with torch.inference_mode(False):
        return torch.tensor(order, dtype=torch.int64, device=device)


def _vector(items: list, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor from 0-dim tensors and numbers: one ``torch.tensor`` on CPU (reading a CPU scalar costs less than
    stacking it), one stack (one transfer, no host sync per value) on an accelerator."""
    devices = [x.device for x in items if isinstance(x, torch.Tensor) and x.device.type != "cpu"]
    if not devices:
        return torch.tensor([float(x) for x in items], dtype=dtype)
    return torch.stack([torch.as_tensor(x, dtype=dtype, device=devices[0]).reshape(()) for x in items])
