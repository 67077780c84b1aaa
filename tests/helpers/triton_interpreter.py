"""Triton's interpreter without its redundant re-patching: the kernel tests' CPU cost cut by about a fifth.

Under ``TRITON_INTERPRET=1`` every launch (``GridExecutor.__call__``) swaps ``triton.language``'s builtins for
interpreted ones (``_patch_lang``) and restores them when the launch ends. Triton 3.9 also calls ``_patch_lang``
at every call of a nested ``@triton.jit`` helper (``InterpretedFunction.__call__``), inside the launch, where the
builtins are already swapped: the call finds no builtin left to patch, re-sets the same attributes, and its scope
is never restored (the launch's own restore undoes everything). It runs ``inspect.getmembers`` over the language
modules each time: a quarter of the kernel tests' time (cProfile of ``test_triton_matches_reference``: 7,071 nested
calls, 13.9 of 57 s).

:func:`skip_nested_patching` makes ``_patch_lang`` a no-op for those nested calls only, where the helper's module
holds no language module (``tl``, ``tl.core``) that the launch has not patched yet. Kernels compute exactly
what they did; the launch's own patch and restore are Triton's. Where Triton's private names have moved, it
changes nothing and says so (the tests then run at Triton's own speed). Tests only: product code never imports it.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["skip_nested_patching"]


class _NoScope:
    """What a skipped nested patch returns: nothing to restore (the nested call ignores it anyway)."""

    def restore(self) -> None:
        pass


def skip_nested_patching() -> bool:
    """Skip ``_patch_lang`` at nested ``@triton.jit`` calls inside an interpreted launch; True where installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    grid_executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or grid_executor is None or getattr(patch_lang, "_safevocab_skips_nested", False):
        return patch_lang is not None and grid_executor is not None
    launch = grid_executor.__call__
    language_modules = {id(interpreter.tl), id(interpreter.tl.core)}
    patched: set[int] = set()  # ids of the language modules whose builtins this launch has swapped so far
    held: dict[int, frozenset[int]] = {}  # per module namespace (kernel modules are never reloaded in a test run)

    def _language_modules_of(namespace: dict) -> frozenset[int]:
        """The language modules a module's namespace holds (computed once a namespace: a nested call's scan of it
        cost 3 % of the radix kernel tests' time)."""
        key = id(namespace)
        if key not in held:
            held[key] = frozenset(id(value) for value in namespace.values() if inspect.ismodule(value)) & frozenset(
                language_modules
            )
        return held[key]

    @functools.wraps(launch)
    def launch_once_patched(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    @functools.wraps(patch_lang)
    def patch_lang_once(fn):
        # Triton patches the language modules (``tl``, ``tl.core``) that the function's own module holds: a helper
        # from a module holding one the launch has not patched yet is patched as Triton does.
        langs = _language_modules_of(fn.__globals__)
        if langs <= patched:
            return _NoScope()
        patched.update(langs)
        return patch_lang(fn)

    patch_lang_once._safevocab_skips_nested = True
    interpreter._patch_lang = patch_lang_once
    grid_executor.__call__ = launch_once_patched
    return True
