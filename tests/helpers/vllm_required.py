"""One rule for the tests on the real vLLM engine: skipped only where vLLM is not installed; with
``SAFEVOCAB_REQUIRE_VLLM=1`` (set by ``scripts/test.sh`` when the extras include vllm, as in CI) a missing vLLM fails
the run instead, so a broken install cannot pass as skipped tests."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_vllm(module_level: bool = False) -> None:
    """Fail or skip (the whole module with ``module_level=True``) unless ``vllm`` can be imported."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("SAFEVOCAB_REQUIRE_VLLM") == "1":
        pytest.fail(
            "SAFEVOCAB_REQUIRE_VLLM=1 but vLLM is not installed: install the vllm extra (scripts/setup_env.sh does)",
            pytrace=False,
        )
    pytest.skip(
        "vLLM is not installed (the vllm extra; scripts/setup_env.sh installs it)", allow_module_level=module_level
    )
