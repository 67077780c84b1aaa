"""Fixtures the lab's test modules share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def bundled_tiny():
    """The bundled tiny model (float32, eval mode) and its tokenizer; skipped where the checkout has not built it."""
    from trl_integration.demo.model import tiny_model_path

    try:
        path = tiny_model_path()
    except FileNotFoundError:
        pytest.skip("the bundled tiny model is not built in this checkout")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
