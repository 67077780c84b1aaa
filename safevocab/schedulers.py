"""Length-decay learning-rate schedule and response-length surge detection.

From "Beyond Precision: Training-Inference Mismatch is an Optimization Problem and Simple LR
Scheduling Fixes It": keep the initial LR ``eta0``; once triggered, halve it every ``decay_period``
steps, never below ``eta_inf = min_lr_ratio * eta0``. The trigger is a surge of the mean response
length (it can triple within a few steps), which precedes the collapse; the suggested
``decay_period`` is about 1.8 x the step of the surge (surge at 110 -> 204 for a 4B model, 90 -> 160
for an 8B one).

- :class:`LengthDecayLR` is a plain ``torch.optim.lr_scheduler.LRScheduler`` (per-group LRs,
  ``state_dict``/``load_state_dict``), usable with any training loop.
- :class:`~safevocab.surge_detector.SurgeDetector` (re-exported here) watches a stream of mean lengths online and
  says when the surge happened.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from safevocab.surge_detector import SurgeDetector
from safevocab.validation import integer, real

__all__ = ["LengthDecayLR", "SurgeDetector"]

_STARTS = ("on_surge", "step0")


def _check_period(decay_period: object, name: str = "decay_period") -> int:
    return integer(name, decay_period, lambda x: x >= 1, "an integer >= 1")


class LengthDecayLR(LRScheduler):
    """Hold each group's initial LR, then halve it every ``decay_period`` steps down to a floor.

    After the ``t``-th call of :meth:`step`, each parameter group's LR is

        ``max(eta0 * 0.5 ** floor((t - t0) / decay_period), min_lr_ratio * eta0)``  for ``t >= t0``,

    and ``eta0`` before, where ``t0 = 0`` with ``start="step0"`` (Algorithm 1 of the paper: the LR
    halves at every multiple of ``decay_period``) and ``t0`` is the step at which :meth:`trigger`
    was called with ``start="on_surge"`` (the LR is held until then).

    Args:
        optimizer: the wrapped optimizer; each group's ``lr`` at construction is its ``eta0``.
        decay_period: steps between halvings (>= 1). With ``"on_surge"`` it may be replaced when
            triggering, e.g. by :attr:`SurgeDetector.decay_period`.
        min_lr_ratio: the floor as a fraction of ``eta0``, in ``[0, 1]`` (default 0.1).
        start: ``"on_surge"`` (default: hold until :meth:`trigger`) or ``"step0"``.
        last_epoch: as in every torch scheduler (``-1`` for a fresh start).
        detector: optional :class:`SurgeDetector` fed by :meth:`observe_length`. Its state travels in
            this scheduler's ``state_dict`` (plain Python values, so ``torch.load(weights_only=True)``
            reads it), which is how a resumed training run takes the same decision.
        auto_period: with a detector, trigger with the detector's ``decay_period`` instead of
            ``decay_period`` (the "auto" mode).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        decay_period: int,
        min_lr_ratio: float = 0.1,
        start: str = "on_surge",
        last_epoch: int = -1,
        detector: SurgeDetector | None = None,
        auto_period: bool = False,
    ) -> None:
        self.decay_period = _check_period(decay_period)
        min_lr_ratio = real("min_lr_ratio", min_lr_ratio, lambda x: 0.0 <= x <= 1.0, "0 <= min_lr_ratio <= 1")
        if start not in _STARTS:
            raise ValueError(f"start={start!r} is not accepted: accepted one of {_STARTS}")
        self.min_lr_ratio = float(min_lr_ratio)
        self.start = start
        if auto_period and detector is None:
            raise ValueError("auto_period=True needs a detector: pass detector=SurgeDetector(...)")
        self.detector = detector
        self.auto_period = bool(auto_period)
        #: Step count at which decay starts (``None`` while waiting for :meth:`trigger`).
        self.trigger_step: int | None = 0 if start == "step0" else None
        super().__init__(optimizer, last_epoch)

    @property
    def decay_active(self) -> bool:
        """Whether the LR is decaying (always with ``"step0"``; after :meth:`trigger` otherwise)."""
        return self.trigger_step is not None

    def trigger(self, decay_period: int | None = None) -> bool:
        """Start decaying from the current step; optionally set a new ``decay_period`` first.

        Returns:
            ``True`` if this call started the decay, ``False`` if it was already active (the call
            then changes nothing).
        """
        if self.trigger_step is not None:
            return False
        if decay_period is not None:
            self.decay_period = _check_period(decay_period)
        self.trigger_step = self.last_epoch
        return True

    def observe_length(self, step: int, mean_length: float) -> bool:
        """Feed the detector one mean response length; trigger the decay when it reports the surge.

        Returns:
            ``True`` at the step this call triggered the decay.
        """
        if self.detector is None:
            raise ValueError("observe_length needs a detector: construct LengthDecayLR(..., detector=SurgeDetector())")
        if not self.detector.update(step, mean_length):
            return False
        return self.trigger(self.detector.decay_period if self.auto_period else None)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.detector is not None:
            state["detector"] = self.detector.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        detector_state = state.pop("detector", None)
        super().load_state_dict(state)
        if detector_state is not None:
            if self.detector is None:
                self.detector = SurgeDetector()
            self.detector.load_state_dict(detector_state)

    def _factor(self, step: int) -> float:
        if self.trigger_step is None or step < self.trigger_step:
            return 1.0
        return max(0.5 ** ((step - self.trigger_step) // self.decay_period), self.min_lr_ratio)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        factor = self._factor(self.last_epoch)
        return [base_lr * factor for base_lr in self.base_lrs]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()
