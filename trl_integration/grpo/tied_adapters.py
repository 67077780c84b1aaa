"""PEFT adapters on a model with tied word embeddings, and the vLLM engine (issue 58): when the engine cannot sample
from the model the trainer trains, one line at start.

The weight sync itself is exact with PEFT (trl merges the adapter, renames the parameters, unmerges; the project's CPU
reload and tied-head repack load them): engine vs trainer at most 7.2e-5 nats per token in fp32 on SmolLM2 for LoRA on
the projections, tied head or not, for an untied copy with ``embed_tokens``/``lm_head`` in the adapter, and for a tied
one with ``modules_to_save`` and ``ensure_weight_tying=True`` (``scripts/check_lora_sync.py``; docs/real_model.md,
"LoRA with vLLM"). The engine of a checkpoint with ``tie_word_embeddings=True`` is tied too: it loads ``embed_tokens``
and computes the logits with the same matrix (vLLM skips ``lm_head.weight``). Two PEFT settings give the trainer a
model a tied engine cannot hold (measured on SmolLM2: 0.48 to 1.47 nats per token at most, 16.9 for the second):

- ``modules_to_save`` naming ``embed_tokens`` and/or ``lm_head`` without ``ensure_weight_tying=True``: PEFT trains a
  separate copy of each layer named, so the trainer's head and embeddings part, while the engine computes its logits
  with the embedding matrix it receives (a trained ``lm_head`` copy never reaches it). With
  ``ensure_weight_tying=True`` PEFT shares one copy between both layers, and the sync is exact.
- a LoRA adapter on ``embed_tokens`` (``target_modules``): merging it for the sync also changes the LM head, which
  shares the matrix, so the engine samples from a model whose head has the embedding adapter and the trainer's has
  not. PEFT's tied variant (``ensure_weight_tying=True``) adds the adapter to ``lm_head`` too, which trl refuses
  (the log-probabilities are computed from ``lm_head.weight`` directly). Exact alternatives: ``modules_to_save=
  ["embed_tokens"]`` with ``ensure_weight_tying=True``, or the adapter on an untied copy of the checkpoint.

:func:`warn_tied_adapter` warns for both, once, when the trainer is built with ``use_vllm``.
"""

from __future__ import annotations

import warnings

__all__ = ["tied_adapter_issue", "warn_tied_adapter"]


def _ties_word_embeddings(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def tied_adapter_issue(model) -> str | None:
    """One line naming the PEFT setting whose adapted model a tied vLLM engine cannot hold (see the module), or
    ``None`` (no PEFT model, an untied checkpoint, or an adapter the sync reproduces exactly).

    Args:
        model: the trainer's model (a ``peft.PeftModel`` or not).
    """
    from accelerate.utils import is_peft_model

    if not is_peft_model(model):
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    if not _ties_word_embeddings(base.config):
        return None
    inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    if inputs is None or outputs is None:
        return None
    config = next(iter(model.peft_config.values()))  # trl trains one adapter ("default"; "ref" is a frozen copy)
    if inputs.weight is not outputs.weight:  # a wrapper's weight is its active copy's: PEFT untied them
        saved = sorted(getattr(config, "modules_to_save", None) or [])
        return (
            f"peft_config modules_to_save={saved} unties the LM head from the embeddings of a model with "
            "tie_word_embeddings=True, but the vLLM engine keeps them tied and samples with the trained embedding "
            "matrix as its head; set ensure_weight_tying=True in the LoraConfig to keep one shared copy "
            "(docs/real_model.md, LoRA with vLLM)"
        )
    if isinstance(inputs, BaseTunerLayer):
        targets = config.target_modules
        targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
        return (
            f"a LoRA adapter on the input embeddings ({type(inputs).__name__}; peft_config target_modules={targets!r}) "
            "of a model with tie_word_embeddings=True: the weight sync merges it into the matrix the vLLM engine also "
            "uses as its LM head, which the trainer's head does not have; use modules_to_save=['embed_tokens'] with "
            "ensure_weight_tying=True, or an untied copy of the checkpoint (docs/real_model.md, LoRA with vLLM)"
        )
    return None


def warn_tied_adapter(model) -> None:
    """One line at start when :func:`tied_adapter_issue` finds one (the trainer calls it with ``use_vllm``)."""
    issue = tied_adapter_issue(model)
    if issue is not None:
        warnings.warn(issue, UserWarning, stacklevel=3)
