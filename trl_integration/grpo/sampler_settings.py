"""The sampler's settings the config derives from the rule: the effective rule, and whether rollouts record their
log-probabilities.

A leaf like the config (it imports no implementation module); :class:`~trl_integration.grpo.config.SafeVocabGRPOConfig`
calls these two functions while it is built.

**The effective rule** (:func:`compose_with_sampler`). With ``safe_vocab_in_sampler=True`` the sampler and the trainer
both use ``safe_vocab_rule & sampler rule`` (:func:`~safevocab.effective_rule.compose_rules`, in the order of the
engine that samples), where the sampler rule is the user's own ``top_k``/``top_p``/``min_p``, read from
``generation_kwargs`` where they are set there (trl's ``GenerationConfig``/``SamplingParams`` let those override the
flags). The flags, and those ``generation_kwargs`` entries, are then set to the effective rule's sampler settings.

**Rollout log-probabilities** (:func:`resolve_rollout_logprobs`). ``rollout_logprobs=None`` (auto) records them on the
plain ``generate`` path when the effective rule or the sampler prunes, or a mismatch-lab setting needs them.
"""

from __future__ import annotations

import warnings

from safevocab import MinProb, NoPruning, SafeVocabRule
from safevocab.effective_rule import compose_rules, sampler_rule

__all__ = ["compose_with_sampler", "resolve_rollout_logprobs"]


def compose_with_sampler(config, rule: SafeVocabRule) -> SafeVocabRule:
    """The effective rule ``rule & sampler rule`` of a ``SafeVocabGRPOConfig``; sets the sampler (flags and
    ``generation_kwargs``) to it.

    Raises:
        ValueError: ``rule`` contains ``min_prob``, which no sampler can apply.
    """
    if any(isinstance(part, MinProb) for part in rule.parts):
        raise ValueError(
            f"safe_vocab_rule={str(rule)!r} contains min_prob, which no HF/vLLM sampler can apply, while "
            "safe_vocab_in_sampler=True. Use min_p/top_k/top_p, or set safe_vocab_in_sampler=False (the "
            "sampler then keeps its own settings and sampled tokens outside S are masked)."
        )
    # generation_kwargs override the flags in trl's GenerationConfig/SamplingParams: the sampler's own setting
    # is the generation_kwargs value when there is one.
    if isinstance(config.generation_kwargs, dict):
        config.generation_kwargs = dict(config.generation_kwargs)  # a copy: the caller's dict is not modified
    gk = config.generation_kwargs if isinstance(config.generation_kwargs, dict) else {}
    user = {key: gk.get(key, getattr(config, key)) for key in ("top_k", "top_p", "min_p")}
    effective = compose_rules(rule, sampler_rule(**user, engine=config.rule_engine))
    wanted = effective.sampler_kwargs()
    for key in ("top_k", "top_p", "min_p"):
        if key in wanted:
            setattr(config, key, wanted[key])
            if key in gk:
                gk[key] = wanted[key]
    # The sampler's temperature is the behaviour policy's: score at it too (trl would score at `temperature`).
    if "temperature" in gk and gk["temperature"] is not None and gk["temperature"] != config.temperature:
        warnings.warn(
            f"generation_kwargs['temperature']={gk['temperature']!r} overrides temperature={config.temperature!r} "
            "in the sampler: the trainer scores at the sampler's temperature too", UserWarning, stacklevel=4,
        )  # fmt: skip
        config.temperature = float(gk["temperature"])
    return effective


def resolve_rollout_logprobs(config) -> None:
    """``rollout_logprobs=None`` (auto) of a ``SafeVocabGRPOConfig``: record on the plain ``generate`` path when the
    effective rule or the sampler prunes, or a mismatch-lab setting needs them; rule ``"none"`` with default settings
    stays stock trl unless the user switches recording on."""
    if config.rollout_logprobs is None:
        prunes = not isinstance(config.effective_rule, NoPruning) or not isinstance(config.sampler_rule, NoPruning)
        lab = config.rollout_logit_noise > 0 or config.zero_mismatch or config.rollout_mantissa_bits is not None
        lab = lab or config.rollout_perturbation is not None
        config.rollout_logprobs = not config.use_transformers_continuous_batching and (prunes or lab)
