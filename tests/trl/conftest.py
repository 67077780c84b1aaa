"""Fixtures for the TRL integration tests (helpers live in ``trl_helpers.py``, a unique module name, so that
``from trl_helpers import ...`` never resolves to another directory's ``conftest``)."""

from __future__ import annotations

import importlib.util

import pytest
from trl_helpers import build_model, build_tokenizer

# Without the trl extra installed these tests cannot run: skip the directory instead of failing collection.
if importlib.util.find_spec("trl") is None:  # pragma: no cover
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of a saved tiny Llama + tokenizer (session-wide: built once)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory):
    """Path of a saved tiny Gemma-2 (final-logit softcap 5.0) + tokenizer."""
    path = tmp_path_factory.mktemp("tiny-gemma2")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, arch="gemma2", head_scale=20.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def pytest_collection_modifyitems(config, items):
    # transformers 5.23 warns on every TrainingArguments about trl's `gradient_checkpointing` default: not ours.
    here = str(config.rootpath / "tests" / "trl")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"))
