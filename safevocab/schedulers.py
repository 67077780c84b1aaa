"""Length-decay learning rate: a multiplicative factor over any LR schedule, started by a response-length surge.

From "Beyond Precision: Training-Inference Mismatch is an Optimization Problem and Simple LR Scheduling Fixes It":
once the mean response length surges (it can triple within a few steps, and precedes the collapse), halve the LR
every ``P`` steps, never below ``min_lr_ratio`` times its undecayed value. The suggested ``P`` is about 1.8 x the step
of the surge (surge at 110 -> 204 for a 4B model, 90 -> 160 for an 8B one).

The maths. Let ``B_i(t)`` be parameter group ``i``'s LR under the *base schedule* after ``t`` calls of
:meth:`LengthDecayLR.step`: the wrapped ``base_scheduler``'s ``get_last_lr()`` (a warm-up, a cosine, any
``torch.optim.lr_scheduler.LRScheduler``), or the group's initial LR when there is none (the constant schedule: the
behaviour ``LengthDecayLR`` had before it could wrap one). The effective LR is

    ``lr_i(t) = B_i(t) * f(t)``, computed in this order in Python floats, with the factor

    ``f(t) = 1``                                                   for ``t < t_s`` (or before the start),
    ``f(t) = max(0.5 ** (floor((t - t_s) / P) + m(t)), r_min)``     for ``t >= t_s``,

where ``t_s`` is the start step (``0`` with ``start="step0"``, Algorithm 1 of the paper; the step of the first decay
with ``start="on_surge"``), ``P = decay_period``, ``r_min = min_lr_ratio`` and ``m(t)`` the number of later decays
at steps ``<= t``. ``0.5 ** n`` is a power of two, so above the floor ``lr_i(t)`` is ``B_i(t)`` scaled exactly
(barring underflow); at the floor it is the one rounding of ``B_i(t) * r_min``.

Decays, cooldown, cap. A *decay* is a decision of the schedule, not a tick of its clock: the start (the first
surge, or step 0 with ``"step0"``) and each later accepted surge, which halves ``f`` at once without restarting the
clock (it brings the next halving forward: ``m`` grows by one). The halvings every ``P`` steps after the start are
the schedule itself; they are not decays, and the floor ``r_min`` bounds them. ``max_decays`` caps the decays
(default 1: the start only, the paper's algorithm and the first release's behaviour), and a decay is accepted only
``cooldown`` or more steps after the previous one. With a detector, after each decay that leaves room for another
the detector starts a fresh baseline and reports no earlier than the cooldown's end: a surge that starts within the
cooldown is reported when it ends if it still stands ``ratio`` times above the baseline then, and is absorbed into
the baseline otherwise. Once ``f`` reaches the floor it stays there (the exponent only grows), so a surge accepted
there changes no LR but still counts.

- :class:`LengthDecayLR` is a ``torch.optim.lr_scheduler.LRScheduler``: per-group LRs, ``state_dict``/
  ``load_state_dict`` (the base scheduler's and the detector's state included), usable with any training loop.
- :class:`~safevocab.surge_detector.SurgeDetector` (re-exported here) watches the mean lengths online and reports
  the surges.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from safevocab.surge_detector import SurgeDetector
from safevocab.validation import boolean, integer, real, require_keys

__all__ = ["LengthDecayLR", "SurgeDetector"]

_STARTS = ("on_surge", "step0")

#: Keys every state written by :meth:`LengthDecayLR.state_dict` has had since the first release; the later ones
#: (``max_decays``, ``cooldown``, ``decay_steps``, ``base_scheduler``) take the values that release implied when
#: absent (one decay, no cooldown, the constant schedule), so that its checkpoints still resume.
_REQUIRED_KEYS = ("decay_period", "min_lr_ratio", "start", "trigger_step", "base_lrs", "last_epoch", "_last_lr")


def _check_period(decay_period: object, name: str = "decay_period") -> int:
    return integer(name, decay_period, lambda x: x >= 1, "an integer >= 1")


def _check_base(base_scheduler: object, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(base_scheduler, LRScheduler) or isinstance(base_scheduler, ReduceLROnPlateau):
        raise TypeError(
            "base_scheduler must be a torch.optim.lr_scheduler.LRScheduler stepped once per optimizer step "
            f"(not ReduceLROnPlateau), got {type(base_scheduler).__name__}"
        )
    if base_scheduler.optimizer is not optimizer:
        raise ValueError("base_scheduler drives another optimizer: accepted a scheduler built on this optimizer")


def _integer_list(name: str, values: object, accepted: str) -> list[int]:
    """``values`` as a list of integers ``>= 0`` (a saved list of steps); one line naming the first bad entry."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list, got {type(values).__name__}: {values!r}")
    return [integer(f"{name}[{i}]", v, lambda x: x >= 0, accepted) for i, v in enumerate(values)]


def _lr_list(name: str, values: object, n_groups: int) -> list[float | torch.Tensor]:
    """A saved list of per-group LRs: one finite real ``>= 0`` (or a 0-dim tensor) per parameter group, kept as given."""
    if not isinstance(values, (list, tuple)) or len(values) != n_groups:
        raise ValueError(
            f"{name}={values!r} is out of range: accepted a list of {n_groups} learning rate(s), one per "
            "parameter group of the optimizer"
        )
    for i, value in enumerate(values):
        real(f"{name}[{i}]", value, lambda x: x >= 0, "a finite learning rate >= 0")
    return list(values)


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: list[float | torch.Tensor]) -> list[float | torch.Tensor]:
    """Write ``lrs`` into the groups (a tensor LR in place, as torch's schedulers do); return copies (``_last_lr``)."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(float(lr))
        else:
            group["lr"] = lr
    return [
        group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        for group in optimizer.param_groups
    ]


class LengthDecayLR(LRScheduler):
    """The length-decay factor over a base schedule (the maths is in the module docstring).

    Call :meth:`step` once per optimizer step, after ``optimizer.step()``; it steps the base scheduler too (never
    step the base yourself: that is refused). After ``t`` steps, ``get_last_lr()`` is the effective LR
    ``B_i(t) * f(t)``, :meth:`get_last_base_lr` is ``B_i(t)`` and :attr:`factor` is ``f(t)``.

    Args:
        optimizer: the wrapped optimizer; each group's ``lr`` at construction (or its ``initial_lr`` when a scheduler
            set one) is the constant schedule's LR when there is no base scheduler.
        decay_period: ``P``, steps between halvings (>= 1). With ``"on_surge"`` it may be replaced at the start, e.g.
            by :attr:`SurgeDetector.decay_period`.
        min_lr_ratio: the floor ``r_min`` of the factor, in ``[0, 1]`` (default 0.1).
        start: ``"on_surge"`` (default: ``f = 1`` until the first decay) or ``"step0"`` (``t_s = 0``).
        last_epoch: as in every torch scheduler (``-1`` for a fresh start); with a base scheduler only ``-1``, the
            wrapper then follows the base's own step count.
        detector: optional :class:`SurgeDetector` fed by :meth:`observe_length`. Its state travels in this
            scheduler's ``state_dict`` (plain Python values, so ``torch.load(weights_only=True)`` reads it), which is
            how a resumed training run takes the same decisions.
        auto_period: with a detector, start with the detector's ``decay_period`` instead of ``decay_period``.
        base_scheduler: the schedule to multiply, built on ``optimizer`` before this wrapper (e.g. transformers'
            ``get_cosine_schedule_with_warmup``, ``StepLR``); ``None`` (default): the constant schedule.
        max_decays: the cap on decays (>= 1, default 1: the start only).
        cooldown: steps after a decay before the next one is accepted (>= 0, default 0).
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
        *,
        base_scheduler: LRScheduler | None = None,
        max_decays: int = 1,
        cooldown: int = 0,
    ) -> None:
        self.decay_period = _check_period(decay_period)
        min_lr_ratio = real("min_lr_ratio", min_lr_ratio, lambda x: 0.0 <= x <= 1.0, "0 <= min_lr_ratio <= 1")
        if start not in _STARTS:
            raise ValueError(f"start={start!r} is not accepted: accepted one of {_STARTS}")
        self.min_lr_ratio = float(min_lr_ratio)
        self.start = start
        if auto_period and detector is None:
            raise ValueError("auto_period=True needs a detector: pass detector=SurgeDetector(...)")
        if base_scheduler is not None:
            _check_base(base_scheduler, optimizer)
            if last_epoch != -1:
                raise ValueError(
                    f"last_epoch={last_epoch!r} with a base_scheduler: accepted -1 (the wrapper follows "
                    "the base scheduler's own step count)"
                )
        self.detector = detector
        self.auto_period = bool(auto_period)
        self.base_scheduler = base_scheduler
        self.max_decays = integer("max_decays", max_decays, lambda x: x >= 1, "an integer >= 1")
        self.cooldown = integer("cooldown", cooldown, lambda x: x >= 0, "an integer number of steps >= 0")
        #: Step count at which the factor's clock starts (``None`` until the first decay with ``"on_surge"``).
        self.trigger_step: int | None = 0 if start == "step0" else None
        #: Step counts of every decay, the start first.
        self.decay_steps: list[int] = [0] if start == "step0" else []
        super().__init__(optimizer, last_epoch)

    # ------------------------------------------------------------------------------------------- the schedule

    @property
    def decay_active(self) -> bool:
        """Whether the factor's clock runs (always with ``"step0"``; after the first decay otherwise)."""
        return self.trigger_step is not None

    @property
    def num_decays(self) -> int:
        return len(self.decay_steps)

    @property
    def factor(self) -> float:
        """``f(t)`` at the current step count: ``get_last_lr()`` is ``get_last_base_lr()`` times this."""
        return self._factor(self.last_epoch)

    def get_last_base_lr(self) -> list[float | torch.Tensor]:
        """``B_i(t)``: each group's LR under the base schedule (its initial LR without a base scheduler)."""
        if self.base_scheduler is None:
            return list(self.base_lrs)
        return list(self.base_scheduler.get_last_lr())

    def _factor(self, step: int) -> float:
        if self.trigger_step is None or step < self.trigger_step:
            return 1.0
        halvings = (step - self.trigger_step) // self.decay_period
        halvings += sum(1 for decay_step in self.decay_steps[1:] if decay_step <= step)
        return max(0.5**halvings, self.min_lr_ratio)

    def get_lr(self) -> list[float | torch.Tensor]:  # type: ignore[override]
        factor = self._factor(self.last_epoch)
        return [base_lr * factor for base_lr in self.get_last_base_lr()]

    def _apply(self) -> None:
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def step(self, epoch: None = None) -> None:  # type: ignore[override]
        """Advance one optimizer step: step the base scheduler, then set each group's LR to ``B_i(t) * f(t)``.

        Raises:
            ValueError: ``epoch`` is given (torch deprecated it; this schedule counts optimizer steps).
            RuntimeError: the base scheduler was stepped outside this wrapper.
        """
        if epoch is not None:
            raise ValueError(
                f"epoch={epoch!r} is not accepted: accepted None (LengthDecayLR counts optimizer steps; "
                "call step() once after each optimizer.step())"
            )
        first = self._step_count == 0  # LRScheduler.__init__ resets the count, then makes this first step
        self._step_count += 1
        base = self.base_scheduler
        if base is None:
            self.last_epoch += 1
        elif first:
            # The base made its own first step when it was built (ChainedScheduler keeps no count of its own).
            self.last_epoch = getattr(base, "last_epoch", 0)
        else:
            base_count = getattr(base, "last_epoch", self.last_epoch)
            if base_count != self.last_epoch:
                raise RuntimeError(
                    f"base_scheduler was stepped outside LengthDecayLR (its last_epoch={base_count}, "
                    f"LengthDecayLR's={self.last_epoch}): step only the LengthDecayLR, once per optimizer step"
                )
            # A chainable base (StepLR, CosineAnnealingLR, ...) computes its next LR from group["lr"]: give it its own.
            _set_lrs(self.optimizer, base.get_last_lr())
            base.step()
            self.last_epoch += 1
        self._apply()

    # ------------------------------------------------------------------------------------------- decays

    def _decay_allowed(self) -> bool:
        if len(self.decay_steps) >= self.max_decays:
            return False
        return not self.decay_steps or self.last_epoch - self.decay_steps[-1] >= self.cooldown

    def trigger(self, decay_period: int | None = None) -> bool:
        """Decay at the current step: start the clock (optionally with a new ``decay_period``) or, once started,
        halve the factor at once; refused within ``cooldown`` steps of the previous decay or past ``max_decays``.

        Returns:
            ``True`` if this call decayed, ``False`` if it was refused (the call then changes nothing).
        """
        if not self._decay_allowed():
            return False
        if self.trigger_step is None:
            if decay_period is not None:
                self.decay_period = _check_period(decay_period)
            self.trigger_step = self.last_epoch
        self.decay_steps.append(self.last_epoch)
        self._apply()  # a later decay lowers the LR of the coming optimizer step
        return True

    def observe_length(self, step: int, mean_length: float) -> bool:
        """Feed the detector one mean response length; decay when it reports a surge.

        After a reported surge, while ``max_decays`` allows another decay, the detector is re-armed (a fresh
        baseline) to report again no earlier than ``cooldown`` steps after the last decay (counted in the caller's
        ``step`` numbers from the report). A report the schedule refuses (a manual :meth:`trigger` or the
        ``"step0"`` start within the cooldown) re-arms it the same way.

        Returns:
            ``True`` at the step this call decayed.
        """
        if self.detector is None:
            raise ValueError("observe_length needs a detector: construct LengthDecayLR(..., detector=SurgeDetector())")
        detector = self.detector
        if not detector.update(step, mean_length):
            return False
        decayed = self.trigger(detector.decay_period if self.auto_period else None)
        if len(self.decay_steps) < self.max_decays:
            cooldown_left = self.cooldown - (self.last_epoch - self.decay_steps[-1]) if self.decay_steps else 0
            detector.rearm(not_before=detector.detections[-1][1] + max(cooldown_left, 0))
        return decayed

    # ------------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state with the base scheduler's and the detector's (plain Python values and lists)."""
        return {
            "decay_period": self.decay_period,
            "min_lr_ratio": self.min_lr_ratio,
            "start": self.start,
            "auto_period": self.auto_period,
            "trigger_step": self.trigger_step,
            "max_decays": self.max_decays,
            "cooldown": self.cooldown,
            "decay_steps": list(self.decay_steps),
            "base_lrs": list(self.base_lrs),
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "_last_lr": list(self._last_lr),
            "detector": None if self.detector is None else self.detector.state_dict(),
            "base_scheduler": None if self.base_scheduler is None else self.base_scheduler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (also one written by the first release, which had no base
        scheduler, cooldown or cap) and set each group's LR to the restored effective LR.

        The state's settings (period, floor, start, cap, cooldown) replace the constructor's, as in every torch
        scheduler: a resumed run continues the run that wrote the state.

        Raises:
            TypeError: ``state_dict`` is not a dict, or a value has the wrong type (one line naming the key).
            ValueError: one line naming the keys it lacks, or a value the constructor would refuse
                (``min_lr_ratio`` outside ``[0, 1]``, an unknown ``start``, ``max_decays < 1``, ``cooldown < 0``, a
                NaN or negative LR, ...), or when it was written with a base scheduler and this wrapper has none, or
                the other way round. Nothing is changed then.
        """
        state = state_dict
        require_keys("state_dict", state, _REQUIRED_KEYS, "a dict from LengthDecayLR.state_dict()")
        base_state = state.get("base_scheduler")
        if base_state is not None and self.base_scheduler is None:
            raise ValueError(
                "state_dict holds a base_scheduler's state but this LengthDecayLR wraps none: build it "
                "with the base_scheduler of the run that wrote the state"
            )
        if base_state is None and self.base_scheduler is not None:
            raise ValueError(
                f"state_dict has no base_scheduler state (its run had the constant schedule) but this LengthDecayLR "
                f"wraps {type(self.base_scheduler).__name__}: build it without base_scheduler to resume that run"
            )

        # Every value is checked as the constructor checks it, before anything is replaced: a state that breaks the
        # schedule's invariants (min_lr_ratio=2 doubles the LR at each "halving") is refused in one line naming the key.
        def key(name: str) -> str:
            return f"state_dict[{name!r}]"

        decay_period = _check_period(state["decay_period"], key("decay_period"))
        min_lr_ratio = real(
            key("min_lr_ratio"), state["min_lr_ratio"], lambda x: 0.0 <= x <= 1.0, "0 <= min_lr_ratio <= 1"
        )
        start = state["start"]
        if not isinstance(start, str) or start not in _STARTS:
            raise ValueError(f"{key('start')}={start!r} is out of range: accepted one of {_STARTS}")
        auto_period = boolean(key("auto_period"), state.get("auto_period", False))
        step = "an integer step >= 0"
        trigger_step = state["trigger_step"]
        if trigger_step is not None:
            trigger_step = integer(key("trigger_step"), trigger_step, lambda x: x >= 0, "None or " + step)
        if start == "step0" and trigger_step != 0:
            raise ValueError(
                f"{key('trigger_step')}={trigger_step!r} with start='step0': accepted 0 (the clock starts at step 0)"
            )
        max_decays = integer(key("max_decays"), state.get("max_decays", 1), lambda x: x >= 1, "an integer >= 1")
        cooldown = integer(
            key("cooldown"), state.get("cooldown", 0), lambda x: x >= 0, "an integer number of steps >= 0"
        )
        if "decay_steps" in state:
            decay_steps = _integer_list(key("decay_steps"), state["decay_steps"], step)
        else:  # the first release decayed once, at trigger_step
            decay_steps = [] if trigger_step is None else [trigger_step]
        if decay_steps and decay_steps[0] != trigger_step or trigger_step is not None and not decay_steps:
            raise ValueError(
                f"{key('decay_steps')}={decay_steps!r} does not start at {key('trigger_step')}="
                f"{trigger_step!r}: accepted the first decay at the trigger step"
            )
        if len(decay_steps) > max_decays or decay_steps != sorted(decay_steps):
            raise ValueError(
                f"{key('decay_steps')}={decay_steps!r} is out of range: accepted at most max_decays="
                f"{max_decays} steps in increasing order"
            )
        n_groups = len(self.optimizer.param_groups)
        base_lrs = _lr_list(key("base_lrs"), state["base_lrs"], n_groups)
        last_epoch = integer(key("last_epoch"), state["last_epoch"], lambda x: x >= -1, "an integer >= -1")
        step_count = integer(key("_step_count"), state.get("_step_count", 1), lambda x: x >= 0, "an integer >= 0")
        last_lr = _lr_list(key("_last_lr"), state["_last_lr"], n_groups)
        detector_state = state.get("detector")
        if detector_state is not None:
            SurgeDetector().load_state_dict(detector_state)  # its checks, before this scheduler changes

        self.decay_period, self.min_lr_ratio, self.start, self.auto_period = (
            decay_period,
            min_lr_ratio,
            start,
            auto_period,
        )
        self.trigger_step, self.max_decays, self.cooldown, self.decay_steps = (
            trigger_step,
            max_decays,
            cooldown,
            decay_steps,
        )
        self.base_lrs = base_lrs
        self.last_epoch = last_epoch
        self._step_count = step_count
        self._last_lr = last_lr
        if detector_state is not None:
            if self.detector is None:
                self.detector = SurgeDetector()
            self.detector.load_state_dict(detector_state)
        if base_state is not None:
            self.base_scheduler.load_state_dict(base_state)
        _set_lrs(self.optimizer, self._last_lr)
