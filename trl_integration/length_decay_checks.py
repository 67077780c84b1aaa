"""What ``length_decay=True`` cannot be combined with: an LR schedule or a warm-up it would silently replace.

The length-decay schedule (``safevocab.schedulers``, installed through the Trainer's ``create_scheduler``) keeps the
learning rate constant, then halves it; it replaces transformers' ``lr_scheduler_type`` and has no warm-up. So a
schedule other than ``constant`` (or trl's default ``linear``, indistinguishable from "not given") and any warm-up
are refused with one line instead of being ignored.
"""

from __future__ import annotations

__all__ = ["refuse_other_lr_schedules"]


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
