"""The order in which each inference engine composes ``top_k``, ``top_p`` and ``min_p`` (and ``min_prob``).

A composed rule keeps ``S = {z >= t}`` on the transformed logits ``z`` (after temperature). The engines apply the
same three truncations but let each one see a different distribution, and ``top_p`` is the only one for which that
matters: ``top_k`` keeps the ``k`` largest logits and ``min_p`` keeps ``p_a >= rho * p_max`` (the argmax survives
every step, so ``p_max`` relative to the kept mass is the same ratio), so both give the same set on any
renormalisation, while ``top_p`` keeps the smallest prefix whose mass reaches ``q`` *of the distribution it sees*.
A composition is a list of *stages*: the parts of one stage all see the distribution renormalised over what the
earlier stages kept, and the set is the intersection of all parts' sets. Every part of every stage is a threshold on
``z``, so the composition is one too: ``t`` is the maximum of the parts' thresholds, each computed on ``{z >= t}`` of
the stages before.

| engine | stages | read in |
|---|---|---|
| ``"hf"`` | ``top_k``; ``top_p``; ``min_p``; ``min_prob`` | transformers ``GenerationMixin._get_logits_processor``: ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``, then ``EpsilonLogitsWarper`` (``epsilon_cutoff`` = ``min_prob``) |
| ``"vllm"`` | ``min_p``; ``top_k``; ``top_p``; ``min_prob`` | vLLM V1 ``Sampler.sample`` (CPU and GPU): temperature, the argmax-invariant ``MinPLogitsProcessor``, then ``apply_top_k_top_p`` (``top_p`` on the softmax of the ``top_k``-masked logits); Model Runner V2 the same (``apply_min_p`` before ``apply_top_k_top_p``) |
| ``"sglang"`` with ``min_p`` | ``top_k``; ``top_p``; ``min_p``; ``min_prob`` | SGLang ``Sampler._sample_from_probs``, flashinfer backend: ``top_k_renorm_prob``, ``top_p_renorm_prob``, ``min_p_sampling_from_probs`` |
| ``"sglang"`` without ``min_p`` | ``top_k`` and ``top_p`` together; ``min_prob`` | the same, ``top_k_top_p_sampling_from_probs(filter_apply_order="joint")``: both on the full distribution |

So ``top_p=0.75,min_p=0.3`` on ``p = (0.4, 0.3, 0.2, 0.1)`` keeps 3 tokens for ``"hf"`` and ``"sglang"`` (``top_p``
first keeps 3, ``min_p`` then needs ``p >= 0.12``) and 2 for ``"vllm"`` (``min_p`` first keeps 3 of mass 0.9, and
``top_p`` on ``(0.44, 0.33, 0.22)`` keeps 2); ``top_k=2,top_p=0.5`` keeps 1 token for ``"hf"`` and ``"vllm"``
(``top_p`` on ``(0.57, 0.43)``) and 2 for ``"sglang"`` (``top_p`` on the full distribution).

Every rule keeps whole ties; a sampler that breaks a tie by sort order (every engine's ``top_p`` at its boundary,
SGLang's ``top_k``, which keeps exactly ``k`` tokens) may keep part of one. Only HF has ``min_prob`` (as ``epsilon_cutoff``); a ``"vllm"``/``"sglang"`` rule with ``min_prob`` applies it
last, on the engine's set, and no sampler of that engine can apply it. SGLang's ``pytorch`` sampling backend (its
choice without flashinfer, e.g. on CPU, and under deterministic inference) composes ``top_k`` and ``top_p`` jointly
also when ``min_p`` is set, so a rule with all three differs from ``"sglang"`` there; SGLang decides between its two
compositions per batch (whether any request has ``min_p``), so requests of one batch should share the rule.
"""

from __future__ import annotations

__all__ = ["ENGINES", "check_engine", "print_order", "composition_stages"]

#: The accepted values of ``engine`` (``"hf"`` first: the default).
ENGINES: tuple[str, ...] = ("hf", "vllm", "sglang")

_SEQUENTIAL = (("top_k",), ("top_p",), ("min_p",), ("min_prob",))
_VLLM = (("min_p",), ("top_k",), ("top_p",), ("min_prob",))
_SGLANG_JOINT = (("top_k", "top_p"), ("min_prob",))


def check_engine(engine: object) -> str:
    """``engine`` after checking it is one of :data:`ENGINES` (one-line ``TypeError``/``ValueError`` otherwise)."""
    if not isinstance(engine, str):
        raise TypeError(f"engine must be a str, got {type(engine).__name__}: {engine!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is out of range: accepted one of {', '.join(map(repr, ENGINES))}")
    return engine


def print_order(engine: str) -> tuple[str, ...]:
    """The rule keys in the order the engine applies them (the order ``str(rule)`` lists them in)."""
    return tuple(key for stage in (_VLLM if engine == "vllm" else _SEQUENTIAL) for key in stage)


def composition_stages(engine: str, keys: set[str] | frozenset[str]) -> tuple[tuple[str, ...], ...]:
    """The stages (see the module docstring) in which ``engine`` applies the rule kinds ``keys``, empty ones dropped."""
    if engine == "vllm":
        plan = _VLLM
    elif engine == "sglang" and "min_p" not in keys:
        plan = _SGLANG_JOINT
    else:
        plan = _SEQUENTIAL
    stages = (tuple(key for key in stage if key in keys) for stage in plan)
    return tuple(stage for stage in stages if stage)
