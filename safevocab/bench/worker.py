"""The benchmark's worker: one fresh subprocess measures the steps, round-robin, and returns their results.

:func:`run_worker` starts ``python -m safevocab.bench ... --_worker VARIANTS`` (so the inputs of earlier runs never
count) and reads its one JSON line; in that process :func:`measure_variants` measures each variant's peak memory, then
its timed repeats taken round-robin (variant by variant within each repeat), so that a machine whose load changes
slows all alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch

from safevocab.bench.measure import peak_bytes, timed
from safevocab.bench.variants import OPTIONAL_VARIANTS, make_step

__all__ = ["measure_steps", "measure_variants", "run_worker"]

logger = logging.getLogger(__name__)


def measure_variants(variants: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Runs in the worker subprocess: each variant's peak memory, then timed repeats taken round-robin
    (variant by variant within each repeat), so that a machine whose load changes slows all alike."""
    device = torch.device(args.device)
    return measure_steps({v: (lambda v=v: make_step(v, args, device)) for v in variants}, args)


def measure_steps(factories: dict[str, Callable[[], Callable[[], None]]], args: argparse.Namespace) -> dict[str, dict]:
    """:func:`measure_variants` over named step factories (``fused[RULE]`` entries of :mod:`safevocab.bench.matrix`
    too): ``{name: {"variant", "peak_bytes", "seconds", "median_seconds"}}``, or ``{"variant", "error"}`` for an
    optional variant that failed."""
    device = torch.device(args.device)
    steps: dict[str, Callable[[], None]] = {}
    results: dict[str, dict] = {}
    for variant, factory in factories.items():
        torch.manual_seed(args.seed)
        try:
            steps[variant] = factory()
            results[variant] = {"variant": variant, "peak_bytes": peak_bytes(steps[variant], device)}
        except Exception as err:  # a comparison that cannot run here (e.g. out of memory): say so in the table
            if variant.split("[")[0] not in OPTIONAL_VARIANTS:
                raise
            steps.pop(variant, None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            logger.warning("benchmark variant %r failed: %r", variant, err)
            results[variant] = {"variant": variant, "error": f"{type(err).__name__}: {err}"[:200]}
    times: dict[str, list[float]] = {variant: [] for variant in steps}
    for _ in range(args.repeats):
        for variant, step in steps.items():
            times[variant].append(timed(step, device))
    for variant, values in times.items():
        results[variant].update(seconds=min(values), median_seconds=statistics.median(values))
    return results


def run_worker(variants: list[str], argv: list[str], env: dict[str, str] | None = None) -> dict[str, dict]:
    """Measure ``variants`` (``["matrix"]``: :func:`safevocab.bench.matrix.measure_matrix`) in one fresh subprocess
    (the inputs of earlier runs never count), under ``env`` (default: this process's environment)."""
    cmd = [sys.executable, "-m", "safevocab.bench", *argv, "--_worker", ",".join(variants)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
