"""The one error style of the ``safevocab`` commands: one line on stderr.

- before the model loads (bad input): exit status 2, :func:`fail` and :func:`usage_errors`;
- once the model is loaded (what only the run can reveal): exit status 1, :func:`runtime_errors`;
- ``--debug``: the traceback instead.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["USAGE_ERROR", "fail", "one_line", "usage_errors", "runtime_errors", "mixture_key_errors"]

#: Exit status of a bad command line (argparse's own, for flags it rejects itself).
USAGE_ERROR = 2


def fail(prog: str, message: str) -> int:
    """Print ``"<prog>: error: <message> (see `<prog> --help`)"`` on one line of stderr and return 2.

    argparse's ``error()`` would print the usage first, which for ``safevocab-grpo`` is hundreds of flags long.
    """
    print(f"{prog}: error: {message} (see `{prog} --help`)", file=sys.stderr)
    return USAGE_ERROR


def one_line(err: BaseException) -> str:
    """``err`` as one line: its message, with its type in front unless the message says what went wrong itself."""
    from trl_integration.harness.rewards import RewardFunctionError  # its message names the function and the error

    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, (ValueError, TypeError, RewardFunctionError)) else f"{type(err).__name__}: {text}"


@contextmanager
def usage_errors(prog: str, debug: bool, context: str = "") -> Iterator[None]:
    """Bad input found before the model loads: one line, exit status 2 (a traceback with ``--debug``)."""
    import yaml

    try:
        yield
    except (ValueError, TypeError, OSError, ImportError, AttributeError, StopIteration, yaml.YAMLError) as err:
        if debug:
            raise
        raise SystemExit(fail(prog, context + one_line(err))) from None


@contextmanager
def runtime_errors(prog: str, debug: bool) -> Iterator[None]:
    """Errors once the model is loaded (only the model or the run can reveal them): one line, exit status 1
    (:data:`~trl_integration.commands.broken_run.BROKEN_RUN`); a traceback with ``--debug``."""
    from trl_integration.commands.broken_run import BROKEN_RUN, BrokenRunError

    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:
        if debug:
            raise
        hint = "" if isinstance(err, BrokenRunError) else " (--debug shows the traceback)"
        print(f"{prog}: error: {one_line(err) if not isinstance(err, BrokenRunError) else err}{hint}", file=sys.stderr)
        raise SystemExit(BROKEN_RUN) from None


@contextmanager
def mixture_key_errors() -> Iterator[None]:
    """A ``datasets:`` entry with a key trl's ``DatasetConfig`` does not have: name the key and the accepted ones."""
    import dataclasses

    from trl.scripts.utils import DatasetConfig

    try:
        yield
    except TypeError as err:
        if "DatasetConfig" not in str(err) or "unexpected keyword argument" not in str(err):
            raise
        key = str(err).rsplit("argument", 1)[1].strip()
        accepted = ", ".join(f.name for f in dataclasses.fields(DatasetConfig))
        raise ValueError(f"datasets: unknown key {key}: accepted {accepted}") from None
