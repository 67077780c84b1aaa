"""The one error style of the ``safevocab`` commands: one line on stderr, exit status 2."""

from __future__ import annotations

import sys

__all__ = ["USAGE_ERROR", "fail"]

#: Exit status of a bad command line (argparse's own, for flags it rejects itself).
USAGE_ERROR = 2


def fail(prog: str, message: str) -> int:
    """Print ``"<prog>: error: <message> (see `<prog> --help`)"`` on one line of stderr and return 2.

    argparse's ``error()`` would print the usage first, which for ``safevocab-grpo`` is hundreds of flags long.
    """
    print(f"{prog}: error: {message} (see `{prog} --help`)", file=sys.stderr)
    return USAGE_ERROR
