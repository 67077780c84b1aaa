"""Old module paths of moved names: a module-level ``__getattr__`` that re-exports them with a ``FutureWarning``.

A deprecated module keeps only ``__getattr__ = moved(__name__, {...})``: ``from old.path import name`` still works,
warns once per call site, and points at the new home. The module itself imports nothing until a name is asked for,
so ``python -m`` on an old path (e.g. ``trl_integration.cli``) runs without a warning.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved"]


def moved(old_module: str, targets: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old_module`` whose names moved.

    Args:
        old_module: the deprecated module's name (``__name__``).
        targets: ``{name: "new.module"}`` (same name there) or ``{name: "new.module:new_name"}``.
    """

    def __getattr__(name: str) -> Any:
        target = targets.get(name)
        if target is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        module, _, new_name = target.partition(":")
        new_name = new_name or name
        warnings.warn(
            f"{old_module}.{name} moved to {module}.{new_name}; import it from there "
            f"({old_module} goes away in the next release)",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), new_name)

    return __getattr__
