"""What a complete checkpoint is, and what a resume checks before it loads one.

**Complete** (:func:`checkpoint_problem`): a ``checkpoint-N`` folder

- without transformers' JIT-save marker ``checkpoint-is-incomplete.txt``,
- whose ``trainer_state.json`` parses,
- whose model weights are there and whole: ``model.safetensors``, ``adapter_model.safetensors``,
  ``pytorch_model.bin`` or ``adapter_model.bin``, or a ``*.index.json`` and every shard it names (a safetensors
  file is whole when its header covers the file exactly); DeepSpeed's ``global_step*`` and FSDP's
  ``pytorch_model_fsdp*`` layouts count as weights as they are,
- and whose every torch file (``*.pt``, ``*.pth``, ``*.bin``) is a whole zip archive (``torch.save``'s format).

Nothing this module writes is required, so a complete checkpoint of plain transformers or trl qualifies.

**Resume state** (:func:`missing_state`). A checkpoint a run resumes from must also hold what the Trainer would
otherwise silently start fresh: the optimizer (``optimizer.pt``, or FSDP's ``optimizer*`` / DeepSpeed's
``global_step*``), ``scheduler.pt`` (transformers loads the optimizer and the scheduler only together; with
``length_decay`` it must hold the length-decay state: the trigger step and, with ``length_decay_start="on_surge"``,
the surge detector), the RNG (``rng_state.pth``, or ``rng_state_<r>.pth`` for each process ``r`` of a
multi-process run) and, when the run uses a gradient scaler (fp16), ``scaler.pt``. A checkpoint without them is
refused in one line naming the missing files; ``resume_allow_missing_state=True`` accepts it with a warning naming
what starts fresh. Under DeepSpeed, ``scheduler.pt`` is required only with ``length_decay`` (DeepSpeed's own
schedulers are saved in ``global_step*``).

**Resume state read the safe way** (:func:`state_problem`), before the Trainer reads it, so that a file that cannot be
used is named. transformers loads ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and the RNG states deep inside
``train``, and a file that is not what it expects fails there without naming it: a hand-edited ``optimizer.pt`` holding
``{}`` gave ``KeyError: 'param_groups'``, a ``scheduler.pt`` holding ``[1, 2]`` a raw message, and a planted malicious
pickle torch's ``UnpicklingError``, which names no file and suggests ``weights_only=False`` (issue 57). Each present
file is loaded first as the Trainer will, with ``torch.load(weights_only=True)`` and the Trainer's own allowlist
(numpy's RNG state; memory-mapped: the tensors are not read), and its structure checked:

- ``optimizer.pt``: a dict with ``state`` and ``param_groups`` (``torch.optim.Optimizer.state_dict()``);
- ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``: a dict.

A file torch refuses to load safely is named with what torch found (for example an unsupported global such as
``posix.system``) and the safe advice: restore the file from the run that wrote it; nothing in it was executed.

**What it must match** (:mod:`~trl_integration.harness.resume_settings`): a valid ``global_step``, the model's weight
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
import pickle
import re
import warnings
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from trl_integration.grpo.length_decay import uses_detector
from trl_integration.harness.manifest import MANIFEST_NAME, manifest_problem
from trl_integration.harness.resume_settings import trainer_state_problem, weights_loaded_elsewhere, weights_problem

__all__ = [
    "STAGING_PREFIX",
    "REPLACED_PREFIX",
    "JIT_MARKER",
    "checkpoint_problem",
    "find_resume_checkpoint",
    "missing_state",
    "what_starts_fresh",
    "length_decay_base_problem",
    "checked_resume_checkpoint",
    "STATE_FILES",
    "state_problem",
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

#: The resume state files checked here (``rng_state_<r>.pth`` of a multi-process run too).
STATE_FILES = (OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME, "rng_state.pth")

_RNG = re.compile(r"^rng_state(_\d+)?\.pth$")
_TORCH_ADVICE = re.compile(r"Weights only load failed\..*?Do it only if you got the file from a trusted source\.", re.S)

# What starts fresh when a file is missing (for the warning of resume_allow_missing_state=True).
_OPTIMIZER_RESET = "the optimizer state and the learning-rate schedule (transformers loads the two only together)"
_LENGTH_DECAY_RESET = "the length-decay state (trigger step and surge detector)"


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


def _what_torch_found(err: Exception) -> str:
    """torch's reason without its advice to load with ``weights_only=False`` (which would run the file's code)."""
    text = _TORCH_ADVICE.sub("", str(err))
    text = text.split("Check the documentation of torch.load")[0]
    return " ".join(text.split()) or type(err).__name__


def _structure_problem(name: str, value: object) -> str | None:
    if not isinstance(value, dict):
        return f"{name} holds a {type(value).__name__}, not the dict the Trainer saves"
    if name == OPTIMIZER_NAME:
        missing = [key for key in ("state", "param_groups") if key not in value]
        if missing:
            return f"{name} lacks {', '.join(map(repr, missing))}: it is not an optimizer's state_dict()"
    return None


def state_problem(folder: str | os.PathLike) -> str | None:
    """Why a resume state file of ``folder`` cannot be used (see the module docstring), or ``None``."""
    folder = Path(folder)
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and (p.name in STATE_FILES or _RNG.match(p.name)))
    from trl_integration._private import trainer_safe_globals

    for name in names:
        try:
            with trainer_safe_globals():  # what the Trainer allows in these files (numpy's RNG state), no more
                value = torch.load(folder / name, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            return (f"{name} cannot be loaded safely ({_what_torch_found(err)}): it holds objects other than tensors "
                    "and plain containers, which loading would run as code; nothing was run. Restore the file from the "
                    "run that wrote it, or resume from another checkpoint")  # fmt: skip
        except (RuntimeError, OSError, EOFError, ValueError) as err:
            return f"{name} is not a file torch.save wrote ({_what_torch_found(err)}): restore it, or resume from another checkpoint"
        problem = _structure_problem(name, value)
        if problem is not None:
            return problem + ": restore it, or resume from another checkpoint"
    return None


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
    elif length_decay:
        state = _length_decay_state(folder / SCHEDULER_NAME)  # the trigger step, and the detector's state when used
        if state is None or (surge_detector and "detector" not in state):
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
        parts.append(_OPTIMIZER_RESET + (", and with it " + _LENGTH_DECAY_RESET if length_decay else ""))
    elif any(name.startswith("the length-decay state") for name in missing):
        parts.append(_LENGTH_DECAY_RESET)
    if any(name.startswith("rng_state") for name in missing):
        parts.append("the random-number generators")
    if SCALER_NAME in missing:
        parts.append("the fp16 loss scale")
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
            _warn(f"resume_from_checkpoint=True: skipped incomplete {'; '.join(skipped)}; resuming from {checkpoint}")
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
    if problem is None:
        problem = state_problem(checkpoint)  # the optimizer, scheduler and RNG files, loaded safely first
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
        _warn(
            f"resuming from {checkpoint} without {', '.join(missing)} (resume_allow_missing_state=True): "
            f"{what_starts_fresh(missing, length_decay)} start fresh"
        )
    if getattr(args, "resume_verify_checksums", True):
        problem = manifest_problem(checkpoint)  # a flipped byte since the save, once the
        # checks that name a cause more precisely (a missing file, weights of another shape, a hand-edited state) passed
        if problem is not None:
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r}: {problem}; restore the file (a backup, the run that wrote it), "
                "or set resume_verify_checksums=False (--resume_verify_checksums false) if it was changed on purpose"
            )
    elif main and os.path.isfile(os.path.join(checkpoint, MANIFEST_NAME)):
        _warn(
            f"resuming from {checkpoint} without verifying its files against {MANIFEST_NAME} "
            "(resume_verify_checksums=False)"
        )
    return checkpoint


def _warn(message: str) -> None:
    """One warning of :func:`checked_resume_checkpoint`, attributed to the caller of ``train``."""
    warnings.warn(message, UserWarning, stacklevel=4)
