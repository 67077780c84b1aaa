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
    "RESUME_ALLOW_FIELD",
    "RULE_SETTINGS",
    "LENGTH_DECAY_SETTINGS",
    "MODEL_SETTINGS",
    "RESUME_REFUSED_SETTINGS",
    "OUT_OF_SET_MODES",
    "SCORING_MODES",
    "SUPPORT_SOURCES",
    "EMPTY_STEP_ACTIONS",
    "ROLLOUT_DTYPES",
    "NOISE_KINDS",
    "MANTISSA_BITS_RANGE",
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

#: ``rollout_mantissa_bits``: the accepted numbers of kept float32 mantissa bits (float32 has 23;
#: ``trl_integration.rollout.mantissa.round_mantissa``).
MANTISSA_BITS_RANGE = (1, 23)

#: ``length_decay_start``: hold the LR until the length surge, or halve it from the first step.
LENGTH_DECAY_STARTS = ("on_surge", "step0")

#: ``length_surge_baseline`` (``LENGTH_SURGE_BASELINES``, imported above): the surge detector's windowed median or EMA.


# --- resuming (trl_integration.harness.resume_settings): the settings a resumed run may not change silently ---------
#: The config field listing the settings a resumed run may change on purpose.
RESUME_ALLOW_FIELD = "resume_allow_changed_settings"
#: The rule's settings (the checkpoint's policy and optimizer state were trained under its rule).
RULE_SETTINGS = ("safe_vocab_rule", "safe_vocab_effective_rule", "rule_engine")
#: The length-decay settings (restored from ``scheduler.pt``: a new value would be silently ignored).
LENGTH_DECAY_SETTINGS = (
    "length_decay", "length_decay_period", "length_decay_min_lr_ratio", "length_decay_start",
    "length_decay_max_decays", "length_decay_cooldown", "length_surge_window", "length_surge_baseline_window",
    "length_surge_ratio", "length_surge_warmup", "length_surge_factor", "length_surge_baseline",
    "length_surge_ema_alpha",
)  # fmt: skip
#: The model's identity, as ``safevocab_settings.json`` records it.
MODEL_SETTINGS = ("model_config_class", "model_vocab_size", "model_hidden_size", "model_num_parameters")
#: Settings a resume refuses to change unless named in ``resume_allow_changed_settings``.
RESUME_REFUSED_SETTINGS: tuple[str, ...] = RULE_SETTINGS + LENGTH_DECAY_SETTINGS + MODEL_SETTINGS
