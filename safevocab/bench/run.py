"""The benchmark's driver: :func:`run` parses the flags and returns the report of one worker's measurement, or of the
matrix of several rules and thread counts; :func:`show_progress` shows its progress lines.

The report of one run is :func:`format_table`: each variant's time and peak extra memory, then ``fused``'s ratios to
the others (the matrix has its own table, :func:`safevocab.bench.matrix.format_matrix`).

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
from safevocab.bench.matrix import format_matrix, measure_matrix, run_matrix, split_rules
from safevocab.bench.variants import VARIANTS, liger_available, shared_inputs, trl_available
from safevocab.bench.worker import measure_variants, run_worker
from safevocab.rules import parse_rule

__all__ = ["PROGRESS_LOGGERS", "device_name", "format_table", "run", "show_progress"]

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
    if args._threads is not None:
        torch.set_num_threads(args._threads)
    if args._worker == "matrix":
        return json.dumps(measure_matrix(args))
    if args._worker:
        results = measure_variants(args._worker.split(","), args)
        hidden, weight, _, _ = shared_inputs(args, torch.device(args.device))
        results["_kept_set"] = kept_set_sizes(hidden.detach(), weight.detach(), args.rule)  # |S| of the timed rows
        return json.dumps(results)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:  # both modes: the matrix would drop a misspelt name without a word
        raise SystemExit(f"--variants: unknown {unknown}; accepted {','.join(VARIANTS)}")
    if args.rules is not None or args.threads is not None or args.busy_cores:
        return _run_matrix(args, argv)
    for name, available in (("trl", trl_available), ("liger", liger_available)):
        if name in variants and not available():
            variants.remove(name)
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


def format_table(args: argparse.Namespace, results: dict[str, dict], kept_set: dict | None = None) -> str:
    """The Markdown report of one worker's ``results`` (:func:`safevocab.bench.worker.measure_variants`), headed by
    the run's settings and, when given, the kept sets' sizes of the timed rows."""
    lines = [
        f"safevocab.bench  N={args.n} H={args.h} V={args.v} dtype={args.dtype} rule={args.rule} "
        f"device={device_name(args.device)} threads={torch.get_num_threads()} repeats={args.repeats} "
        f"backend={args.backend} max_chunk_bytes={args.max_chunk_bytes} keep_logits_bytes={args.keep_logits_bytes} "
        f"logits={args.logits_profile}",
        *([f"kept set |S|: median {kept_set['median']:.0f}, p99 {kept_set['p99']:.0f}"] if kept_set else []),
        "",
        "| variant | fwd+bwd time (s) | peak extra memory (MiB) |",
        "|---|---:|---:|",
    ]
    for name in VARIANTS:
        if name in results:
            r = results[name]
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error']} | |")
            else:
                lines.append(f"| {name} | {r['seconds']:.3f} | {r['peak_bytes'] / 2**20:.0f} |")
    lines += ["", "| ratio | time | peak memory |", "|---|---:|---:|"]
    fused = results.get("fused")
    if fused and "error" in fused:
        fused = None
    for other in ("floor", "recompute_floor", "fused_torch", "naive", "trl", "liger"):
        if fused and other in results and "error" not in results[other]:
            r = results[other]
            mem = fused["peak_bytes"] / r["peak_bytes"] if r["peak_bytes"] > 0 else float("nan")
            lines.append(f"| fused / {other} | {fused['seconds'] / r['seconds']:.2f} | {mem:.3f} |")
    for other, package in (("trl", "trl"), ("liger", "liger_kernel")):
        if other not in results and other in args.variants.split(","):
            lines.append(f"| fused / {other} | ({package} not installed) | |")
    return "\n".join(lines)


def device_name(device: str) -> str:
    """``device``, with the GPU's name for a CUDA device."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device
