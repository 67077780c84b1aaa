"""The command line of ``safevocab-grpo`` read token by token, before any parser: the flags the command itself takes
apart (``--debug``, ``--config``, ``--model``) and the launcher flags it hands on.
"""

from __future__ import annotations

__all__ = ["TRANSFORMERS_DEBUG_OPTIONS", "take_debug_flag", "without", "config_path", "model_flag_value"]

#: Values of transformers' own ``--debug`` (``TrainingArguments.debug``); a ``--debug`` without one is this command's.
TRANSFORMERS_DEBUG_OPTIONS = ("underflow_overflow", "tpu_metrics_debug")


def take_debug_flag(argv: list[str]) -> bool:
    """Remove a bare ``--debug`` (tracebacks on) from ``argv``; ``--debug underflow_overflow`` stays transformers'."""
    for i, arg in enumerate(argv):
        if arg == "--debug" and (i + 1 == len(argv) or argv[i + 1] not in TRANSFORMERS_DEBUG_OPTIONS):
            del argv[i]
            return True
    return False


def without(argv: list[str], subsequence: list[str]) -> list[str]:
    """``argv`` without the ordered ``subsequence`` (the launcher flags), as trl's CLI takes them out."""
    rest, items = [], iter(subsequence)
    current = next(items, None)
    for arg in argv:
        if current is not None and arg == current:
            current = next(items, None)
        else:
            rest.append(arg)
    return rest


def config_path(argv: list[str]) -> str | None:
    """The value of ``--config FILE`` / ``--config=FILE`` in ``argv`` (``None`` without one)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def model_flag_value(argv: list[str]) -> str | None:
    """The value of ``--model NAME`` / ``--model=NAME`` in ``argv`` (``None`` without one)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
        if arg == "--model" and i + 1 < len(argv):
            return argv[i + 1]
    return None
