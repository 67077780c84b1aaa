"""What a checkpoint must match to be resumed: its weights, its ``trainer_state.json``, and the settings it trained with.

**Weights** (:func:`weights_problem`). transformers loads ``model.safetensors`` with ``load_state_dict(strict=False)``:
a file holding other tensors (another model's) resumes with exit 0, a log line naming the missing keys, untrained
weights and the checkpoint's optimizer state. The file's tensor names and shapes (read from its header, no tensor
loaded) must be the model's: every model tensor present (a tied copy, e.g. ``lm_head.weight`` tied to the embeddings,
may be absent, as ``save_pretrained`` writes one of them), none unknown, each of the model's shape. Checked for
``model.safetensors`` and a sharded ``model.safetensors.index.json``; adapters (PEFT), ``.bin`` files, DeepSpeed and
FSDP layouts are loaded by their own code and not checked here.

**Trainer state** (:func:`trainer_state_problem`): ``trainer_state.json`` must be a JSON object whose ``global_step``
is an integer >= 0 (``-3`` was accepted; ``{}`` failed later with a TypeError that named nothing).

**Settings** (:func:`write_settings`, :func:`check_settings`). Each checkpoint holds ``safevocab_settings.json``
beside ``trainer_state.json``: the settings a resumed run must agree with (:func:`run_settings`). On resume each
stored setting is compared with the new run's:

- *refused* unless named in ``resume_allow_changed_settings`` (one line naming each setting, its old and new value and
  the field that accepts it): the rule (``safe_vocab_rule``, ``safe_vocab_effective_rule``, ``rule_engine``, the
  engine order the rule composes in), the length-decay settings (``length_decay*``, ``length_surge_*``; restored from
  ``scheduler.pt``, so a new value would be silently ignored: with the opt-out the checkpoint's values go on), and
  the model's identity (``model_config_class``, ``model_vocab_size``, ``model_hidden_size``,
  ``model_num_parameters``);
- *honoured, with one warning* naming them: ``learning_rate`` (``scheduler.pt`` restores the old base LR; the new one
  is applied to the restored schedule and optimizer by scaling every base and current LR by new / old, from the
  first resumed step), ``lr_scheduler_type``, ``lr_scheduler_kwargs`` and the warm-up (the schedule is rebuilt from
  the new settings and restored at the checkpoint's step, so it takes effect from the step after the first resumed
  one), and ``max_steps`` (the schedule's horizon);
- ``max_steps`` below the checkpoint's ``global_step`` is refused (the Trainer would train one more step).

A checkpoint written before this file existed (plain trl or transformers, or an earlier release) resumes with one
warning that its settings cannot be checked.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME

from trl_integration.harness.checkpoint_identity import (
    SETTINGS_NAME,
    WHY_REFUSED,
    read_settings,
    refused_settings_message,
    shape_problems,
    stored_shapes,
)
from trl_integration.options import LENGTH_DECAY_SETTINGS, RESUME_ALLOW_FIELD, RESUME_REFUSED_SETTINGS, RULE_SETTINGS

__all__ = [
    "HONOURED_SETTINGS",
    "run_settings",
    "write_settings",
    "trainer_state_problem",
    "weights_problem",
    "check_settings",
    "ResumedLearningRate",
    "checkpoint_step",
    "weights_loaded_elsewhere",
]

_SCHEDULE = ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "max_steps")

#: Settings a resume honours when they change (with one warning). Those it refuses to change unless named in
#: ``resume_allow_changed_settings`` (:data:`~trl_integration.options.RESUME_ALLOW_FIELD`) are
#: :data:`~trl_integration.options.RESUME_REFUSED_SETTINGS`.
HONOURED_SETTINGS: tuple[str, ...] = _SCHEDULE


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (an enum by its value, a tuple as a list)."""
    value = getattr(value, "value", value)
    return json.loads(json.dumps(value, default=str))


def run_settings(trainer) -> dict[str, Any]:
    """The settings of ``trainer``'s run that a resumed run must agree with (see the module docstring)."""
    args, model = trainer.args, trainer.accelerator.unwrap_model(trainer.model)
    settings = {name: getattr(args, name, None) for name in RULE_SETTINGS}
    settings.update({name: getattr(args, name) for name in _SCHEDULE if hasattr(args, name)})
    settings.update({name: getattr(args, name, None) for name in LENGTH_DECAY_SETTINGS})
    config = getattr(model, "config", None)
    settings["model_config_class"] = type(config).__name__ if config is not None else type(model).__name__
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    settings["model_vocab_size"] = getattr(text_config, "vocab_size", None)
    settings["model_hidden_size"] = getattr(text_config, "hidden_size", None)
    settings["model_num_parameters"] = sum(p.numel() for p in model.parameters())
    return {name: _plain(value) for name, value in settings.items()}


def write_settings(trainer, folder: str | os.PathLike) -> None:
    """Write :func:`run_settings` to ``folder/safevocab_settings.json``."""
    text = json.dumps({"format": 1, "settings": run_settings(trainer)}, indent=2, sort_keys=True)
    Path(folder, SETTINGS_NAME).write_text(text + "\n", encoding="utf-8")


def trainer_state_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder/trainer_state.json`` cannot be resumed from (a ``global_step`` that is not an integer >= 0), or
    ``None``. A missing or unparsable file is :func:`~trl_integration.harness.checkpoint_files.checkpoint_problem`'s."""
    path = Path(folder, TRAINER_STATE_NAME)
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None
    if not isinstance(state, dict):
        return f"{path} holds {type(state).__name__} {json.dumps(state)[:40]}: expected a JSON object (TrainerState)"
    if "global_step" not in state:
        return f"{path} has no global_step: expected an integer >= 0"
    step = state["global_step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"{path}: global_step={step!r} is out of range: expected an integer >= 0"
    return None


def checkpoint_step(folder: str | os.PathLike) -> int:
    """The ``global_step`` of ``folder/trainer_state.json`` (checked by :func:`trainer_state_problem` first)."""
    return int(json.loads(Path(folder, TRAINER_STATE_NAME).read_text(encoding="utf-8"))["global_step"])


# ----------------------------------------------------------------------------------------------------------------
# weights


def weights_loaded_elsewhere(trainer) -> bool:
    """Whether the checkpoint's weights are loaded by code other than ``load_state_dict`` of ``model.safetensors``
    (PEFT adapters, DeepSpeed, FSDP), which :func:`weights_problem` leaves alone."""
    from accelerate.utils import is_peft_model

    return bool(is_peft_model(trainer.model) or getattr(trainer, "is_deepspeed_enabled", False)
                or getattr(trainer, "is_fsdp_enabled", False))  # fmt: skip


def weights_problem(model: torch.nn.Module, folder: str | os.PathLike) -> str | None:
    """Why the safetensors weights in ``folder`` are not ``model``'s (names and shapes, see the module docstring),
    or ``None`` when they are, or when the checkpoint holds no safetensors weights."""
    folder = Path(folder)
    try:
        stored = stored_shapes(folder)
    except (OSError, ValueError, KeyError, struct.error):
        return None  # a cut-short file is checkpoint_problem's to name
    if stored is None:
        return None
    file_name, shapes = stored
    state = model.state_dict()
    expected = {name: tuple(tensor.shape) for name, tensor in state.items()}
    present_storage = {_storage(state[name]) for name in expected.keys() & shapes.keys()}
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    missing = [
        name
        for name in expected
        if name not in shapes and name not in ignored and _storage(state[name]) not in present_storage
    ]  # fmt: skip  (a tied copy need not be stored)
    parts = shape_problems(shapes, expected, missing)
    if not parts:
        return None
    return (f"{folder / file_name} does not hold this model's weights: {'; '.join(parts)}; resume from a checkpoint "
            f"of this model ({type(model).__name__}), or load the model it was trained from")  # fmt: skip


def _storage(tensor: torch.Tensor) -> tuple:
    """What identifies a tensor's memory (tied weights share it)."""
    try:
        return (tensor.device.type, tensor.untyped_storage().data_ptr(), tensor.storage_offset())
    except (RuntimeError, NotImplementedError):  # meta or wrapper tensors: never considered tied
        return (id(tensor),)


# ----------------------------------------------------------------------------------------------------------------
# settings


def _changed(stored: dict, current: dict) -> list[tuple[str, Any, Any]]:
    length_decay = bool(stored.get("length_decay")) or bool(current.get("length_decay"))
    constant = stored.get("lr_scheduler_type") == current.get("lr_scheduler_type") == "constant"
    changes = []
    for name, new in current.items():
        if name not in stored or (name in LENGTH_DECAY_SETTINGS and name != "length_decay" and not length_decay):
            continue  # not stored by the checkpoint's release; length-decay details without length decay
        if name == "max_steps" and constant:
            continue  # the constant schedule does not depend on it
        old = stored[name]
        if old != new:  # numbers by value: a stored 2 and a new 2.0 are the same setting
            changes.append((name, old, new))
    return changes


def check_settings(trainer, checkpoint: str, global_step: int) -> ResumedLearningRate | None:
    """Compare the settings stored in ``checkpoint`` with ``trainer``'s (see the module docstring): raise for a
    refused change, warn (main process) for honoured ones. Returns the callback that applies a changed
    ``learning_rate`` to the restored schedule, or ``None``.

    Raises:
        ValueError: one line naming each refused setting with its old and new value and the opt-out, or
            ``max_steps`` below the checkpoint's step.
    """
    args, main = trainer.args, trainer.is_world_process_zero()
    if 0 < args.max_steps < global_step:
        raise ValueError(
            f"max_steps={args.max_steps} is below the step of resume_from_checkpoint={checkpoint!r} "
            f"(global_step={global_step}): accepted max_steps >= {global_step}, or resume from an earlier checkpoint"
        )
    stored = read_settings(checkpoint)
    if stored is None:
        if main:
            warnings.warn(f"resuming from {checkpoint}, which has no {SETTINGS_NAME} (written by plain trl or an earlier "
                          "release): its rule, learning-rate schedule and model cannot be checked against this run's",
                          UserWarning, stacklevel=4)  # fmt: skip
        return None
    allowed = set(getattr(args, RESUME_ALLOW_FIELD, None) or ())
    changes = _changed(stored, run_settings(trainer))
    refused = [c for c in changes if c[0] in RESUME_REFUSED_SETTINGS and c[0] not in allowed]
    if refused:
        first = refused[0][0]  # the reason given is the first refused setting's group's
        group = "rule" if first in RULE_SETTINGS else "length_decay" if first in LENGTH_DECAY_SETTINGS else "model"
        raise ValueError(refused_settings_message(checkpoint, refused, WHY_REFUSED[group]))
    honoured = [c for c in changes if c[0] not in RESUME_REFUSED_SETTINGS]
    accepted = [c for c in changes if c[0] in RESUME_REFUSED_SETTINGS]
    if (honoured or accepted) and main:
        listed = ", ".join(f"{name} {old!r} -> {new!r}" for name, old, new in honoured + accepted)
        how = (" (honoured: the schedule is rebuilt from this run's settings at the checkpoint's step, and a new "
               "learning_rate scales the restored LRs)") if honoured else ""  # fmt: skip
        note = f"; {RESUME_ALLOW_FIELD} accepts {[c[0] for c in accepted]}" if accepted else ""
        warnings.warn(
            f"resuming from {checkpoint} with changed settings: {listed}{how}{note}", UserWarning, stacklevel=4
        )
    old_lr = next((old for name, old, _ in honoured if name == "learning_rate"), None)
    # transformers restores the optimizer and the schedule only together (optimizer.pt or FSDP's optimizer*)
    restored = Path(checkpoint, SCHEDULER_NAME).is_file() and any(Path(checkpoint).glob("optimizer*"))
    if not old_lr or not restored or getattr(trainer, "is_deepspeed_enabled", False):
        return None  # nothing restores the old LR (a fresh schedule already has the new one), or DeepSpeed's own does
    return ResumedLearningRate(float(args.learning_rate) / float(old_lr))


class ResumedLearningRate(TrainerCallback):
    """Applies a changed ``learning_rate`` to the schedule and optimizer ``scheduler.pt``/``optimizer.pt`` restored:
    every base and current LR times ``factor`` (new / old), once, when training begins (after the Trainer has loaded
    them). Exact for transformers' schedules (``LambdaLR``: ``lr = base_lr * lambda(step)``) and for length decay
    over them."""

    def __init__(self, factor: float):
        self.factor = factor
        self.applied = False

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if self.applied or optimizer is None:
            return
        self.applied = True
        scheduler = lr_scheduler
        while scheduler is not None:
            if not hasattr(scheduler, "base_lrs") and hasattr(scheduler, "scheduler"):  # accelerate's wrapper
                scheduler = scheduler.scheduler
                continue
            for attribute in ("base_lrs", "_last_lr"):
                values = getattr(scheduler, attribute, None)
                if isinstance(values, list):
                    setattr(scheduler, attribute, [value * self.factor for value in values])
            scheduler = getattr(scheduler, "base_scheduler", None)
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if isinstance(group.get(key), torch.Tensor):
                    group[key].mul_(self.factor)
                elif key in group:
                    group[key] = group[key] * self.factor
