"""TRL integration for safevocab (``SafeVocabGRPOTrainer``, ``SafeVocabGRPOConfig``, ``safevocab-grpo``).

Everything that needs ``trl`` or ``transformers`` lives in this package, so that ``safevocab`` itself
depends on torch alone. Names are imported lazily: ``import trl_integration`` does not import trl.

- :class:`SafeVocabGRPOConfig` (``trl_integration.config``): ``GRPOConfig`` + safe-vocabulary settings.
- :class:`SafeVocabGRPOTrainer` (``trl_integration.trainer``): ``GRPOTrainer`` with safe log-probabilities.
- ``trl_integration.metrics``: pure mismatch / safe-set metric functions.
- importance-sampling ratio with raw statistics: ``safevocab.correction`` (``trl_integration.correction`` is a deprecated alias).
- ``trl_integration.rollout``: rollout log-probabilities and precision on the ``generate`` path.
- ``trl_integration.lm_head``: the safe fused LM head patch.
- ``trl_integration.commands``: the ``safevocab`` command (``grpo``, ``diagnose``, ``study``, ``bench``) and
  ``safevocab-grpo``; ``trl_integration.lab`` and ``trl_integration.study`` behind them.
- ``trl_integration.demo``: the bundled tiny model, its task and ``tiny_grpo_config()``.
"""

from __future__ import annotations

import importlib

__all__ = ["SafeVocabGRPOConfig", "SafeVocabGRPOTrainer", "add_safe_lm_head"]

_LAZY = {
    "SafeVocabGRPOConfig": "trl_integration.config",
    "SafeVocabGRPOTrainer": "trl_integration.trainer",
    "add_safe_lm_head": "trl_integration.lm_head",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trl_integration' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
