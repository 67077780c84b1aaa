"""The bundled tiny model: where it lives and which files it needs.

``tiny_model_path()`` is the folder to pass to ``AutoModelForCausalLM.from_pretrained`` /
``AutoTokenizer.from_pretrained`` (or as ``model_name_or_path`` to ``safevocab-grpo``); it loads offline. The
weights (a 497K-parameter Llama trained on :mod:`trl_integration.demo.arithmetic`) are produced by
``python scripts/train_tiny_model.py`` (see ``docs/tiny_model.md``) and ship as package data in
``trl_integration/demo/assets/tiny-arith``. :func:`bundled_folder` is the check both bundled models' paths make
(this one and :func:`trl_integration.demo.testbed.testbed_model_path`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_MODEL_NAME", "TINY_MODEL_FILES", "TINY_MODEL_DIR", "tiny_model_path", "bundled_folder"]

TINY_MODEL_NAME = "tiny-arith"

#: Files that must be present for the bundled model to load.
TINY_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

#: Where the bundled model's files live (and where ``scripts/train_tiny_model.py`` writes them by default).
TINY_MODEL_DIR = Path(__file__).resolve().parent / "assets" / TINY_MODEL_NAME


def bundled_folder(folder: Path, files: tuple[str, ...], what: str, rebuild: str) -> Path:
    """``folder`` if it holds every one of ``files``; else ``FileNotFoundError`` naming the missing files and how to
    rebuild them (``rebuild``: the command and its duration), as an install without the package data would be."""
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the bundled {what} is missing from {folder} (missing: {', '.join(missing)}). "
            f"Rebuild it from a source checkout with {rebuild}, or reinstall safevocab with its package data."
        )
    return folder


def tiny_model_path() -> Path:
    """Path of the bundled tiny arithmetic model (a folder loadable with ``from_pretrained``).

    Raises:
        FileNotFoundError: if the folder or one of :data:`TINY_MODEL_FILES` is missing (e.g. an install that
            did not ship the package data); the message says how to rebuild it.
    """
    return bundled_folder(
        TINY_MODEL_DIR,
        TINY_MODEL_FILES,
        "tiny model",
        "`python scripts/train_tiny_model.py` (about 10 minutes on a CPU; see docs/tiny_model.md)",
    )


def is_tiny_model(path: str | Path) -> bool:
    """Whether ``path`` is the bundled model's folder (for reports that name it instead of printing a path)."""
    try:
        return Path(path).resolve() == TINY_MODEL_DIR
    except (OSError, RuntimeError):
        return False
