"""The config's checks of the length-decay settings, each a one-line error naming the field: the period (``"auto"``
or an integer >= 1), the start, the LR floor, the surge detector's settings, and what ``length_decay=True`` cannot
be combined with: an LR schedule or a warm-up it would silently replace.

The length-decay schedule (``safevocab.schedulers``, installed through the Trainer's ``create_scheduler``) keeps the
learning rate constant, then halves it; it replaces transformers' ``lr_scheduler_type`` and has no warm-up. So a
schedule other than ``constant`` (or trl's default ``linear``, indistinguishable from "not given") and any warm-up
are refused with one line instead of being ignored.
"""

from __future__ import annotations

from safevocab.validation import real
from trl_integration.enums import LENGTH_DECAY_STARTS

__all__ = ["check_length_decay", "refuse_other_lr_schedules"]


def check_length_decay(config) -> None:
    """Validate (and normalise in place) the ``length_decay*`` and ``length_surge_*`` fields of a
    ``SafeVocabGRPOConfig``. Raises ``ValueError`` (one line naming the field)."""
    # Kept as a string ('auto' or digits) so the command line and YAML take both forms.
    period = str(config.length_decay_period).strip().lower()
    if period != "auto":
        value = int(period) if period.lstrip("-").isdigit() else 0
        if value < 1:
            raise ValueError(
                f"length_decay_period={config.length_decay_period!r} is not accepted: accepted 'auto' or an "
                "integer >= 1"
            )
        period = str(value)
    config.length_decay_period = period
    if config.length_decay_start not in LENGTH_DECAY_STARTS:
        raise ValueError(
            f"length_decay_start={config.length_decay_start!r} is not accepted: accepted 'on_surge' or 'step0'"
        )
    if config.length_decay and config.length_decay_start == "step0" and config.length_decay_auto_period:
        raise ValueError(
            "length_decay_start='step0' needs an integer length_decay_period (no surge is detected to derive "
            "'auto' from): e.g. --length_decay_period 200"
        )
    if config.length_decay:
        refuse_other_lr_schedules(config)
    # Build the scheduler's pieces once here, so a bad value fails at construction, not at step 0.
    config.make_surge_detector()
    config.length_decay_min_lr_ratio = real(
        "length_decay_min_lr_ratio", config.length_decay_min_lr_ratio, lambda r: 0.0 <= r <= 1.0, "0 <= ratio <= 1"
    )


def refuse_other_lr_schedules(config) -> None:
    """Raise ``ValueError`` (one line naming the field) when ``config`` asks for a schedule or a warm-up that
    length decay would replace. ``config``: a ``SafeVocabGRPOConfig`` with ``length_decay=True``."""
    schedule = getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)
    if schedule not in ("linear", "constant"):
        raise ValueError(
            f"lr_scheduler_type={schedule!r} with length_decay=True: length decay replaces the LR schedule "
            "(constant, then halved); drop --lr_scheduler_type or set --length_decay false"
        )
    for name in ("warmup_steps", "warmup_ratio"):
        if (getattr(config, name, 0) or 0) > 0:
            raise ValueError(
                f"{name}={getattr(config, name)!r} with length_decay=True: length decay has no warm-up; drop "
                f"--{name} or set --length_decay false"
            )
