"""A checkpoint's resume state read the safe way before the Trainer reads it: a file that cannot be used is named.

transformers loads ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and the RNG states deep inside ``train``, and a
file that is not what it expects fails there without naming it: a hand-edited ``optimizer.pt`` holding ``{}`` gave
``KeyError: 'param_groups'``, a ``scheduler.pt`` holding ``[1, 2]`` a raw message, and a planted malicious pickle
torch's ``UnpicklingError``, which names no file and suggests ``weights_only=False`` (issue 57). :func:`state_problem`
loads each present file first as the Trainer will, with ``torch.load(weights_only=True)`` and the Trainer's own
allowlist (numpy's RNG state; memory-mapped: the tensors are not read), and checks its structure:

- ``optimizer.pt``: a dict with ``state`` and ``param_groups`` (``torch.optim.Optimizer.state_dict()``);
- ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``: a dict.

A file torch refuses to load safely is named with what torch found (for example an unsupported global such as
``posix.system``) and the safe advice: restore the file from the run that wrote it; nothing in it was executed.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch

__all__ = ["STATE_FILES", "state_problem"]

#: The resume state files checked here (``rng_state_<r>.pth`` of a multi-process run too).
STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth")

_RNG = re.compile(r"^rng_state(_\d+)?\.pth$")
_TORCH_ADVICE = re.compile(r"Weights only load failed\..*?Do it only if you got the file from a trusted source\.", re.S)


def _what_torch_found(err: Exception) -> str:
    """torch's reason without its advice to load with ``weights_only=False`` (which would run the file's code)."""
    text = _TORCH_ADVICE.sub("", str(err))
    text = text.split("Check the documentation of torch.load")[0]
    return " ".join(text.split()) or type(err).__name__


def _structure_problem(name: str, value: object) -> str | None:
    if not isinstance(value, dict):
        return f"{name} holds a {type(value).__name__}, not the dict the Trainer saves"
    if name == "optimizer.pt":
        missing = [key for key in ("state", "param_groups") if key not in value]
        if missing:
            return f"{name} lacks {', '.join(map(repr, missing))}: it is not an optimizer's state_dict()"
    return None


def state_problem(folder: str | os.PathLike) -> str | None:
    """Why a resume state file of ``folder`` cannot be used (the module docstring), or ``None``."""
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
