"""Structured outputs (a grammar in the engine) under DVP: the trainer's safe set is the engine's kept set.

With ``vllm_structured_outputs_regex`` vLLM samples from the grammar-masked distribution: at each position it keeps
the tokens the grammar allows, then applies the sampler's rule to what is left, ``R = rule(mask_G(p))``. The trainer's
rule on the unconstrained logits gives ``S = rule(p)``, which need not contain the sampled token (the grammar forces
tokens the rule prunes: 3.5-12.5 % of sampled tokens per step on the bundled tiny model with ``[0-9]{1,3}``, measured
with ``safevocab-grpo --use_vllm true --vllm_mode colocate --vllm_structured_outputs_regex '[0-9]{1,3}'``), and need
not even meet ``R``. So:

- with ``safe_vocab_support="replay"`` the trainer renormalises over exactly the replayed ``R``
  (``SafeHeadState.support_only``: ``R`` is not intersected with ``S``), which is the distribution the engine sampled
  from; a token the grammar forces alone (``|R| = 1``) has ``log pi_R = 0`` and no gradient, as it had no choice.
  The engine's processed log-probability of it is 0 too, so its importance ratio is 1 and its ``k3`` term and
  entropy 0; it stays in the loss mask (trl's token count) and in every metric's mean with those values, as the
  rule's own singletons do, and ``safevocab/singleton_frac`` counts it (docs/trl.md, Structured outputs);
- with ``safe_vocab_support="rule"`` the run warns once at start (:func:`warn_grammar_without_replay`), naming the
  setting that makes it exact.

trl also builds the grammar from ``generation_kwargs["structured_outputs"]`` (a dict of vLLM's
``StructuredOutputsParams``, e.g. ``{"regex": ...}``; the regex flag takes precedence): the same holds for it.
"""

from __future__ import annotations

import warnings

__all__ = ["grammar_setting", "grammar_active", "warn_grammar_without_replay"]


def grammar_setting(args) -> str | None:
    """``name=value`` of the setting that puts the engine under a grammar (trl's ``vllm_structured_outputs_regex``,
    or ``generation_kwargs["structured_outputs"]``), or ``None``."""
    if not getattr(args, "use_vllm", False):
        return None
    if getattr(args, "vllm_structured_outputs_regex", None):
        return f"vllm_structured_outputs_regex={args.vllm_structured_outputs_regex!r}"
    kwargs = getattr(args, "generation_kwargs", None)
    grammar = kwargs.get("structured_outputs") if isinstance(kwargs, dict) else None
    return f"generation_kwargs['structured_outputs']={grammar!r}" if grammar else None


def grammar_active(args) -> bool:
    """Whether the engine samples under a grammar (:func:`grammar_setting`)."""
    return grammar_setting(args) is not None


def warn_grammar_without_replay(args, replay: bool) -> None:
    """One line at start when a grammar is active and the trainer's sets are the rule's (not the engine's)."""
    if grammar_active(args) and not replay:
        warnings.warn(
            f"{grammar_setting(args)} with safe_vocab_support='rule': the rule's sets ignore the grammar, so tokens it "
            "forces fall outside them and leave the loss; set safe_vocab_support='replay' to train on the engine's own "
            "sets (docs/trl.md, Structured outputs)",
            UserWarning,
            stacklevel=3,
        )
