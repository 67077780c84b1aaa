"""Bundled assets: a tiny causal LM + tokenizer trained on the arithmetic task, for GRPO out of the box.

``tiny_model_path()`` is the folder to pass to ``AutoModelForCausalLM.from_pretrained`` /
``AutoTokenizer.from_pretrained`` (or as ``model_name_or_path`` to ``safevocab-grpo``). It loads offline.
The weights are produced by ``scripts/train_tiny_model.py`` (see ``docs/tiny_model.md``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_MODEL_NAME", "TINY_MODEL_FILES", "tiny_model_path"]

TINY_MODEL_NAME = "tiny-arith"

#: Files that must be present for the bundled model to load.
TINY_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def tiny_model_path() -> Path:
    """Path of the bundled tiny arithmetic model (a folder loadable with ``from_pretrained``).

    Raises:
        FileNotFoundError: if the folder or one of :data:`TINY_MODEL_FILES` is missing (e.g. an install that
            did not ship the package data); the message says how to rebuild it.
    """
    path = Path(__file__).resolve().parent / TINY_MODEL_NAME
    missing = [name for name in TINY_MODEL_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the bundled tiny model is missing from {path} (missing: {', '.join(missing)}). "
            "Rebuild it from a source checkout with `python scripts/train_tiny_model.py` "
            "(about 10 minutes on a CPU; see docs/tiny_model.md), or reinstall safevocab with its package data."
        )
    return path
