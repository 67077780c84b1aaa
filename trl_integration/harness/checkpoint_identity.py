"""Whose checkpoint it is, read from its files alone: no torch, no transformers (the command's early checks use it).

A checkpoint records the model it was trained on in two places: ``safevocab_settings.json`` (the config's class, the
vocabulary and hidden sizes; :func:`~trl_integration.harness.resume_settings.run_settings`) and the header of its
``model.safetensors`` (every tensor's name and shape). A model folder records the same in its ``config.json`` and its
own ``model.safetensors``. :func:`foreign_checkpoint_problem` compares the two before anything loads, with the very
messages the run harness gives once the model is loaded (:mod:`~trl_integration.harness.resume_settings`), so a
checkpoint of another model is refused in the time of ``import torch``, not after a 26 s model load.

- **Settings**: :func:`config_identity` maps ``config.json`` to the stored names (``model_config_class`` compared as
  ``LlamaConfig`` against ``model_type: llama``: lower case, without ``Config``, ``_`` and ``-``);
  :func:`refused_settings_message` is the one line of a refused change.
- **Tensors**: :func:`safetensors_shapes` reads a file's header (an 8-byte little-endian length, then JSON);
  :func:`shape_problems` lists the tensors missing, unknown or of another shape. A tied copy (the LM head tied to the
  embeddings) is absent from both files alike, so file against file needs no special case.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from trl_integration.harness.manifest import read_harness_json
from trl_integration.options import MODEL_SETTINGS, RESUME_ALLOW_FIELD

__all__ = [
    "SETTINGS_NAME", "WHY_REFUSED", "read_settings", "refused_settings_message", "config_identity",
    "safetensors_shapes", "stored_shapes", "shape_problems", "foreign_checkpoint_problem",
]  # fmt: skip

#: The settings file of a checkpoint (beside ``trainer_state.json``).
SETTINGS_NAME = "safevocab_settings.json"
#: Why a changed setting of each group is refused (the second clause of :func:`refused_settings_message`).
WHY_REFUSED = {
    "rule": "the checkpoint's policy and optimizer state were trained under the other rule",
    "length_decay": "scheduler.pt restores the checkpoint's length-decay state, so the new value would be silently "
    "ignored (the opt-out keeps the checkpoint's)",
    "model": "the checkpoint's weights and optimizer state belong to another model",
}


def read_settings(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The settings stored in ``folder`` (``None`` when it has no settings file: a checkpoint written before).

    Raises:
        ValueError: one line naming the file when it is not the JSON the harness writes.
    """
    what = "a settings file of safevocab (expected {'format': 1, 'settings': {...}})"
    return read_harness_json(Path(folder, SETTINGS_NAME), "settings", what, "checking the settings")


def refused_settings_message(checkpoint: str, refused: list[tuple[str, Any, Any]], why: str) -> str:
    """The one line of a resume refused for changed settings ``[(name, old, new), ...]``; ``why``: the reason."""
    listed = ", ".join(f"{name} {old!r} -> {new!r}" for name, old, new in refused)
    names = [name for name, _, _ in refused]
    return (
        f"resume_from_checkpoint={checkpoint!r} was trained with other settings ({SETTINGS_NAME}): {listed}; "
        f"{why}: resume with the checkpoint's value, or say it is on purpose with "
        f"{RESUME_ALLOW_FIELD}={names!r} (--{RESUME_ALLOW_FIELD} {' '.join(names)})"
    )


def _class_key(name: str) -> str:
    return name.lower().removesuffix("config").replace("_", "").replace("-", "")


def config_identity(config: dict[str, Any]) -> dict[str, Any]:
    """``{model_config_class, model_vocab_size, model_hidden_size}`` of a ``config.json`` (its text config's sizes for
    a multimodal model); the class as a comparison key (:func:`_class_key`)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return {
        "model_config_class": _class_key(str(config.get("model_type", ""))),
        "model_vocab_size": text.get("vocab_size", config.get("vocab_size")),
        "model_hidden_size": text.get("hidden_size", config.get("hidden_size")),
    }


def safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` from a safetensors file's header (the JSON after its 8-byte length).

    Raises:
        ValueError: the file is not a safetensors file (a header that does not parse).
    """
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def stored_shapes(folder: str | os.PathLike) -> tuple[str, dict[str, tuple[int, ...]]] | None:
    """The weights file's name and tensor shapes of ``folder`` (``model.safetensors`` or a sharded index); ``None``
    when it has no safetensors weights (an adapter, ``.bin`` files, DeepSpeed or FSDP layouts)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shapes: dict[str, tuple[int, ...]] = {}
        for shard in sorted(set(weight_map.values())):
            shapes.update(safetensors_shapes(folder / shard))
        return index.name, {name: shapes[name] for name in weight_map if name in shapes}
    if (folder / "model.safetensors").is_file():
        return "model.safetensors", safetensors_shapes(folder / "model.safetensors")
    return None


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def shape_problems(stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                   missing: list[str]) -> list[str]:  # fmt: skip
    """The clauses naming what differs: ``missing`` (the model's tensors absent from ``stored``, found by the caller),
    tensors of ``stored`` unknown to ``expected``, and tensors of another shape."""
    unexpected = [name for name in stored if name not in expected]
    reshaped = [name for name in stored if name in expected and stored[name] != expected[name]]
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} of the model's tensors missing (first {missing[0]!r} {_shape(expected[missing[0]])})"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} unknown to the model (first {unexpected[0]!r} {_shape(stored[unexpected[0]])})"
        )
    if reshaped:
        name = reshaped[0]
        parts.append(f"{len(reshaped)} of another shape (first {name!r}: {_shape(stored[name])} in the file, "
                     f"{_shape(expected[name])} in the model)")  # fmt: skip
    return parts


def foreign_checkpoint_problem(
    checkpoint: str, model_folder: str, allowed: list[str] | tuple[str, ...] = ()
) -> str | None:
    """The one line refusing ``checkpoint`` as a checkpoint of another model than the one in ``model_folder`` (its
    ``config.json`` against the stored settings, its ``model.safetensors`` header against the checkpoint's), or
    ``None`` when nothing says so. ``allowed``: settings named in ``resume_allow_changed_settings``."""
    config_path = Path(model_folder, "config.json")
    if not config_path.is_file():
        return None  # an adapter folder or a Hub id: the run checks once the model is loaded
    try:
        identity = config_identity(json.loads(config_path.read_text(encoding="utf-8")))
        stored = read_settings(checkpoint)
    except (ValueError, OSError):
        return None  # the harness names an unreadable settings file itself
    if stored is not None:
        refused = []
        for name in MODEL_SETTINGS:
            if name not in identity or name not in stored or name in allowed:
                continue
            old, new = stored[name], identity[name]
            if name == "model_config_class":
                old = _class_key(str(old))
            if new is not None and old != new:
                shown = f"{new} (config.json's model_type)" if name == "model_config_class" else new
                refused.append((name, stored[name], shown))
        if refused:
            return refused_settings_message(checkpoint, refused, WHY_REFUSED["model"])
    try:
        in_checkpoint, in_model = stored_shapes(checkpoint), stored_shapes(model_folder)
    except (ValueError, OSError, KeyError, struct.error):
        return None  # a cut-short file is the completeness check's to name
    if in_checkpoint is None or in_model is None:
        return None
    (file_name, shapes), (_, expected) = in_checkpoint, in_model
    parts = shape_problems(shapes, expected, [name for name in expected if name not in shapes])
    if not parts:
        return None
    architecture = (json.loads(config_path.read_text(encoding="utf-8")).get("architectures") or ["this model"])[0]
    return (f"resume_from_checkpoint={checkpoint!r}: {Path(checkpoint) / file_name} does not hold this model's weights: "
            f"{'; '.join(parts)}; resume from a checkpoint of this model ({architecture}), or load the model it was "
            "trained from")  # fmt: skip
