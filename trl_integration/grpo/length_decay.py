"""The length-decay LR schedule in the trainer: a factor over trl's own schedule, fed trl's logged lengths, logged with
trl's metrics.

**The schedule** (:func:`length_decay_scheduler`, called by the trainer's ``create_scheduler``). transformers'
``Trainer.create_scheduler`` builds the base schedule ``B(t)`` from ``lr_scheduler_type``, the warm-up
(``warmup_steps``/``warmup_ratio``) and ``lr_scheduler_kwargs``, as without length decay; it is wrapped in
:class:`~safevocab.schedulers.LengthDecayLR`, so the LR of the optimizer step after ``t`` steps is

    ``lr(t) = B(t) * f(t)``,  ``f(t) = max(0.5 ** (floor((t - t_s) / P) + m(t)), r_min)`` from the start ``t_s``,
    1 before

(the maths is in :mod:`safevocab.schedulers`). ``lr_scheduler_type="constant"`` builds no base: transformers' constant
schedule is ``B(t) = lr`` (it has no warm-up; ``constant_with_warmup`` has one), which is what ``LengthDecayLR`` uses
without a base, so the LRs are the same and checkpoints written before length decay composed with trl's schedule
(``LengthDecayLR`` without a base, the only schedule it had then) resume with ``lr_scheduler_type="constant"``.
``reduce_lr_on_plateau`` and ``greedy``, which step on evaluation metrics, cannot be wrapped (the config refuses them).

**The surge detector** (:class:`LengthDecayCallback`). The trainer hands the callback the logs of every training
generation (trl's metrics of the batch, as ``ReduceLROnPlateau.step(metrics)`` is handed its metric); the callback
reads the global mean completion length there (``completions/mean_length``, already gathered over all processes, so
every rank takes the same decision) and, at the end of each optimizer step, hands the lengths read since to the
scheduler's :class:`~safevocab.surge_detector.SurgeDetector`, which decays when it reports a surge. The detector
exists with ``length_decay_start="on_surge"``, and with ``"step0"`` when ``length_decay_max_decays`` allows decays
after the start (:func:`uses_detector`). Its state lives in the scheduler's ``state_dict``, which the Trainer saves
in every checkpoint (``scheduler.pt``) and restores on resume.

**Metrics** (:data:`METRICS`), logged with trl's: those of the optimizer step just taken, as transformers logs
``learning_rate`` (the effective LR that step used, read after ``optimizer.step()`` and before the scheduler's step), so
that ``learning_rate == lr_base * length_decay/factor`` exactly (the product ``LengthDecayLR`` computes). The callback
reads them at ``on_optimizer_step``; the trainer adds them to the next training log (:meth:`LengthDecayCallback.
take_metrics`), one value per key: at a log, the value of the log's step (like ``learning_rate``), not a mean over
``logging_steps``. A surge detected at the end of step ``t`` lowers the LR of step ``t + 1``, and shows in that step's
metrics. ``length_decay/surge_step`` and ``length_decay/period`` are absent until known: trl would log an undefined
(NaN) value as ``None``, which TensorBoard's logger drops with a warning at every log.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from transformers import TrainerCallback

from safevocab.schedulers import LengthDecayLR

__all__ = [
    "LengthDecayCallback", "length_decay_scheduler", "wraps_base_schedule", "uses_detector", "step_metrics", "METRICS",
    "MEAN_LENGTH",
]  # fmt: skip

#: The metric of trl's generation logs the surge detector reads: the batch's global mean completion length.
MEAN_LENGTH = "completions/mean_length"

#: The callback's metrics and what they hold (docs/metrics.md). ``surge_step`` and ``period`` are logged once known.
METRICS = {
    "lr_base": "the base schedule's LR of the step (first parameter group): learning_rate = lr_base x factor",
    "length_decay/factor": "the length-decay factor of the step",
    "length_decay/active": "1 once the factor's clock runs (from step 0 with 'step0', from the first surge otherwise)",
    "length_decay/num_decays": "decays so far (the start and each accepted later surge)",
    "length_decay/surge_step": "the step at which the latest surge the detector reported started",
    "length_decay/period": "P, the steps between halvings, once the clock runs",
}


def wraps_base_schedule(args) -> bool:
    """Whether the length-decay schedule of ``args`` (a ``SafeVocabGRPOConfig``) wraps a base schedule built by
    transformers: every ``lr_scheduler_type`` but ``"constant"``, whose LR is the initial one."""
    return getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type) != "constant"


def uses_detector(args) -> bool:
    """Whether the length-decay schedule of ``args`` has a surge detector: it starts on the surge, or may decay after a
    ``"step0"`` start (``length_decay_max_decays`` > 1)."""
    return args.length_decay_start == "on_surge" or args.length_decay_max_decays > 1


def length_decay_scheduler(args, optimizer, base_scheduler=None) -> LengthDecayLR:
    """The :class:`~safevocab.schedulers.LengthDecayLR` of ``args`` (a ``SafeVocabGRPOConfig`` with ``length_decay``)
    over ``base_scheduler`` (built on ``optimizer`` by transformers; ``None`` for ``lr_scheduler_type="constant"``)."""
    return LengthDecayLR(
        optimizer,
        decay_period=args.length_decay_period_steps or 1,  # "auto": set from the detector at the start
        min_lr_ratio=args.length_decay_min_lr_ratio,
        start=args.length_decay_start,
        detector=args.make_surge_detector() if uses_detector(args) else None,
        auto_period=args.length_decay_auto_period,
        base_scheduler=base_scheduler,
        max_decays=args.length_decay_max_decays,
        cooldown=args.length_decay_cooldown,
    )


def step_metrics(scheduler: LengthDecayLR) -> dict[str, float]:
    """:data:`METRICS` of ``scheduler``'s current LR (its first parameter group's)."""
    out = {
        "lr_base": float(scheduler.get_last_base_lr()[0]),
        "length_decay/factor": scheduler.factor,
        "length_decay/active": float(scheduler.decay_active),
        "length_decay/num_decays": float(scheduler.num_decays),
    }
    detector = scheduler.detector
    if detector is not None and detector.detections:
        out["length_decay/surge_step"] = float(detector.detections[-1][0])
    if scheduler.decay_active:
        out["length_decay/period"] = float(scheduler.decay_period)
    return out


class LengthDecayCallback(TrainerCallback):
    """Feeds each training generation's mean completion length to the trainer's
    :class:`~safevocab.schedulers.LengthDecayLR` and hands its metrics to the trainer's log (see the module docstring).

    Args:
        scheduler: the trainer's current scheduler, when asked (the Trainer builds it after its callbacks).
    """

    def __init__(self, scheduler: Callable[[], object]) -> None:
        self._scheduler = scheduler
        #: Mean completion lengths of training generations read by :meth:`observe`, not yet seen by the schedule.
        self.pending_lengths: list[float] = []
        self._step_metrics: dict[str, float] = {}
        self._unlogged: dict[str, float] = {}

    def observe(self, logs: Mapping[str, Sequence[float]]) -> None:
        """Read the mean completion length of a training generation from its logs (trl's ``{name: [values]}``
        metrics, the batch's value last); nothing when they have none."""
        lengths = logs.get(MEAN_LENGTH)
        if lengths:
            self.pending_lengths.append(float(lengths[-1]))

    def take_metrics(self) -> dict[str, float]:
        """The :data:`METRICS` of the latest optimizer step not logged yet (then empty until the next step)."""
        metrics, self._unlogged = self._unlogged, {}
        return metrics

    def on_optimizer_step(self, args, state, control, **kwargs):
        # After optimizer.step(), before the scheduler's step: the schedule of the step just taken.
        lr_scheduler = self._scheduler()
        if isinstance(lr_scheduler, LengthDecayLR):
            self._step_metrics = step_metrics(lr_scheduler)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        lr_scheduler = self._scheduler()
        if not isinstance(lr_scheduler, LengthDecayLR):
            return control
        while self.pending_lengths:
            length = self.pending_lengths.pop(0)
            if lr_scheduler.detector is not None and math.isfinite(length):
                lr_scheduler.observe_length(state.global_step, length)
        # One value per key, replaced each step: the next log holds this step's value.
        self._unlogged = dict(self._step_metrics)
        return control
