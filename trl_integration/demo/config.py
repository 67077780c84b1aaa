"""The tiny GRPO job: the one set of training settings every demo run starts from.

The main job (``safevocab-grpo`` with no arguments), ``safevocab study``, the overhead benchmark, the examples and
the trl tests all build their ``SafeVocabGRPOConfig`` with :func:`tiny_grpo_config` (or its keyword arguments,
:func:`tiny_grpo_config_kwargs`, where a parser takes defaults) and override only what they change. The batch is
8 prompts x 8 completions of at most 8 tokens (the arithmetic answers take 1-5), 200 steps from a learning rate of
``1e-4`` decayed linearly to 0 (trl's default schedule), no KL term (``beta=0``), nothing saved or reported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_GRPO_DEFAULTS", "tiny_grpo_config_kwargs", "tiny_grpo_config"]

#: The tiny job's settings (``SafeVocabGRPOConfig`` fields). Read-only: override through the functions below.
TINY_GRPO_DEFAULTS: dict[str, Any] = dict(
    output_dir="runs/safevocab-grpo-tiny-arith",
    max_steps=200,
    per_device_train_batch_size=64,
    num_generations=8,
    max_completion_length=8,
    learning_rate=1e-4,
    beta=0.0,
    logging_steps=10,
    save_strategy="no",
    report_to="none",
    seed=0,
)


def tiny_grpo_config_kwargs(**overrides: Any) -> dict[str, Any]:
    """:data:`TINY_GRPO_DEFAULTS` updated with ``overrides``, as keyword arguments of ``SafeVocabGRPOConfig``.

    Without a GPU, ``bf16`` defaults to ``False``: trl's default of ``True`` needs a GPU (or ``use_cpu``).
    """
    import torch

    kwargs = dict(TINY_GRPO_DEFAULTS)
    if not torch.cuda.is_available():
        kwargs["bf16"] = False
    kwargs.update(overrides)
    return kwargs


def tiny_grpo_config(**overrides: Any):
    """The tiny job's ``SafeVocabGRPOConfig``, with ``overrides`` (any config field) on top.

    Example::

        config = tiny_grpo_config(output_dir="/tmp/run", max_steps=20, safe_vocab_rule="min_p=0.01")
    """
    from trl_integration.grpo.config import SafeVocabGRPOConfig

    return SafeVocabGRPOConfig(**tiny_grpo_config_kwargs(**overrides))
