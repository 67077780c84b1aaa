"""Moved to :mod:`trl_integration.demo.data`; importing a name from here warns, and this alias goes away in the
next release."""

from trl_integration._moved import moved

__all__ = ["SYNTHETIC_DATASET_NAME", "synthetic_dataset", "repeat_char_reward"]

__getattr__ = moved(__name__, {name: "trl_integration.demo.data" for name in __all__})
