"""TRL integration for safevocab (``SafeVocabGRPOTrainer``, ``SafeVocabGRPOConfig``, ``safevocab-grpo``).

Everything that needs ``trl`` or ``transformers`` lives in this package, so that ``safevocab`` itself
depends on torch alone. Names are imported lazily: ``import trl_integration`` does not import trl, and it changes no
process-wide setting (warning filters, torch's threads): the command-line entry points install the third-party notice
filters of :mod:`trl_integration.notices`, and the trainer's thread choice applies when a trainer is built.

The package, by job (docs/architecture.md has the map):

- ``grpo/``: the drop-in. :class:`SafeVocabGRPOConfig` (``grpo/config.py``: ``GRPOConfig`` + safe-vocabulary
  settings), :class:`SafeVocabGRPOTrainer` (``grpo/trainer.py``: trl's hooks), ``add_safe_lm_head`` (``grpo/head.py``)
  and what they use: the per-batch step, its metrics, replay, length decay, the vLLM engine.
- ``harness/``: the run harness above the drop-in, :class:`HardenedSafeVocabGRPOTrainer` (what ``safevocab-grpo``
  trains with): atomic checkpoints and resume checks, the CPU thread policy, reward checks, the console filter.
- ``rollout/``: the rollout side on the ``generate`` path: log-probability recording and precision, the injected
  perturbations and the run's injected mismatch.
- ``lab/`` (``safevocab diagnose``), ``study/`` (``safevocab study``), ``demo/`` (the bundled models and tasks) and
  ``commands/`` (``safevocab``, ``safevocab-grpo``).
- At the root: ``_private.py`` (the one module naming trl's, transformers', accelerate's and vLLM's private API),
  ``options.py`` (accepted values), ``task.py`` (the study-task contract), ``plugins.py`` (``module:function``
  plug-ins).
"""

from __future__ import annotations

import importlib

__all__ = [
    "SafeVocabGRPOConfig", "SafeVocabGRPOTrainer", "HardenedSafeVocabGRPOTrainer", "add_safe_lm_head", "OutOfSetWarning",
    "NothingToTrainError",
]  # fmt: skip

_LAZY = {
    "SafeVocabGRPOConfig": "trl_integration.grpo.config",
    "SafeVocabGRPOTrainer": "trl_integration.grpo.trainer",
    "HardenedSafeVocabGRPOTrainer": "trl_integration.harness.trainer",
    "add_safe_lm_head": "trl_integration.grpo.head",
    # what a run raises or warns when rollouts and the safe set disagree (docs/trl.md, "Out-of-set tokens")
    "OutOfSetWarning": "trl_integration.grpo.out_of_set_alert",
    "NothingToTrainError": "trl_integration.grpo.out_of_set_alert",
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
