"""Moved to :mod:`trl_integration.demo.arithmetic` (the bundled demo's task); importing a name from here warns,
and this alias goes away in the next release."""

from trl_integration._moved import moved

__all__ = ["accuracy", "arithmetic_reward", "make_dataset", "parse_answer"]

__getattr__ = moved(__name__, {name: "trl_integration.demo.arithmetic" for name in __all__})
