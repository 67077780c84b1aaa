"""Checkpoints that a kill cannot leave half-written, and resuming only from a checkpoint's whole state.

**Writing** (:func:`save_staged`). transformers writes ``checkpoint-N`` file by file straight into the run directory
(model, optimizer, scheduler, scaler, RNG, then ``trainer_state.json``), so a kill during a save leaves a
``checkpoint-N`` that ``resume_from_checkpoint=True`` picks and fails on. Here trl's and transformers' own save writes
``checkpoint-N`` inside the staging folder ``_incomplete-checkpoint-N`` of the run directory instead; once every
process has written its files, the saving process flushes them to disk (``fsync``) and moves the folder to
``checkpoint-N`` with one ``rename`` (atomic on POSIX file systems); only then are old checkpoints rotated out
(``save_total_limit``, transformers' own ``rotate_checkpoints``), so the newest complete checkpoint is never deleted
before the new one is complete. At any moment the run directory holds the complete new ``checkpoint-N`` or none of
it. Staging names start with ``_``: transformers' checkpoint globs (``checkpoint-*``) never see them and its Hub upload
skips them. A killed save's staging folder is ignored by resuming (named in its warning) and deleted by the next save.

**Complete** (:func:`checkpoint_problem`): a ``checkpoint-N`` folder

- without transformers' JIT-save marker ``checkpoint-is-incomplete.txt``,
- whose ``trainer_state.json`` parses,
- whose model weights are there and whole: ``model.safetensors``, ``adapter_model.safetensors``,
  ``pytorch_model.bin`` or ``adapter_model.bin``, or a ``*.index.json`` and every shard it names (a safetensors
  file is whole when its header covers the file exactly); DeepSpeed's ``global_step*`` and FSDP's
  ``pytorch_model_fsdp*`` layouts count as weights as they are,
- and whose every torch file (``*.pt``, ``*.pth``, ``*.bin``) is a whole zip archive (``torch.save``'s format).

Nothing this module writes is required, so a complete checkpoint of plain transformers or trl qualifies.

**Disk full**: one ``OSError`` naming ENOSPC and the folder (:mod:`~trl_integration.grpo.disk_full`); the staging
folder is deleted. Each save also writes ``safevocab_settings.json`` (:mod:`trl_integration.grpo.resume_settings`).
``args.safe_vocab_atomic_checkpoints=False`` saves in place, as transformers does (the resume checks stay).

**Resume state** (:func:`missing_state`). A checkpoint a run resumes from must also hold what the Trainer would
otherwise silently start fresh: the optimizer (``optimizer.pt``, or FSDP's ``optimizer*`` / DeepSpeed's
``global_step*``), ``scheduler.pt`` (transformers loads the optimizer and the scheduler only together; with
``length_decay`` it must hold the length-decay state: the trigger step and, with ``length_decay_start="on_surge"``,
the surge detector), the RNG (``rng_state.pth``, or ``rng_state_<r>.pth`` for each process ``r`` of a
multi-process run) and, when the run uses a gradient scaler (fp16), ``scaler.pt``. A checkpoint without them is
refused in one line naming the missing files; ``resume_allow_missing_state=True`` accepts it with a warning naming
what starts fresh. Under DeepSpeed, ``scheduler.pt`` is required only with ``length_decay`` (DeepSpeed's own
schedulers are saved in ``global_step*``).

**What it must match** (:mod:`~trl_integration.grpo.resume_settings`): a valid ``global_step``, the model's weight
names and shapes, ``max_steps`` >= its step, and its stored settings (``resume_allow_changed_settings``).

**The length-decay schedule's base** (:func:`length_decay_base_problem`). The length-decay state in ``scheduler.pt``
holds the base schedule's state, or none when the run had ``lr_scheduler_type="constant"`` (and in every checkpoint
written before length decay composed with trl's schedule, whose schedule was the constant one). A run that would
resume it with a base where there was none, or the other way round, is refused in one line naming the
``lr_scheduler_type`` to resume with, before anything is loaded; ``resume_allow_missing_state`` does not change that
(nothing is missing: the schedule differs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from trl_integration.grpo.disk_full import no_space_error
from trl_integration.grpo.length_decay import uses_detector
from trl_integration.grpo.resume_settings import (
    check_settings,
    checkpoint_step,
    trainer_state_problem,
    weights_loaded_elsewhere,
    weights_problem,
    write_settings,
)

__all__ = [
    "STAGING_PREFIX",
    "REPLACED_PREFIX",
    "JIT_MARKER",
    "AtomicCheckpoints",
    "save_staged",
    "publish",
    "remove_leftovers",
    "checkpoint_problem",
    "find_resume_checkpoint",
    "missing_state",
    "what_starts_fresh",
    "length_decay_base_problem",
    "checked_resume_checkpoint",
]

#: Prefix of the folder a checkpoint is written in before it is complete (``_incomplete-checkpoint-N``).
STAGING_PREFIX = "_incomplete-"
#: Prefix of an existing ``checkpoint-N`` moved aside while a save of the same step replaces it.
REPLACED_PREFIX = "_replaced-"
#: transformers' JIT save writes this file into ``checkpoint-N`` first and deletes it when the save is done.
JIT_MARKER = "checkpoint-is-incomplete.txt"

_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_WEIGHTS = (SAFE_WEIGHTS_NAME, ADAPTER_SAFE_WEIGHTS_NAME, WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")

# What starts fresh when a file is missing (for the warning of resume_allow_missing_state=True).
_OPTIMIZER_RESET = "the optimizer state and the learning-rate schedule (transformers loads the two only together)"
_RESET = {
    "rng": "the random-number generators",
    SCALER_NAME: "the fp16 loss scale",
    "length_decay": "the length-decay state (trigger step and surge detector)",
}


class AtomicCheckpoints:
    """The trainer's side (a mixin before :class:`~trl_integration._private.GRPOTrainerBridge`): checkpoints are
    written by :func:`save_staged`, and ``train`` checks ``resume_from_checkpoint`` first
    (:func:`checked_resume_checkpoint`)."""

    def save_checkpoint(self, model, trial) -> None:
        """trl's checkpoint, written so that a kill leaves the complete ``checkpoint-N`` or none (:func:`save_staged`);
        in place with ``args.safe_vocab_atomic_checkpoints=False`` (:func:`save_in_place`)."""
        if getattr(self.args, "safe_vocab_atomic_checkpoints", True):
            save_staged(self, model, trial)
        else:
            save_in_place(self, model, trial)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``. ``resume_from_checkpoint=True`` resumes from the newest *complete* checkpoint (one warning
        names what was skipped); a checkpoint that is incomplete, lacks its optimizer, scheduler or RNG state, holds
        other weights or unchangeable other settings is refused in one line (see the module docstring)."""
        checkpoint = checked_resume_checkpoint(self, resume_from_checkpoint)
        learning_rate = None if checkpoint is None else check_settings(self, checkpoint, checkpoint_step(checkpoint))
        if learning_rate is not None:
            self.add_callback(learning_rate)
        try:
            return super().train(
                resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        finally:
            if learning_rate is not None:
                self.remove_callback(learning_rate)


# ----------------------------------------------------------------------------------------------------------------
# writing


def save_staged(trainer, model, trial) -> None:
    """Write ``checkpoint-<global_step>`` with trl's own save into a staging folder, then publish it with one rename
    and rotate old checkpoints (see the module docstring). Collective: every process calls it, as transformers calls
    ``_save_checkpoint``; the processes that save (``args.should_save``) empty, publish and rotate."""
    args, state = trainer.args, trainer.state
    run_dir = trainer.checkpoint_run_dir(trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    staging, final = os.path.join(run_dir, STAGING_PREFIX + name), os.path.join(run_dir, name)
    if args.should_save:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save of this step left
        os.makedirs(staging)
    trainer.accelerator.wait_for_everyone()  # no process writes into the folder before it is emptied
    try:
        trainer.stock_save_checkpoint(model, trial, parent=staging)
        if args.should_save:
            write_settings(trainer, os.path.join(staging, name))
    except (OSError, RuntimeError) as error:
        full = no_space_error(error, name, staging)  # the space left measured before the clean-up
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written stays behind
        raise full or error  # noqa: B904 (the caught error itself, or its one-line ENOSPC form)
    trainer.accelerator.wait_for_everyone()  # every process has written its files (rng_state_<r>.pth, shards)
    if args.should_save:
        _settle_best_checkpoint(trainer, run_dir, os.path.join(staging, name))
        push = getattr(trainer, "push_in_progress", None)
        if args.push_to_hub and args.hub_strategy in ("checkpoint", "all_checkpoints") and push is not None:
            push.wait_until_done()  # it uploads from the staged folder, which is about to move
        publish(os.path.join(staging, name), final)
        remove_leftovers(run_dir)
        rotate_checkpoints(run_dir, args.save_total_limit, state.best_model_checkpoint, use_mtime=True)
    trainer.accelerator.wait_for_everyone()  # no process goes on before checkpoint-N exists
    if not args.should_save and args.local_process_index == 0 and os.path.isdir(staging):
        # A node that does not share the saving process's disk: its processes' files (rng_state_<r>.pth) end up in
        # its own checkpoint-N, as transformers leaves them.
        publish(os.path.join(staging, name), final)


def save_in_place(trainer, model, trial) -> None:
    """transformers' own save of ``checkpoint-N``, in place (not atomic), with the settings file; a full disk named."""
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    folder = os.path.join(trainer.checkpoint_run_dir(trial), name)
    try:
        trainer.stock_save_checkpoint(model, trial)
        if trainer.args.should_save and os.path.isdir(folder):
            write_settings(trainer, folder)
    except (OSError, RuntimeError) as error:
        raise no_space_error(error, name, folder, removed=False) or error  # noqa: B904 (as above)


def publish(staged: str, final: str) -> None:
    """Flush ``staged`` to disk and rename it to ``final`` (replacing an existing ``final``: transformers' JIT save
    creates it first), then delete the emptied staging folder."""
    _fsync_tree(staged)
    if os.path.exists(final):
        replaced = os.path.join(os.path.dirname(final), REPLACED_PREFIX + os.path.basename(final))
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
        os.rename(staged, final)
        shutil.rmtree(replaced, ignore_errors=True)
    elif os.path.isdir(staged):
        os.rename(staged, final)
    _fsync(os.path.dirname(final))
    shutil.rmtree(os.path.dirname(staged), ignore_errors=True)


def remove_leftovers(run_dir: str) -> None:
    """Delete the staging folders that killed saves left in ``run_dir`` (after a save completed)."""
    for entry in os.scandir(run_dir):
        if entry.is_dir() and entry.name.startswith((STAGING_PREFIX, REPLACED_PREFIX)):
            shutil.rmtree(entry.path, ignore_errors=True)


def _settle_best_checkpoint(trainer, run_dir: str, staged: str) -> None:
    """Set ``state.best_model_checkpoint`` as transformers sets it when it writes into the run directory.

    It looks for ``checkpoint-<best_global_step>`` in the folder it writes into: it finds the staged checkpoint (when
    the best step is this one) and misses an earlier one. The staged ``trainer_state.json`` is rewritten when this
    changes the value."""
    state, before = trainer.state, trainer.state.best_model_checkpoint
    if trainer.args.save_strategy in ("steps", "epoch", "best") and state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best):
            state.best_model_checkpoint = best
    state_file = os.path.join(staged, TRAINER_STATE_NAME)
    if state.best_model_checkpoint != before and os.path.isfile(state_file):
        state.save_to_json(state_file)


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a folder on a platform that cannot open one
        return
    try:
        os.fsync(fd)
    except OSError:  # a file system without fsync on folders
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------------
# reading


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` is not a complete checkpoint (see the module docstring), or ``None`` when it is one."""
    folder = Path(folder)
    if not folder.is_dir():
        return "no such folder"
    if (folder / JIT_MARKER).exists():
        return f"{JIT_MARKER}: transformers' JIT save did not finish"
    try:
        json.loads((folder / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{TRAINER_STATE_NAME} is missing"
    except (ValueError, OSError):
        return f"{TRAINER_STATE_NAME} is cut short"
    problem = _weights_problem(folder)
    if problem is not None:
        return problem
    for path in sorted(folder.iterdir()):
        if path.suffix in _TORCH_SUFFIXES and path.is_file() and not _whole_zip(path):
            return f"{path.name} is cut short"
    return None


def _weights_problem(folder: Path) -> str | None:
    for index_name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        index = folder / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError, OSError):
                return f"{index_name} is cut short"
            return next(filter(None, (_file_problem(folder / shard) for shard in shards)), None)
    present = [folder / name for name in _WEIGHTS if (folder / name).is_file()]
    if present:
        return next(filter(None, (_file_problem(path) for path in present)), None)
    if any(p.name.startswith(("global_step", "pytorch_model_fsdp")) for p in folder.iterdir()):
        return None  # DeepSpeed's and FSDP's own layouts
    return f"no model weights ({', '.join(_WEIGHTS)} or a sharded index)"


def _file_problem(path: Path) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    whole = _whole_safetensors(path) if path.suffix == ".safetensors" else _whole_zip(path)
    return None if whole else f"{path.name} is cut short"


def _whole_safetensors(path: Path) -> bool:
    """Whether the header parses and covers the file exactly (safetensors checks both when it opens a file)."""
    try:
        with safe_open(str(path), framework="pt"):
            return True
    except (SafetensorError, OSError):
        return False


def _whole_zip(path: Path) -> bool:
    """Whether the file ends with a zip central directory, which ``torch.save`` writes last."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


def find_resume_checkpoint(run_dir: str | os.PathLike) -> tuple[str | None, list[str]]:
    """The newest complete ``checkpoint-N`` of ``run_dir`` (``None`` if there is none) and what was passed over: every
    newer incomplete ``checkpoint-N`` and every staging folder a killed save left, each as ``"path (why)"``."""
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        return None, []
    entries = sorted(os.scandir(run_dir), key=lambda e: e.name)
    skipped = [
        f"{e.path} (left by an interrupted save)"
        for e in entries
        if e.is_dir() and e.name.startswith((STAGING_PREFIX, REPLACED_PREFIX))
    ]
    steps = sorted((int(m.group(1)), e.path) for e in entries if (m := _CHECKPOINT.match(e.name)) and e.is_dir())
    for _, path in reversed(steps):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path} ({problem})")
    return None, skipped


def missing_state(
    folder: str | os.PathLike,
    *,
    world_size: int = 1,
    length_decay: bool = False,
    surge_detector: bool = False,
    scaler: bool = False,
    deepspeed: bool = False,
) -> list[str]:
    """The resume state ``folder`` lacks (file names, see the module docstring); empty when it has it all.

    Args:
        world_size: the resuming run's process count (``rng_state_<r>.pth`` for each ``r`` when > 1).
        length_decay: ``scheduler.pt`` must hold :class:`~safevocab.schedulers.LengthDecayLR`'s state.
        surge_detector: ... and its surge detector's (``length_decay_start="on_surge"``).
        scaler: the run uses a gradient scaler (fp16): ``scaler.pt``.
        deepspeed: DeepSpeed keeps optimizer and scheduler in ``global_step*``.
    """
    folder = Path(folder)
    names = {p.name for p in folder.iterdir()}
    folders = {n for n in names if (folder / n).is_dir()}
    missing = []
    has_optimizer = OPTIMIZER_NAME in names or "optimizer.bin" in names or any("optimizer" in n for n in folders)
    if not has_optimizer and not (deepspeed and any(n.startswith("global_step") for n in folders)):
        missing.append(OPTIMIZER_NAME)
    if SCHEDULER_NAME not in names:
        if length_decay or not deepspeed:
            missing.append(SCHEDULER_NAME)
    elif length_decay and not _has_length_decay_state(folder / SCHEDULER_NAME, surge_detector):
        missing.append(f"the length-decay state in {SCHEDULER_NAME}")
    rng = ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{r}.pth" for r in range(world_size)]
    missing += [name for name in rng if name not in names]
    if scaler and SCALER_NAME not in names:
        missing.append(SCALER_NAME)
    return missing


def _length_decay_state(path: Path) -> dict | None:
    """The ``LengthDecayLR`` state in a ``scheduler.pt`` (it has the trigger step); ``None`` for any other."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any scheduler state torch cannot read safely is not the length-decay one
        return None
    return state if isinstance(state, dict) and "trigger_step" in state else None


def _has_length_decay_state(path: Path, surge_detector: bool) -> bool:
    """Whether a ``scheduler.pt`` holds ``LengthDecayLR``'s trigger step (and its detector's state)."""
    state = _length_decay_state(path)
    return state is not None and (not surge_detector or "detector" in state)


def length_decay_base_problem(folder: str | os.PathLike, lr_scheduler_type: str) -> str | None:
    """Why the length-decay state in ``folder/scheduler.pt`` cannot resume a run with ``lr_scheduler_type`` (whose
    length decay wraps a base schedule unless it is ``"constant"``), or ``None`` when it can or there is no such
    state (:func:`missing_state` names that)."""
    state = _length_decay_state(Path(folder) / SCHEDULER_NAME)
    if state is None or (state.get("base_scheduler") is not None) == (lr_scheduler_type != "constant"):
        return None
    if lr_scheduler_type != "constant":
        return (
            "holds a length-decay schedule without a base schedule (written with lr_scheduler_type='constant', or "
            f"before length decay composed with trl's schedules), but lr_scheduler_type={lr_scheduler_type!r} builds "
            "one: resume with lr_scheduler_type='constant' (--lr_scheduler_type constant), the schedule it trained with"
        )
    return (
        "holds a length-decay schedule over a base schedule, but lr_scheduler_type='constant' builds none: resume "
        "with the lr_scheduler_type, warm-up and lr_scheduler_kwargs of the run that wrote it"
    )


def what_starts_fresh(missing: list[str], length_decay: bool = False) -> str:
    """The state the Trainer starts fresh when it resumes without ``missing`` (names from :func:`missing_state`)."""
    parts = []
    if OPTIMIZER_NAME in missing or SCHEDULER_NAME in missing:
        parts.append(_OPTIMIZER_RESET + (", and with it " + _RESET["length_decay"] if length_decay else ""))
    elif any(name.startswith("the length-decay state") for name in missing):
        parts.append(_RESET["length_decay"])
    if any(name.startswith("rng_state") for name in missing):
        parts.append(_RESET["rng"])
    if SCALER_NAME in missing:
        parts.append(_RESET[SCALER_NAME])
    return "; ".join(parts)


def checked_resume_checkpoint(trainer, resume_from_checkpoint):
    """The checkpoint ``trainer.train(resume_from_checkpoint)`` resumes from, checked (see the module docstring).

    ``True``: the newest complete checkpoint of ``args.output_dir``; one warning (main process) names each newer
    incomplete checkpoint and each staging folder passed over. A path: refused unless it is complete. Either way,
    a checkpoint lacking resume state is refused, or accepted with a warning when
    ``args.resume_allow_missing_state``. ``None``/``False``: ``None``.

    Raises:
        ValueError: one line naming the checkpoint and what is wrong with it.
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    args, main = trainer.args, trainer.is_world_process_zero()
    if resume_from_checkpoint is True:
        checkpoint, skipped = find_resume_checkpoint(args.output_dir)
        if checkpoint is None:
            passed = f" (passed over: {'; '.join(skipped)})" if skipped else ""
            raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {args.output_dir}{passed}")
        if skipped and main:
            warnings.warn(
                f"resume_from_checkpoint=True: skipped incomplete {'; '.join(skipped)}; resuming from {checkpoint}",
                UserWarning,
                stacklevel=3,
            )
    else:
        checkpoint = os.fspath(resume_from_checkpoint)
        problem = checkpoint_problem(checkpoint)
        if problem is not None:
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r} is not a complete checkpoint: {problem}; resume from an "
                "earlier checkpoint-N, or pass resume_from_checkpoint=True for the newest complete one"
            )
    problem = trainer_state_problem(checkpoint) or (
        None if weights_loaded_elsewhere(trainer) else weights_problem(trainer.model, checkpoint))  # fmt: skip
    if problem is not None:
        raise ValueError(f"resume_from_checkpoint={checkpoint!r}: {problem}")
    length_decay = bool(getattr(args, "length_decay", False))
    if length_decay:
        schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        problem = length_decay_base_problem(checkpoint, schedule)
        if problem is not None:
            raise ValueError(f"resume_from_checkpoint={checkpoint!r} {problem}")
    missing = missing_state(
        checkpoint,
        world_size=args.world_size,
        length_decay=length_decay,
        surge_detector=length_decay and uses_detector(args),
        scaler=getattr(trainer.accelerator, "scaler", None) is not None,
        deepspeed=bool(getattr(trainer, "is_deepspeed_enabled", False)),
    )
    if missing and not getattr(args, "resume_allow_missing_state", False):
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} lacks {', '.join(missing)}: resuming would silently start "
            f"{what_starts_fresh(missing, length_decay)} fresh; resume from a checkpoint that has them, or set "
            "resume_allow_missing_state=True (--resume_allow_missing_state true) to accept that"
        )
    if missing and main:
        warnings.warn(
            f"resuming from {checkpoint} without {', '.join(missing)} (resume_allow_missing_state=True): "
            f"{what_starts_fresh(missing, length_decay)} start fresh",
            UserWarning,
            stacklevel=3,
        )
    return checkpoint
