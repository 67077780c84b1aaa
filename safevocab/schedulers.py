"""Length-decay learning-rate schedule and response-length surge detection.

From "Beyond Precision: Training-Inference Mismatch is an Optimization Problem and Simple LR
Scheduling Fixes It": keep the initial LR ``eta0``; once triggered, halve it every ``decay_period``
steps, never below ``eta_inf = min_lr_ratio * eta0``. The trigger is a surge of the mean response
length (it can triple within a few steps), which precedes the collapse; the suggested
``decay_period`` is about 1.8 x the step of the surge (surge at 110 -> 204 for a 4B model, 90 -> 160
for an 8B one).

- :class:`LengthDecayLR` is a plain ``torch.optim.lr_scheduler.LRScheduler`` (per-group LRs,
  ``state_dict``/``load_state_dict``), usable with any training loop.
- :class:`SurgeDetector` watches a stream of mean lengths online and says when the surge happened.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

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


class SurgeDetector:
    """Online detection of a surge in the mean response length.

    Each :meth:`update` appends ``(step, mean_length)``. A surge is declared when the median of the
    last ``window`` lengths is at least ``ratio`` times the median of the ``baseline_window``
    lengths just before them. Medians make one outlier batch harmless, and comparing two adjacent
    windows (rather than a fixed start) ignores the slow, steady growth of response length that
    RL on reasoning tasks usually shows: only a jump within about ``window`` steps counts.

    Args:
        window: recent steps compared with the baseline (default 10).
        baseline_window: steps before them forming the baseline (default 30).
        ratio: how many times the baseline the recent median must reach (default 1.5; a surge
            typically doubles or triples the length).
        warmup: no detection before this many updates (default 20: early lengths move fast
            while the model learns the format).
        factor: ``decay_period = round(factor * surge_step)`` (default 1.8, the paper's choice).

    Attributes:
        surge_step: the step at which the surge started (the first step of the recent window whose
            length reached ``ratio`` times the baseline), ``None`` before detection.
        detected_at: the step at which :meth:`update` returned ``True``.
        decay_period: ``round(factor * surge_step)`` (at least 1), ``None`` before detection.
    """

    def __init__(
        self,
        window: int = 10,
        baseline_window: int = 30,
        ratio: float = 1.5,
        warmup: int = 20,
        factor: float = 1.8,
    ) -> None:
        window = _check_period(window, "window")
        baseline_window = _check_period(baseline_window, "baseline_window")
        ratio = real("ratio", ratio, lambda x: x > 1.0, "a finite ratio > 1")
        warmup = integer("warmup", warmup, lambda x: x >= 0, "an integer >= 0")
        factor = real("factor", factor, lambda x: x > 0, "a finite factor > 0")
        self.window, self.baseline_window = window, baseline_window
        self.ratio, self.warmup, self.factor = ratio, warmup, factor
        self.history: deque[tuple[int, float]] = deque(maxlen=window + baseline_window)
        self.n_updates = 0
        self.surge_step: int | None = None
        self.detected_at: int | None = None

    @property
    def decay_period(self) -> int | None:
        if self.surge_step is None:
            return None
        return max(1, round(self.factor * self.surge_step))

    @property
    def detected(self) -> bool:
        return self.surge_step is not None

    def update(self, step: int, mean_length: float) -> bool:
        """Record the mean response length at ``step``; ``True`` exactly once, when the surge is detected.

        Args:
            step: the optimizer step, an integer (Python, numpy or a 0-dim tensor).
            mean_length: the mean completion length, a real number of any kind (``np.float32``, a 0-dim
                tensor, ...). NaN or infinite lengths (a step with no completions) are ignored.

        Raises:
            TypeError: ``step`` is not an integer or ``mean_length`` not a real number (a string, ``None``).
            ValueError: ``step < 0`` or ``mean_length < 0``.
        """
        step = integer("step", step, lambda x: x >= 0, "an integer step >= 0")
        mean_length = real("mean_length", mean_length, lambda x: x >= 0 or math.isnan(x), "a length >= 0", finite=False)
        if self.detected or not math.isfinite(mean_length):
            return False
        self.history.append((step, mean_length))
        self.n_updates += 1
        if self.n_updates < max(self.warmup, self.window + self.baseline_window):
            return False
        items = list(self.history)
        baseline = statistics.median(length for _, length in items[: self.baseline_window])
        recent = items[self.baseline_window :]
        threshold = self.ratio * baseline
        if baseline <= 0 or statistics.median(length for _, length in recent) < threshold:
            return False
        self.surge_step = next(s for s, length in recent if length >= threshold)
        self.detected_at = int(step)
        return True

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume detection exactly (plain Python values)."""
        return {
            "window": self.window,
            "baseline_window": self.baseline_window,
            "ratio": self.ratio,
            "warmup": self.warmup,
            "factor": self.factor,
            "history": list(self.history),
            "n_updates": self.n_updates,
            "surge_step": self.surge_step,
            "detected_at": self.detected_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            window=state["window"],
            baseline_window=state["baseline_window"],
            ratio=state["ratio"],
            warmup=state["warmup"],
            factor=state["factor"],
        )
        self.history.extend((int(s), float(v)) for s, v in state["history"])
        self.n_updates = int(state["n_updates"])
        self.surge_step = state["surge_step"]
        self.detected_at = state["detected_at"]
