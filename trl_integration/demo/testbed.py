"""The bundled testbed model: a 1.5M-parameter Llama with a 4096-token BPE vocabulary, pretrained on the standard
library's docstrings and comments, so that a CPU-scale study has a realistic probability tail.

``testbed_model_path()`` is the folder to pass to ``AutoModelForCausalLM.from_pretrained`` /
``AutoTokenizer.from_pretrained`` (or as ``--model`` to ``safevocab study``); it loads offline. The files are produced
by ``python scripts/train_testbed_model.py`` (see ``docs/testbed.md``) and ship as package data in
``trl_integration/demo/assets/testbed``, together with ``build_info.json`` (how they were built) and the free-text
task's texts (:mod:`trl_integration.demo.freetext`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trl_integration.demo.model import bundled_folder

__all__ = [
    "TESTBED_MODEL_NAME",
    "TESTBED_MODEL_FILES",
    "TESTBED_DIR",
    "BUILD_INFO_FILE",
    "testbed_model_path",
    "load_testbed_model",
    "load_testbed_tokenizer",
]

TESTBED_MODEL_NAME = "testbed"

#: The file ``build_info.json`` (Python version, corpus SHA-256, seed, steps, wall time, losses) of the build.
BUILD_INFO_FILE = "build_info.json"

#: Files that must be present for the bundled testbed to load.
TESTBED_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

#: Where the testbed's files live (and where ``scripts/train_testbed_model.py`` writes them by default).
TESTBED_DIR = Path(__file__).resolve().parent / "assets" / TESTBED_MODEL_NAME


def testbed_model_path() -> Path:
    """Path of the bundled testbed model (a folder loadable with ``from_pretrained``).

    Raises:
        FileNotFoundError: if the folder or one of :data:`TESTBED_MODEL_FILES` is missing (e.g. an install that did
            not ship the package data); the message says how to rebuild it.
    """
    return bundled_folder(
        TESTBED_DIR,
        TESTBED_MODEL_FILES,
        "testbed model",
        "`python scripts/train_testbed_model.py` (about 12 minutes on 2 CPU cores; see docs/testbed.md)",
    )


def load_testbed_model(**kwargs: Any):
    """The testbed as a ``LlamaForCausalLM`` in eval mode (``kwargs`` go to ``from_pretrained``, e.g. ``dtype``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(testbed_model_path(), local_files_only=True, **kwargs).eval()


def load_testbed_tokenizer():
    """The testbed's tokenizer (``PreTrainedTokenizerFast``: byte-level BPE, 4096 ids, left padding, no BOS)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(testbed_model_path(), local_files_only=True)
