"""``safevocab``: the command-line dispatcher (``safevocab grpo|diagnose|study|bench ...``), in trl's ``trl/cli`` shape.

Each subcommand is a module of this package with a ``make_parser(prog)`` and a ``main(argv) -> int``:

- ``grpo`` (:mod:`~trl_integration.commands.grpo`): GRPO with safe-vocabulary log-probabilities (also the
  ``safevocab-grpo`` console script; with no arguments, the main job on the bundled tiny model);
- ``diagnose`` (:mod:`~trl_integration.commands.diagnose`): the mismatch lab (:mod:`trl_integration.lab`);
- ``study`` (:mod:`~trl_integration.commands.study`): remedies compared arm by arm (:mod:`trl_integration.study`);
- ``bench`` (:mod:`~trl_integration.commands.bench`): the fused-kernel benchmark (:mod:`safevocab.bench`).

The dispatcher imports a subcommand only when it runs, so ``safevocab bench`` and ``safevocab --help`` import
neither trl nor transformers. Everything after the subcommand's name goes to that subcommand's parser.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from trl_integration.commands.errors import USAGE_ERROR, fail
from trl_integration.experimental import SILENCE_VARIABLE
from trl_integration.notices import filter_known_notices

# The entry points' console: third-party notices that are wrong for this install are filtered (notices.py), before a
# subcommand imports trl or vLLM (their import-time notices). Here, not at `import trl_integration`.
filter_known_notices()

__all__ = ["COMMANDS", "make_parser", "main"]

#: Subcommand name -> one-line help (the module is ``trl_integration.commands.<name>``).
COMMANDS: dict[str, str] = {
    "grpo": "train with GRPO and safe-vocabulary log-probabilities (no arguments: the tiny demo job)",
    "diagnose": "measure a model's training-inference mismatch under two precisions or injected logit noise",
    "study": "compare mismatch remedies (no remedy, TIS, MIS, DVP, DVP + length decay) over seeds, with a report",
    "bench": "benchmark fused_safe_logprobs against the matmul floor, a naive log-softmax and trl",
}

PROG = "safevocab"


def make_parser() -> argparse.ArgumentParser:
    """The ``safevocab`` parser: the subcommands and their one-line help (each subcommand parses its own flags)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="safevocab commands. Run `safevocab COMMAND --help` for a command's flags.",
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, help_text in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def load(name: str):
    """The module of subcommand ``name`` (imported on first use)."""
    return importlib.import_module(f"trl_integration.commands.{name}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``safevocab`` console script: ``safevocab COMMAND [ARGS...]``. Returns the exit status.

    No command prints the help to stderr and returns 2; ``-h``/``--help`` prints it and returns 0; an unknown
    command is a one-line error (exit status 2).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        make_parser().print_help(sys.stderr)
        return USAGE_ERROR
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help"):
        make_parser().print_help()
        return 0
    if name not in COMMANDS:
        return fail(PROG, f"unknown command {name!r}: accepted one of {', '.join(COMMANDS)}")
    # the experimental tools' own command lines: their user asked for the tool (trl_integration.experimental)
    os.environ.setdefault(SILENCE_VARIABLE, "1")
    return load(name).main(rest)
