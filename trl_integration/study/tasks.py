"""``safevocab study --task SPEC``: a :class:`~trl_integration.task.StudyTask` from a built-in name or a
``module:function`` plug-in.

- ``arithmetic`` (the default): :func:`trl_integration.demo.arithmetic_task.arithmetic_task`, the bundled tiny
  model's integer arithmetic;
- ``freetext``: ``trl_integration.demo.freetext:freetext_task``, a 4096-token testbed model with a text-overlap
  reward (imported only when asked for);
- ``module:function``: ``function()`` (no arguments) returns a ``StudyTask``; the module is imported from
  ``sys.path`` or the current folder (:mod:`trl_integration.plugins`).

Every failure is one ``ValueError`` line naming ``--task``: a malformed spec, a module that cannot be imported, a
missing function, a function that raises, or one that returns something other than a ``StudyTask``.
"""

from __future__ import annotations

import importlib.util

from trl_integration.plugins import load_callable
from trl_integration.task import StudyTask

__all__ = ["BUILTIN_TASKS", "load_task"]

#: The built-in task names and the ``module:function`` each stands for.
BUILTIN_TASKS: dict[str, str] = {
    "arithmetic": "trl_integration.demo.arithmetic_task:arithmetic_task",
    "freetext": "trl_integration.demo.freetext:freetext_task",
}


def load_task(spec: str | StudyTask) -> StudyTask:
    """The task ``spec`` names (a ``StudyTask`` is returned as it is).

    Args:
        spec: ``"arithmetic"``, ``"freetext"`` or ``"module:function"``.

    Raises:
        ValueError: one line naming ``--task`` (see the module docstring).
    """
    if isinstance(spec, StudyTask):
        return spec
    if not isinstance(spec, str) or (spec not in BUILTIN_TASKS and ":" not in spec):
        raise ValueError(
            f"--task={spec!r} is not accepted: accepted {', '.join(map(repr, BUILTIN_TASKS))} or 'module:function' "
            "(a function returning a StudyTask)"
        )
    target = BUILTIN_TASKS.get(spec, spec)
    module = target.partition(":")[0]
    if spec in BUILTIN_TASKS and importlib.util.find_spec(module) is None:
        raise ValueError(f"--task={spec!r} is not available in this install: {module} is missing")
    factory = load_callable(target, "--task")
    try:
        task = factory()
    except Exception as err:  # a user's factory may fail in any way: one line, not a traceback
        raise ValueError(f"--task={spec!r}: {target}() raised {type(err).__name__}: {err}") from err
    if not isinstance(task, StudyTask):
        raise ValueError(
            f"--task={spec!r}: {target}() returned {type(task).__name__}, not a StudyTask "
            "(trl_integration.task.StudyTask)"
        )
    return task
