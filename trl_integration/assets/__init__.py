"""Moved to :mod:`trl_integration.demo.model` (the bundled model now lives in ``trl_integration/demo/assets``);
importing a name from here warns, and this alias goes away in the next release."""

from trl_integration._moved import moved

__all__ = ["TINY_MODEL_NAME", "TINY_MODEL_FILES", "tiny_model_path"]

__getattr__ = moved(__name__, {name: "trl_integration.demo.model" for name in __all__})
