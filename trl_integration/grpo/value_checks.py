"""The config's values read as the command line reads them: from Python no value trains silently as something else.

``HfArgumentParser`` parses a command line's ``--length_decay false`` into ``False``. A Python user who writes
``SafeVocabGRPOConfig(length_decay="false")`` got the string, read by truthiness: length decay **on**; and
``top_p=1.5``, ``top_k=2.5``, ``min_p=nan`` or ``reward_weights=[nan]`` trained with exit status 0 and no word (issue
57, C1/C2/C4). :func:`parse_bool_fields` runs first in ``SafeVocabGRPOConfig.__post_init__`` and
:func:`check_config_values` once ``generation_kwargs`` is parsed, on this class's fields and on trl's and
transformers' where they leave a wrong value unchecked:

- **booleans**: every field annotated ``bool`` (or ``bool | None``) takes ``True``/``False`` (``None`` where the
  annotation allows it) or a string ``HfArgumentParser`` accepts (``true``/``false``, ``yes``/``no``, ``t``/``f``,
  ``y``/``n``, ``1``/``0``), parsed; anything else is a one-line ``TypeError`` naming the field;
- **sampler** (the fields and the same keys of ``generation_kwargs``): ``temperature`` and ``repetition_penalty``
  finite and > 0; ``top_p`` in (0, 1]; ``min_p`` ``None`` or in [0, 1]; ``top_k`` an integer >= -1 (not a bool, not
  2.5; 0 and -1 are "off");
- **counts**: ``num_iterations``, ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and, when set,
  ``steps_per_generation`` and ``generation_batch_size`` integers >= 1; ``num_generations`` (when set) >= 2 (GRPO
  compares completions within a group);
- **reward weights**: finite numbers;
- **signs trl accepts without a word**: ``beta`` >= 0 (a negative KL coefficient rewards moving away from the reference
  model) and ``epsilon``/``epsilon_high`` >= 0 (the clip range is ``[1 - epsilon, 1 + epsilon_high]``).

Every message names the field, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["TRUE_STRINGS", "FALSE_STRINGS", "parse_bool", "parse_bool_fields", "check_config_values"]

#: The strings ``HfArgumentParser``'s ``string_to_bool`` reads (case-insensitive).
TRUE_STRINGS = ("yes", "true", "t", "y", "1")
FALSE_STRINGS = ("no", "false", "f", "n", "0")

_BOOL_TYPES = ("<class 'bool'>", "bool")
_OPTIONAL_BOOL_TYPES = ("bool | None", "Optional[bool]", "typing.Optional[bool]")
_COUNTS = ("num_iterations", "per_device_train_batch_size", "gradient_accumulation_steps")
_OPTIONAL_COUNTS = ("steps_per_generation", "generation_batch_size")


def parse_bool(name: str, value: Any, optional: bool = False) -> bool | None:
    """``value`` of the boolean field ``name`` as ``HfArgumentParser`` reads it (``None`` kept when ``optional``)."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in TRUE_STRINGS:
            return True
        if lowered in FALSE_STRINGS:
            return False
    accepted = "True, False" + (", None" if optional else "") + " or one of the strings true/false, yes/no, 1/0"
    raise TypeError(
        f"{name}={value!r} is not accepted: accepted {accepted} (a string is parsed, not read by truthiness)"
    )


def _annotation(field: dataclasses.Field) -> str:
    return field.type if isinstance(field.type, str) else repr(field.type)


def _real(name: str, value: Any, ok, accepted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}={value!r} is out of range: accepted {accepted}")
    return value


def _check_sampler(source: str, settings: dict[str, Any]) -> None:
    """The sampler settings of ``settings`` (the config's fields, or ``generation_kwargs``; ``source`` prefixes the
    names in the messages)."""
    if "temperature" in settings:
        _real(f"{source}temperature", settings["temperature"], lambda t: t > 0, "a finite number > 0")
    if settings.get("repetition_penalty") is not None:
        _real(f"{source}repetition_penalty", settings["repetition_penalty"], lambda r: r > 0, "a finite number > 0")
    if settings.get("top_p") is not None:
        _real(f"{source}top_p", settings["top_p"], lambda p: 0 < p <= 1, "a number in (0, 1] (1: off)")
    if settings.get("min_p") is not None:
        _real(f"{source}min_p", settings["min_p"], lambda p: 0 <= p <= 1, "None or a number in [0, 1] (0: off)")
    top_k = settings.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ValueError(f"{source}top_k={top_k!r} is not accepted: accepted an integer >= -1 (0 or -1: off)")


def parse_bool_fields(config) -> None:
    """Every boolean field of ``config`` as ``HfArgumentParser`` reads it, in place (first: other checks read them).

    Raises:
        TypeError: a boolean field holding something ``HfArgumentParser`` would not read as one.
    """
    for field in dataclasses.fields(config):
        annotation = _annotation(field)
        if annotation in _BOOL_TYPES or annotation in _OPTIONAL_BOOL_TYPES:
            value = getattr(config, field.name)
            setattr(config, field.name, parse_bool(field.name, value, optional=annotation in _OPTIONAL_BOOL_TYPES))


def check_config_values(config) -> None:
    """Check the sampler settings (``generation_kwargs`` parsed already), counts, reward weights and signs of
    ``config``, as the module docstring says.

    Raises:
        ValueError: a sampler setting, count, reward weight or sign out of range.
    """
    _check_sampler("", {name: getattr(config, name, None) for name in
                        ("temperature", "repetition_penalty", "top_p", "min_p", "top_k")})  # fmt: skip
    if isinstance(config.generation_kwargs, dict):
        _check_sampler("generation_kwargs.", config.generation_kwargs)
    for name in _COUNTS + _OPTIONAL_COUNTS:
        value = getattr(config, name, None)
        if value is None and name in _OPTIONAL_COUNTS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is out of range: accepted an integer >= 1")
    generations = getattr(config, "num_generations", None)
    if generations is not None and (
        isinstance(generations, bool) or not isinstance(generations, int) or generations < 2
    ):
        raise ValueError(f"num_generations={generations!r} is out of range: accepted an integer >= 2 (GRPO compares "
                         "the completions of a group)")  # fmt: skip
    for i, weight in enumerate(config.reward_weights or []):
        _real(f"reward_weights[{i}]", weight, lambda w: True, "a finite number (a NaN weight trains on nothing)")
    _real("beta", config.beta, lambda b: b >= 0, "a number >= 0 (a negative KL coefficient rewards moving away from "
          "the reference model)")  # fmt: skip
    _real("epsilon", config.epsilon, lambda e: e >= 0, "a number >= 0 (the clip range is [1 - epsilon, 1 + "
          "epsilon_high])")  # fmt: skip
    if getattr(config, "epsilon_high", None) is not None:
        _real(
            "epsilon_high", config.epsilon_high, lambda e: e >= 0, "None or a number >= 0 (the clip range's upper side)"
        )
