"""Trainer callbacks: the length-decay LR schedule driven by the response-length surge detector."""

from __future__ import annotations

import math

from transformers import TrainerCallback

from safevocab.schedulers import LengthDecayLR
from trl_integration._private import metric_store as trl_metric_store

__all__ = ["LengthDecayCallback"]


class LengthDecayCallback(TrainerCallback):
    """Feeds each generation's mean completion length to the :class:`~safevocab.schedulers.LengthDecayLR`
    of ``trainer`` and logs the schedule.

    The trainer queues the global mean completion length of every training generation (the value trl
    logs as ``completions/mean_length``, already gathered over all processes, so every rank takes the
    same decision). At the end of each optimizer step this callback hands the queued lengths to the
    scheduler's :class:`~safevocab.schedulers.SurgeDetector`, which triggers the decay when it
    detects the surge, and records the metrics ``lr``, ``safevocab/lr_decay_active`` and, once known,
    ``safevocab/length_surge_step`` and ``safevocab/length_decay_period``.

    The detector's state lives in the scheduler's ``state_dict``, which the Trainer saves in every
    checkpoint and restores on resume.
    """

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        scheduler = self.trainer.lr_scheduler
        if not isinstance(scheduler, LengthDecayLR):
            return control
        pending = self.trainer.pending_mean_lengths
        while pending:
            length = pending.pop(0)
            if scheduler.detector is not None and math.isfinite(length):
                scheduler.observe_length(state.global_step, length)
        metrics = trl_metric_store(self.trainer)["train"]  # appends only: the queued metrics can wait for the log
        metrics["lr"].append(float(scheduler.get_last_lr()[0]))
        metrics["safevocab/lr_decay_active"].append(float(scheduler.decay_active))
        detector = scheduler.detector
        if detector is not None and detector.surge_step is not None:
            metrics["safevocab/length_surge_step"].append(float(detector.surge_step))
        if scheduler.decay_active:
            metrics["safevocab/length_decay_period"].append(float(scheduler.decay_period))
        return control
