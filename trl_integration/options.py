"""The enumerations and defaults that :class:`~trl_integration.grpo.config.SafeVocabGRPOConfig` validates against.

A leaf: it imports no implementation module of ``trl_integration`` (and not trl), so that the config and the
modules implementing each setting (``rollout/``, ``grpo/step.py``, the trainer) share one definition without the
config importing them.

The importance-sampling modes are the core's (:data:`safevocab.correction.IS_MODES`, which implements them; the
core cannot import this package), the surge detector's baselines are the core's too
(:data:`safevocab.surge_detector.BASELINES`), and the default chunk budget is the fused log-softmax's own
(:data:`safevocab.logprobs.DEFAULT_MAX_CHUNK_BYTES`); all three are re-exported here so the config reads every accepted
value from one module.
"""

from __future__ import annotations

import torch

from safevocab.correction import IS_MODES
from safevocab.logprobs import DEFAULT_MAX_CHUNK_BYTES
from safevocab.mismatch import DEFAULT_BUCKETS
from safevocab.surge_detector import BASELINES as LENGTH_SURGE_BASELINES

__all__ = [
    "OUT_OF_SET_MODES",
    "SCORING_MODES",
    "SUPPORT_SOURCES",
    "EMPTY_STEP_ACTIONS",
    "ROLLOUT_DTYPES",
    "NOISE_KINDS",
    "LENGTH_DECAY_STARTS",
    "LENGTH_SURGE_BASELINES",
    "IS_MODES",
    "DEFAULT_MAX_CHUNK_BYTES",
    "DEFAULT_BUCKETS",
]

#: ``safe_vocab_out_of_set``: drop a sampled token outside the trainer's safe set, or its whole sequence.
OUT_OF_SET_MODES = ("mask_token", "mask_sequence")

#: ``safe_vocab_scoring``: where the safe-set masks, importance ratio and metrics of an on-policy generation batch
#: come from.
SCORING_MODES = ("auto", "loss_forward", "separate")

#: ``safe_vocab_support``: recompute each position's safe set with the rule, or replay the engine's kept token set.
SUPPORT_SOURCES = ("rule", "replay")

#: ``safe_vocab_empty_step``: what an optimisation step with no loss token left after the out-of-set masking does.
EMPTY_STEP_ACTIONS = ("error", "warn")

#: ``rollout_dtype`` values and the torch dtype each selects (``None``: the model's own dtype, trl's behaviour).
ROLLOUT_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: ``rollout_logit_noise_kind``: the injected logit perturbations (``logit_perturbations.LogitNoiseProcessor``): two
#: random distributions, ``lift``, a deterministic, biased lift of every token but the top one
#: (``lift_perturbation``), and ``tail``, a lift of exactly the tokens a safe-vocabulary rule cuts
#: (``tail_perturbation``).
NOISE_KINDS = ("uniform", "clipped_gaussian", "lift", "tail")

#: ``length_decay_start``: hold the LR until the length surge, or halve it from the first step.
LENGTH_DECAY_STARTS = ("on_surge", "step0")

#: ``length_surge_baseline`` (``LENGTH_SURGE_BASELINES``, imported above): the surge detector's windowed median or EMA.
