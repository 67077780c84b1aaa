"""The trainer's metrics of several generation batches, computed and reduced together when trl reads them.

Every generation batch has a metric row (:meth:`~trl_integration.grpo.step.StepMetricInputs.row`, about fifty
values). On a small model each torch call costs more than its arithmetic, so computing a row per batch costs about
1 ms a step (1.5 % of the bundled job's step); stacked, the rows of ``S`` batches cost the same calls once. The
queue keeps each batch's inputs (:class:`~trl_integration.grpo.step.StepMetricInputs`, references to tensors
the batch holds anyway) and, when trl is about to read its metric store (``log``) or the queue is full, computes
the rows of all its batches at once, reduces each batch's rows across processes and appends the values to trl's
store in batch order: the same values trl logs, later in the step.

Stacking: batches of the same shape of inputs (settings, rows ``B``, which optional tensors they carry) are padded
to the longest completion ``T`` with positions that no metric counts (masks off, log-probabilities 0, ratio 1) and
stacked to ``[S, B, T]``; the row functions reduce the last two dimensions. Replay batches
(``safe_vocab_support="replay"``) are computed one by one.

Every process must flush at the same points (the reduction gathers across processes): the queue flushes on
``log`` (called on every process) and after a fixed number of batches, the same on every process.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import fields, replace

import torch

from safevocab.correction import ImportanceRatio
from safevocab.mismatch.row import MetricRow
from trl_integration._private import metric_store as trl_metric_store
from trl_integration.grpo.metric_rows import reduce_across_processes
from trl_integration.grpo.step import OutOfSetMasks, SafeTokenStats, StepMetricInputs

#: Bytes of queued inputs per generation batch position (about ten float/int/bool ``[B, T]`` tensors), used to keep
#: a queue's inputs under :data:`MAX_QUEUED_BYTES`.
BYTES_PER_POSITION = 64

#: The most input bytes a full queue keeps alive (a large batch flushes every step, as without a queue).
MAX_QUEUED_BYTES = 64 * 2**20

#: The most generation batches a queue holds (trl's default ``logging_steps`` is 10).
MAX_QUEUED_BATCHES = 16

#: What stacked inputs are padded with: positions that no metric counts.
_PADDING = {
    "in_safe": False, "log_kept_mass": 0.0, "safe_size": 0,  # SafeTokenStats
    "base": 0, "keep": True, "tool_mask": 0, "loss_mask": 0,  # OutOfSetMasks
    "ratio": 1.0, "log_raw": 0.0, "clipped": False,  # ImportanceRatio
    "train_logps": 0.0, "rollout_logps": 0.0, "measured_rollout_logps": 0.0,
}  # fmt: skip


def queue_capacity(rows_per_batch: int, max_completion_length: int | None) -> int:
    """How many generation batches a queue holds: :data:`MAX_QUEUED_BATCHES`, fewer for batches whose inputs would
    keep more than :data:`MAX_QUEUED_BYTES` alive, at least 1; 1 (no queue) when the completion length is not
    bounded (``None``). From configuration values only, so that it is the same on every process (their batches'
    actual sizes differ, and the flush is collective)."""
    if max_completion_length is None:
        return 1
    per_batch = max(1, rows_per_batch * max_completion_length * BYTES_PER_POSITION)
    return max(1, min(MAX_QUEUED_BATCHES, MAX_QUEUED_BYTES // per_batch))


class MetricQueue:
    """Generation batches whose metric rows are not computed yet.

    Args:
        capacity: the number of batches after which :meth:`add` asks for a flush (:func:`queue_capacity`).
    """

    def __init__(self, capacity: int = MAX_QUEUED_BATCHES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} is out of range: accepted >= 1")
        self.capacity = capacity
        self._batches: list[tuple[str, list[MetricRow | StepMetricInputs]]] = []

    def __len__(self) -> int:
        return len(self._batches)

    def add(self, mode: str, rows: list[MetricRow | StepMetricInputs]) -> bool:
        """Queue one generation batch's rows (computed rows and step inputs) for ``mode``; whether the queue is full."""
        if rows:
            self._batches.append((mode, list(rows)))
        return len(self._batches) >= self.capacity

    def flush(
        self,
        store: MutableMapping[str, MutableMapping[str, list]],
        gather: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
    ) -> None:
        """Compute every queued row, reduce each batch's rows across processes and append the values to
        ``store[mode][name]`` (trl's metric store), batch after batch; the queue is then empty."""
        batches, self._batches = self._batches, []
        pending = [row for _, rows in batches for row in rows if isinstance(row, StepMetricInputs)]
        computed = dict(zip(map(id, pending), step_metric_rows(pending)))
        for mode, rows in batches:
            rows = [computed[id(row)] if isinstance(row, StepMetricInputs) else row for row in rows]
            for name, value in reduce_across_processes(_joined(rows), gather, device).items():
                store[mode][name].append(value)


class QueuedMetrics:
    """The trainer's side of the queue (a mixin before trl's trainer): ``_log_reduced_metrics`` queues a generation
    batch's rows and ``log`` flushes the queue before trl reads its store (``metric_store``, which holds the
    values of the batches flushed so far). Needs ``self._metric_queue`` and ``self.accelerator``."""

    _metric_queue: MetricQueue

    def _log_reduced_metrics(self, mode: str, rows: list[MetricRow | StepMetricInputs]) -> None:
        """Queue a generation batch's metric rows; computed, reduced across processes and appended to trl's metric
        store when trl reads it (:meth:`log`) or the queue is full."""
        if self._metric_queue.add(mode, rows):
            self.flush_metrics()

    @torch.no_grad()
    def flush_metrics(self) -> None:
        """Compute the queued batches' metrics and append them to trl's store (``metric_store``). Collective: every
        process must call it (it gathers across processes), as the Trainer calls :meth:`log`."""
        self._metric_queue.flush(trl_metric_store(self), self.accelerator.gather, self.accelerator.device)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """trl's ``log``, after :meth:`flush_metrics` (the Trainer calls it on every process)."""
        self.flush_metrics()
        super().log(logs, start_time)


def step_metric_rows(inputs: list[StepMetricInputs]) -> list[MetricRow]:
    """:meth:`StepMetricInputs.row` of each of ``inputs``, in order, with one stacked computation per group of
    inputs of the same shape (see the module docstring)."""
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(inputs):
        groups.setdefault(_signature(item), []).append(i)
    rows: list[MetricRow | None] = [None] * len(inputs)
    for signature, members in groups.items():
        if signature[0] is None or len(members) == 1:  # replay, or nothing to stack
            for i in members:
                rows[i] = inputs[i].row()
            continue
        for i, row in zip(members, _stacked([inputs[i] for i in members]).row().unstack()):
            rows[i] = row
    return rows


def _signature(item: StepMetricInputs) -> tuple:
    """Inputs with the same signature stack; ``None`` first: compute alone (replay metrics)."""
    if item.settings.replay:
        return (None, id(item))
    ratio = item.ratio
    return (
        item.settings,
        tuple(item.train_logps.shape[:-1]),
        item.train_logps.dtype,
        item.train_logps.device,
        item.rollout_logps is None,
        item.measured_rollout_logps is None,
        None if ratio is None else ratio.sequence_level,
    )


def _stacked(items: list[StepMetricInputs]) -> StepMetricInputs:
    """One :class:`StepMetricInputs` of ``[S, B, T]`` tensors, padded to the longest ``T``."""
    first = items[0]
    ratio = None
    if first.ratio is not None:
        ratio = replace(first.ratio, **_stack_fields([item.ratio for item in items], ImportanceRatio, "sequence_level"))
    return StepMetricInputs(
        stats=SafeTokenStats(
            **_stack_fields([item.stats for item in items], SafeTokenStats, "replay_size", "rule_safe_size")
        ),
        masks=OutOfSetMasks(**_stack_fields([item.masks for item in items], OutOfSetMasks)),
        train_logps=_stack([item.train_logps for item in items], _PADDING["train_logps"]),
        rollout_logps=None if first.rollout_logps is None else _stack([item.rollout_logps for item in items], 0.0),
        ratio=ratio,
        settings=first.settings,
        measured_rollout_logps=(
            None
            if first.measured_rollout_logps is None
            else _stack([item.measured_rollout_logps for item in items], 0.0)
        ),
    )


def _stack_fields(objects: list, cls: type, *skip: str) -> dict[str, torch.Tensor]:
    names = [f.name for f in fields(cls) if f.name not in skip]
    return {name: _stack([getattr(o, name) for o in objects], _PADDING[name]) for name in names}


def _stack(tensors: list[torch.Tensor], padding: float | bool | int) -> torch.Tensor:
    """``[S, B, T]`` from ``S`` tensors ``[B, T_s]``, right-padded with ``padding`` to the longest ``T_s``."""
    width = max(t.shape[-1] for t in tensors)
    if all(t.shape[-1] == width for t in tensors):
        return torch.stack(tensors)
    out = tensors[0].new_full((len(tensors), *tensors[0].shape[:-1], width), padding)
    for i, t in enumerate(tensors):
        out[i, ..., : t.shape[-1]] = t
    return out


def _joined(rows: list[MetricRow]) -> list[MetricRow]:
    """The batch's own rows (its rollout coverage) joined to its first step row: one row per micro-batch."""
    if len(rows) >= 2 and not set(rows[0].names) & set(rows[1].names):
        return [MetricRow.cat(rows[:2]), *rows[2:]]
    return rows


__all__ = [
    "MetricQueue", "QueuedMetrics", "queue_capacity", "step_metric_rows", "MAX_QUEUED_BATCHES", "MAX_QUEUED_BYTES",
]  # fmt: skip
