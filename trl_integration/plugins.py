"""Plug-ins named as ``module:function`` (``safevocab study --task``, ``--rollout_perturbation``): import the module
and look the function up, with one-line errors that name the setting.

The module is imported as Python imports any module (``sys.path``); when it is not found there, the import is
tried again with the current folder in front of ``sys.path``, so that a file ``./my_tasks.py`` works as
``my_tasks:make`` from the console scripts too (whose ``sys.path`` does not start with the current folder). The
folder stays there for that import only (:func:`import_module`, also used for ``safevocab-grpo --reward_funcs``):
left in front for the whole run, a stray ``vllm.py`` or ``peft.py`` in it would shadow the installed package
wherever trl or transformers import it later.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType

__all__ = ["import_module", "load_callable", "split_spec", "module_is_findable", "where_modules_are_looked_for"]


def split_spec(spec: object, name: str) -> tuple[str, str]:
    """``"pkg.module:function"`` -> ``("pkg.module", "function")``.

    Raises:
        ValueError: ``spec`` is not a string of that form; the message names the setting ``name``.
    """
    module, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not (sep and module.strip() and attr.strip()) or ":" in attr:
        raise ValueError(
            f"{name}={spec!r} is not accepted: accepted 'module:function' (an importable module and a function in it)"
        )
    return module.strip(), attr.strip()


def load_callable(spec: str, name: str) -> Callable:
    """The callable that ``spec`` (``"module:function"``) names, imported now.

    Args:
        spec: ``"module:function"``; ``function`` may be a dotted attribute path (``"pkg.mod:Class.build"``).
        name: the setting or flag, for the error messages (``"--task"``, ``"rollout_perturbation"``).

    Raises:
        ValueError: one line naming ``name`` and ``spec`` when the form is wrong, the module cannot be imported
            (also when importing it raises), the attribute does not exist or is not callable.
    """
    module_name, attr = split_spec(spec, name)
    try:
        module = import_module(module_name)
    except Exception as err:  # the user's module may fail in any way while importing: one line, not a traceback
        detail = f"{type(err).__name__}: {err}"
        raise ValueError(f"{name}={spec!r}: cannot import module {module_name!r} ({detail})") from err
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{name}={spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{name}={spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def import_module(module_name: str) -> ModuleType:
    """``importlib.import_module(module_name)``; when the module is not found on ``sys.path``, imported from the
    current folder, which is put in front of ``sys.path`` for this import only (the module's own imports of files
    beside it, at import time, resolve as they would with the folder on the path).

    Raises:
        ModuleNotFoundError: the module is neither on ``sys.path`` nor in the current folder; the message says where
            it was looked for (:func:`where_modules_are_looked_for`).
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        here = os.getcwd()
        missing_is_ours = err.name is not None and module_name.split(".")[0] == err.name.split(".")[0]
        if not missing_is_ours:
            raise
        if here in sys.path:
            raise _not_found(err) from None
    sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or module_name.split(".")[0] != err.name.split(".")[0]:
            raise
        raise _not_found(err) from None
    finally:
        if here in sys.path:
            sys.path.remove(here)


def where_modules_are_looked_for(missing: str) -> str:
    """Where :func:`import_module` looked for the module ``missing`` (``"pkg.sub"``): its parent package's folders
    once the parent was imported, else the current folder and every ``sys.path`` entry."""
    parent = missing.rpartition(".")[0]
    if parent and parent in sys.modules:
        folders = getattr(sys.modules[parent], "__path__", None)
        return (
            f"in package {parent!r} ({', '.join(folders)})"
            if folders is not None
            else f"{parent!r} is a module, not a package"
        )
    return f"in the current folder ({os.getcwd()}) and on sys.path {[p or '.' for p in sys.path]}"


def module_is_findable(module_name: str) -> bool:
    """Whether :func:`import_module` can find ``module_name``'s top-level package or module, asked of Python's
    finders without importing anything."""
    import importlib.machinery
    import importlib.util

    top = module_name.split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec: it is there
        return True
    return found or importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None


def _not_found(err: ModuleNotFoundError) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {err.name!r}: looked {where_modules_are_looked_for(err.name)}",
                               name=err.name)  # fmt: skip
