"""Runs that finish without training anything useful fail loudly: :class:`BrokenRunError` and its callback.

trl keeps training when every reward of a step is missing (``None``) or non-finite: the group advantages are
0, the loss is 0 and the run ends with status 0. ``safevocab-grpo`` stops instead, with one line and exit
status 1 (:data:`BROKEN_RUN`):

- :class:`RewardGuard` (a ``transformers.TrainerCallback``) checks each training log: when the mean of every
  reward function (trl's ``rewards/<name>/mean``, a ``nanmean`` over the step's completions) is non-finite,
  that step had no usable reward at all;
- :func:`check_trained` after training: a run that took no optimizer step (e.g. fewer prompts than one
  batch) trained nothing.
"""

from __future__ import annotations

import math

from transformers import TrainerCallback

__all__ = ["BROKEN_RUN", "BrokenRunError", "RewardGuard", "check_trained"]

#: Exit status of a run that started but trained nothing useful (a bad command line exits with 2).
BROKEN_RUN = 1


class BrokenRunError(RuntimeError):
    """A run that cannot train anything useful; its message is one line."""


class RewardGuard(TrainerCallback):
    """Raise :class:`BrokenRunError` at the first training log whose reward means are all non-finite."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        means = {
            key: value for key, value in (logs or {}).items() if key.startswith("rewards/") and key.endswith("/mean")
        }
        if means and not any(isinstance(v, (int, float)) and math.isfinite(v) for v in means.values()):
            names = ", ".join(key[len("rewards/") : -len("/mean")] for key in means)
            raise BrokenRunError(
                f"step {state.global_step}: every reward was missing (None) or non-finite (reward functions: {names}); "
                "check that they return a float per completion"
            )


def check_trained(trainer) -> None:
    """Raise :class:`BrokenRunError` when ``trainer`` took no optimizer step."""
    if trainer.state.global_step == 0:
        raise BrokenRunError(
            "the run took no training step: the dataset gives fewer prompts than one batch "
            "(--per_device_train_batch_size x processes x --gradient_accumulation_steps / --num_generations)"
        )
