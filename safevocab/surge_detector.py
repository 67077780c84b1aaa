"""Online detection of a surge in the mean response length: the trigger of the length-decay schedule.

Each :meth:`SurgeDetector.update` appends the mean length ``x_k`` of one step ``s_k``. The last ``window`` lengths
are the *recent* ones; the *baseline* ``b`` summarises the lengths before them:

- ``baseline="median"`` (default): ``b`` = the median of the ``baseline_window`` lengths just before the recent ones;
- ``baseline="ema"``: ``b`` = the exponential moving average of every length before the recent ones since the
  detector was (re)armed, ``e_1 = x_1`` and ``e_k = alpha * x_k + (1 - alpha) * e_(k-1)`` (in this order, in
  Python floats; pandas' ``Series.ewm(alpha=alpha, adjust=False).mean()``). The default
  ``alpha = 2 / (baseline_window + 1)`` is the "span" convention: the EMA's centre of mass,
  ``(1 - alpha) / alpha = (baseline_window - 1) / 2`` steps back, is the median window's.

A surge is declared at the first update where

    ``median(recent) >= ratio * b``  with  ``b > 0``,

once the baseline is complete (``baseline_window`` lengths in it), after at least ``warmup`` updates in all, at a
step ``>= not_before``, while the detector is *armed*. The surge step is the first step of the recent window whose
length reached ``ratio * b``, and ``decay_period = max(1, round(factor * surge_step))`` from the first surge (the
paper's ``factor = 1.8``). Medians make one outlier batch harmless; comparing the recent window with the lengths
just before it ignores the slow, steady growth of response length that RL on reasoning tasks usually shows.

After a detection the detector is disarmed (:meth:`update` returns ``False``), so used on its own it reports one
surge, as it always did. :meth:`rearm` clears both windows (the next baseline is the post-surge length, so the same
surge is not reported twice) and arms it again from a given step: ``LengthDecayLR`` does so after a decay when its
``max_decays`` allows another, with its ``cooldown``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from safevocab.validation import boolean, integer, real, require_keys

__all__ = ["SurgeDetector", "BASELINES"]

#: The accepted ``baseline`` settings.
BASELINES = ("median", "ema")

#: Keys every state written by :meth:`SurgeDetector.state_dict` has had since the first release; the later ones
#: (``baseline``, ``ema_alpha``, ``ema``, ``n_baseline``, ``armed``, ``not_before``, ``detections``) take the values
#: that release implied when absent, so that its checkpoints still resume.
_REQUIRED_KEYS = (
    "window",
    "baseline_window",
    "ratio",
    "warmup",
    "factor",
    "history",
    "n_updates",
    "surge_step",
    "detected_at",
)


def _pairs(name: str, values: object) -> list[tuple[object, object]]:
    """A saved list of pairs (``(step, length)``, ``(surge_step, detected_at)``); one line naming the first bad entry."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of pairs, got {type(values).__name__}: {values!r}")
    for i, pair in enumerate(values):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"{name}[{i}]={pair!r} is out of range: accepted a pair of two values")
    return [tuple(pair) for pair in values]


class SurgeDetector:
    """Online detection of a surge in the mean response length (the maths is in the module docstring).

    Args:
        window: recent steps compared with the baseline (default 10).
        baseline_window: lengths forming the baseline before detection may start (default 30); with
            ``baseline="median"`` also the width of the baseline window.
        ratio: how many times the baseline the recent median must reach (default 1.5; a surge typically doubles or
            triples the length).
        warmup: no detection before this many updates (default 20: early lengths move fast while the model learns
            the format).
        factor: ``decay_period = round(factor * surge_step)`` (default 1.8, the paper's choice).
        baseline: ``"median"`` (default) or ``"ema"``.
        ema_alpha: the EMA coefficient in ``(0, 1]`` with ``baseline="ema"`` (default ``2 / (baseline_window + 1)``).

    Attributes:
        detections: ``(surge_step, detected_at)`` of every surge reported, in order.
        surge_step: the step at which the first surge started, ``None`` before it.
        detected_at: the step at which :meth:`update` first returned ``True``.
        decay_period: ``round(factor * surge_step)`` (at least 1) of the first surge, ``None`` before it.
        armed: whether the next surge can be reported (until the first detection, and after :meth:`rearm`).
        not_before: no detection at a step below this one.
    """

    def __init__(
        self,
        window: int = 10,
        baseline_window: int = 30,
        ratio: float = 1.5,
        warmup: int = 20,
        factor: float = 1.8,
        baseline: str = "median",
        ema_alpha: float | None = None,
    ) -> None:
        self.window = integer("window", window, lambda x: x >= 1, "an integer >= 1")
        self.baseline_window = integer("baseline_window", baseline_window, lambda x: x >= 1, "an integer >= 1")
        self.ratio = real("ratio", ratio, lambda x: x > 1.0, "a finite ratio > 1")
        self.warmup = integer("warmup", warmup, lambda x: x >= 0, "an integer >= 0")
        self.factor = real("factor", factor, lambda x: x > 0, "a finite factor > 0")
        if baseline not in BASELINES:
            raise ValueError(f"baseline={baseline!r} is out of range: accepted one of {BASELINES}")
        self.baseline = baseline
        if ema_alpha is None:
            ema_alpha = 2.0 / (self.baseline_window + 1)
        elif baseline != "ema":
            raise ValueError(f"ema_alpha={ema_alpha!r} with baseline={baseline!r}: accepted only with baseline='ema'")
        self.ema_alpha = real("ema_alpha", ema_alpha, lambda x: 0.0 < x <= 1.0, "0 < ema_alpha <= 1")
        # The median baseline keeps its window inside the history; the EMA folds in every length leaving the recent one.
        kept = self.window + (self.baseline_window if baseline == "median" else 0)
        self.history: deque[tuple[int, float]] = deque(maxlen=kept)
        self.ema: float | None = None
        self.n_baseline = 0
        self.n_updates = 0
        self.armed = True
        self.not_before = 0
        self.detections: list[tuple[int, int]] = []

    @property
    def surge_step(self) -> int | None:
        return self.detections[0][0] if self.detections else None

    @property
    def detected_at(self) -> int | None:
        return self.detections[0][1] if self.detections else None

    @property
    def decay_period(self) -> int | None:
        if self.surge_step is None:
            return None
        return max(1, round(self.factor * self.surge_step))

    @property
    def detected(self) -> bool:
        """Whether a surge has been reported."""
        return bool(self.detections)

    @property
    def baseline_length(self) -> float | None:
        """The current baseline ``b``; ``None`` while it holds fewer than ``baseline_window`` lengths."""
        if self.baseline == "ema":
            return self.ema if self.n_baseline >= self.baseline_window else None
        if len(self.history) < self.window + self.baseline_window:
            return None
        return statistics.median(length for _, length in list(self.history)[: self.baseline_window])

    def update(self, step: int, mean_length: float) -> bool:
        """Record the mean response length at ``step``; ``True`` when this update reports a surge.

        Args:
            step: the optimizer step, an integer (Python, numpy or a 0-dim tensor).
            mean_length: the mean completion length, a real number of any kind (``np.float32``, a 0-dim tensor,
                ...). NaN or infinite lengths (a step with no completions) are ignored.

        Raises:
            TypeError: ``step`` is not an integer or ``mean_length`` not a real number (a string, ``None``).
            ValueError: ``step < 0`` or ``mean_length < 0``.
        """
        step = integer("step", step, lambda x: x >= 0, "an integer step >= 0")
        mean_length = real("mean_length", mean_length, lambda x: x >= 0 or math.isnan(x), "a length >= 0", finite=False)
        if not self.armed or not math.isfinite(mean_length):
            return False
        self._append(step, mean_length)
        self.n_updates += 1
        baseline = self.baseline_length
        if self.n_updates < self.warmup or step < self.not_before or baseline is None or baseline <= 0:
            return False
        recent = list(self.history)[-self.window :]
        threshold = self.ratio * baseline
        if statistics.median(length for _, length in recent) < threshold:
            return False
        surge_step = next(s for s, length in recent if length >= threshold)
        self.detections.append((surge_step, step))
        self.armed = False
        return True

    def _append(self, step: int, mean_length: float) -> None:
        if self.baseline == "ema" and len(self.history) == self.window:
            _, leaving = self.history[0]  # leaves the recent window: it joins the baseline
            alpha = self.ema_alpha
            self.ema = leaving if self.ema is None else alpha * leaving + (1.0 - alpha) * self.ema
            self.n_baseline += 1
        self.history.append((step, mean_length))

    def rearm(self, not_before: int = 0) -> None:
        """Watch for the next surge from a fresh baseline: clear both windows, report again from step ``not_before``.

        ``warmup`` counts all updates, so it is not waited for again; the fresh baseline needs ``baseline_window``
        lengths (and the recent window ``window``) before a surge can be reported.
        """
        self.not_before = integer("not_before", not_before, lambda x: x >= 0, "an integer step >= 0")
        self.history.clear()
        self.ema = None
        self.n_baseline = 0
        self.armed = True

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume detection exactly (plain values, for ``torch.load(weights_only=True)``)."""
        return {
            "window": self.window,
            "baseline_window": self.baseline_window,
            "ratio": self.ratio,
            "warmup": self.warmup,
            "factor": self.factor,
            "baseline": self.baseline,
            "ema_alpha": self.ema_alpha,
            "history": list(self.history),
            "ema": self.ema,
            "n_baseline": self.n_baseline,
            "n_updates": self.n_updates,
            "armed": self.armed,
            "not_before": self.not_before,
            "detections": list(self.detections),
            "surge_step": self.surge_step,  # kept for readers of the first release's state
            "detected_at": self.detected_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`, also one written before the EMA baseline and re-arming existed.

        Raises:
            TypeError: ``state`` is not a dict, or a value has the wrong type (a history step ``"x"``).
            ValueError: one line naming the keys ``state`` lacks, or a setting or value out of range. Nothing is
                changed then.
        """
        require_keys("state_dict", state, _REQUIRED_KEYS, "a dict from SurgeDetector.state_dict()")
        baseline = state.get("baseline", "median")  # the only baseline of the first release
        # The settings go through the constructor's checks (on a fresh detector: this one changes only once the whole
        # state passed), the running values through the same ones update() applies, each named by its key.
        fresh = SurgeDetector(
            window=state["window"],
            baseline_window=state["baseline_window"],
            ratio=state["ratio"],
            warmup=state["warmup"],
            factor=state["factor"],
            baseline=baseline,
            ema_alpha=state.get("ema_alpha") if baseline == "ema" else None,
        )
        step = "an integer step >= 0"
        history = _pairs("state_dict['history']", state["history"])
        fresh.history.extend(
            (
                integer(f"state_dict['history'][{i}] step", s, lambda x: x >= 0, step),
                real(f"state_dict['history'][{i}] length", v, lambda x: x >= 0, "a finite length >= 0"),
            )
            for i, (s, v) in enumerate(history)
        )
        ema = state.get("ema")
        fresh.ema = (
            None if ema is None else real("state_dict['ema']", ema, lambda x: x >= 0, "None or a finite length >= 0")
        )
        count = "an integer >= 0"
        fresh.n_baseline = integer("state_dict['n_baseline']", state.get("n_baseline", 0), lambda x: x >= 0, count)
        fresh.n_updates = integer("state_dict['n_updates']", state["n_updates"], lambda x: x >= 0, count)
        if "detections" in state:
            detections = _pairs("state_dict['detections']", state["detections"])
        elif state["surge_step"] is not None:  # the first release reported one surge and kept it in these two keys
            detections = [(state["surge_step"], state["detected_at"])]
        else:
            detections = []
        fresh.detections = [
            (
                integer(f"state_dict['detections'][{i}] surge step", s, lambda x: x >= 0, step),
                integer(f"state_dict['detections'][{i}] detection step", d, lambda x: x >= 0, step),
            )
            for i, (s, d) in enumerate(detections)
        ]
        fresh.armed = boolean("state_dict['armed']", state.get("armed", not fresh.detections))
        fresh.not_before = integer("state_dict['not_before']", state.get("not_before", 0), lambda x: x >= 0, step)
        self.__dict__.update(fresh.__dict__)
