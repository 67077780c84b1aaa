"""The benchmark's driver: :func:`run` parses the flags and returns the report of one worker's measurement, or of the
matrix of several rules and thread counts; :func:`show_progress` shows its progress lines.

In a worker process (``--_worker``) :func:`run` measures instead and returns the results as one JSON line
(:mod:`safevocab.bench.worker`; ``--_worker matrix``: :func:`safevocab.bench.matrix.measure_matrix`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

from safevocab.bench.cli import parse_args
from safevocab.bench.inputs import kept_set_sizes
from safevocab.bench.report import format_table
from safevocab.bench.variants import VARIANTS, liger_available, make_step, shared_inputs, trl_available
from safevocab.bench.worker import measure_steps, measure_variants, run_worker

__all__ = ["PROGRESS_LOGGERS", "run", "show_progress"]

logger = logging.getLogger(__name__)
#: The loggers of the benchmark's progress lines: the package's, whose children every module's logger
#: (``logging.getLogger(__name__)``) is.
PROGRESS_LOGGERS = ("safevocab.bench",)


class _ProgressHandler(logging.StreamHandler):
    """The handler :func:`show_progress` adds (found again by its type, so a second call adds none)."""


def show_progress(stream=None) -> None:
    """Show the benchmark's progress lines (INFO and up of :data:`PROGRESS_LOGGERS`) on ``stream`` (default:
    ``sys.stderr``), as their bare message. For the entry points: a library caller configures logging."""
    for name in PROGRESS_LOGGERS:
        progress_logger = logging.getLogger(name)
        progress_logger.setLevel(logging.INFO)
        if not any(isinstance(handler, _ProgressHandler) for handler in progress_logger.handlers):
            handler = _ProgressHandler(stream)
            handler.setFormatter(logging.Formatter("%(message)s"))
            progress_logger.addHandler(handler)
        progress_logger.propagate = False


def run(argv: list[str] | None = None, prog: str = "python -m safevocab.bench") -> str:
    """Run the benchmark and return its report: the table (or, in a worker process, the results as one JSON line).

    ``argv``: default ``sys.argv[1:]``; ``prog`` names the command in ``--help``. Progress goes to the
    ``safevocab.bench`` logger. Raises ``SystemExit`` on ``--help`` and on a bad flag (argparse's, and one line for
    ``--variants``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, prog)
    if args.max_chunk_bytes is None:
        from safevocab.logprobs import DEFAULT_MAX_CHUNK_BYTES

        args.max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES
    if args._threads is not None:
        torch.set_num_threads(args._threads)
    if args._worker == "matrix":
        from safevocab.bench.matrix import measure_matrix

        with_trl = "trl" in args.variants.split(",") and trl_available()
        return json.dumps(measure_matrix(args, make_step, measure_steps, with_trl))
    if args._worker:
        results = measure_variants(args._worker.split(","), args)
        hidden, weight, _, _ = shared_inputs(args, torch.device(args.device))
        results["_kept_set"] = kept_set_sizes(hidden.detach(), weight.detach(), args.rule)  # |S| of the timed rows
        return json.dumps(results)
    if args.rules is not None or args.threads is not None or args.busy_cores:
        return _run_matrix(args, argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; accepted {','.join(VARIANTS)}")
    if "trl" in variants and not trl_available():
        variants.remove("trl")
    if "liger" in variants and not liger_available():
        variants.remove("liger")
    from safevocab.rules import parse_rule

    parse_rule(args.rule)  # fail fast on a bad rule, before any worker starts
    logger.info("measuring %s (%d round-robin repeats) ...", ", ".join(variants), args.repeats)
    results = run_worker(variants, argv)
    kept_set = results.pop("_kept_set", None)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "_worker"}, "results": results,
                       "kept_set": kept_set}, f, indent=2)  # fmt: skip
    return format_table(args, results, kept_set)


def _run_matrix(args: argparse.Namespace, argv: list[str]) -> str:
    from safevocab.bench.matrix import format_matrix, run_matrix, split_rules
    from safevocab.rules import parse_rule

    if args.rules is None:
        args.rules = args.rule
        argv = [*argv, "--rules", args.rule]
    if args.threads is None:
        args.threads = str(torch.get_num_threads())
        argv = [*argv, "--threads", args.threads]
    for rule in split_rules(args.rules) + ([args.replay] if args.replay else []):
        parse_rule(rule)  # fail fast on a bad rule, before any worker starts
    load = os.getloadavg()
    results = run_matrix(args, argv)
    if args.json_path:
        with open(args.json_path, "w") as f:
            state = {"load_average": load, "busy_cores": args.busy_cores}
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "machine": state,
                       "results": results}, f, indent=2)  # fmt: skip
    return format_matrix(args, results, load)
