"""The argparse objects of the old ``safevocab`` parser, for the deprecated ``build_parser`` and
``add_study_subparser`` of ``trl_integration.diagnose`` / ``trl_integration.study`` (gone in the next release).

They used to return an ``argparse`` parser whose subcommands carried every flag and a ``func`` default; these
rebuild that from the subcommands' own parsers (argparse's ``parents``), so old callers keep working.
"""

from __future__ import annotations

import argparse

from trl_integration.commands import COMMANDS, load

__all__ = ["add_subcommand_parser", "diagnose_parser", "study_parser", "add_study_subparser"]


def add_subcommand_parser(subparsers, name: str) -> argparse.ArgumentParser:
    """Add subcommand ``name`` with all its flags to an ``argparse`` subparsers action; ``func`` runs it."""
    module = load(name)
    parser = subparsers.add_parser(name, parents=[module.make_parser()], add_help=False, help=COMMANDS[name])
    parser.set_defaults(func=module.run_parsed)
    return parser


def _safevocab_parser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="safevocab")
    add_subcommand_parser(parser.add_subparsers(dest="command", metavar="COMMAND"), name)
    return parser


def diagnose_parser() -> argparse.ArgumentParser:
    """The old ``trl_integration.diagnose.build_parser()``: ``safevocab`` with its ``diagnose`` subcommand."""
    return _safevocab_parser("diagnose")


def study_parser() -> argparse.ArgumentParser:
    """The old ``trl_integration.study.build_parser()``: ``safevocab`` with its ``study`` subcommand."""
    return _safevocab_parser("study")


def add_study_subparser(subparsers) -> argparse.ArgumentParser:
    """The old ``trl_integration.study.add_study_subparser(subparsers)``."""
    return add_subcommand_parser(subparsers, "study")
