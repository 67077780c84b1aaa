"""The effective rule: ``safe_vocab_rule`` composed with the sampler's own truncation (``top_k``/``top_p``/``min_p``).

When a user sets sampler truncation next to ``safe_vocab_rule``, the rollout sampler draws from the intersection of
both sets, so that intersection is the behaviour policy's support; training must renormalise over the same set. HF
``generate`` applies each of ``top_k``, ``top_p`` and ``min_p`` at most once, in that order, each on the distribution
renormalised over what the previous one kept (the order :class:`safevocab.rules.Intersection` follows for
``engine="hf"``). Two thresholds of the same kind therefore have to become one that the sampler can apply, and on one
distribution the intersection of two sets of the same kind is the stricter of the two:

- ``top_k=a`` and ``top_k=b`` keep the ``min(a, b)`` largest logits;
- ``top_p=p`` and ``top_p=q`` are nested prefixes of the same sorted distribution: ``min(p, q)``;
- ``min_p=r`` and ``min_p=s`` keep ``p_a >= max(r, s) * p_max``.

So the composed rule is exactly what the sampler applies when given the composed settings.

Every engine applies each of the three kinds at most once, so the merge is the same for all of them; what differs is
the order the merged parts are applied in (HF ``generate`` and SGLang ``top_k -> top_p -> min_p``, vLLM ``min_p ->
top_k -> top_p``; :mod:`safevocab.engine_order`). :func:`sampler_rule` builds the sampler's rule for one ``engine``,
and :func:`compose_rules` keeps the trainer rule's engine: both sides must name the same one (a sampler that prunes
nothing composes with any), else a one-line ``ValueError``.
"""

from __future__ import annotations

from safevocab.rules import Intersection, MinP, NoPruning, SafeVocabRule, TopK, TopP

__all__ = ["compose_rules", "sampler_rule"]


def sampler_rule(
    top_k: int | None = None, top_p: float | None = None, min_p: float | None = None, *, engine: str = "hf"
) -> SafeVocabRule:
    """The rule ``engine``'s sampler applies with these (trl-style) settings; neutral values prune nothing.

    ``top_k`` of ``None``/``0``/``-1``, ``top_p`` of ``None``/``1.0`` and ``min_p`` of ``None``/``0.0`` are off;
    ``engine`` is one of :data:`safevocab.engine_order.ENGINES` (``"hf"``: transformers' ``generate``).
    """
    parts: list[SafeVocabRule] = []
    if top_k is not None and top_k > 0:
        parts.append(TopK(int(top_k)))
    if top_p is not None and top_p < 1.0:
        parts.append(TopP(float(top_p)))
    if min_p is not None and min_p > 0.0:
        parts.append(MinP(float(min_p)))
    return Intersection.of(*parts, engine=engine) if parts else NoPruning(engine=engine)


def compose_rules(rule: SafeVocabRule, sampler: SafeVocabRule) -> SafeVocabRule:
    """``rule & sampler`` with same-kind thresholds merged into the stricter one (see the module docstring).

    Args:
        rule: the trainer's rule (``safe_vocab_rule``); may contain ``min_prob``, which is kept as is.
        sampler: the sampler's own rule (:func:`sampler_rule` of the user's settings, for ``rule``'s engine).

    Returns:
        The composed rule in ``rule``'s engine and its order (``NoPruning`` when neither prunes).

    Raises:
        ValueError: ``sampler`` prunes and names another engine than ``rule`` (one line).
    """
    if sampler.parts and sampler.engine != rule.engine:
        raise ValueError(
            f"sampler={str(sampler)!r} (engine={sampler.engine!r}) and rule={str(rule)!r} (engine={rule.engine!r}) "
            "compose in different orders: accepted a sampler rule of the rule's engine"
        )
    parts = {type(part): part for part in rule.parts}
    for part in sampler.parts:
        kind = type(part)
        mine = parts.get(kind)
        if mine is None:
            parts[kind] = part
        elif kind is TopK:
            parts[kind] = TopK(min(mine.value, part.value))
        elif kind is TopP:
            parts[kind] = TopP(min(mine.value, part.value))
        elif kind is MinP:
            parts[kind] = MinP(max(mine.value, part.value))
        else:  # pragma: no cover - samplers have no other threshold kinds
            raise TypeError(f"sampler={sampler!s} has a threshold kind {kind.__name__} no sampler applies")
    return Intersection.of(*parts.values(), engine=rule.engine) if parts else NoPruning(engine=rule.engine)
