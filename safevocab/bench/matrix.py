"""The benchmark over several rules and thread counts: ``python -m safevocab.bench --rules ... --threads ...``.

For each thread count one fresh worker process (``OMP_NUM_THREADS`` and ``torch.set_num_threads`` set to it) times
the matmul floor (and the recompute floor, when ``--variants`` names ``recompute_floor``), trl's unmasked kernel (when
installed) and ``fused_safe_logprobs`` under every rule (plus support
replay of the first sparse rule's sets with ``--replay``), round-robin, on the same hidden states and weight (targets
sampled per rule, as :mod:`safevocab.bench.variants` does). Every ratio of a row is measured in the same process under
the same conditions: ``fused / floor`` and ``fused / trl`` per rule.

``--busy-cores K`` starts ``K`` processes that spin on a core for the whole measurement (the output says so): the
"one core busy elsewhere" condition, reproducible. The load average at the start is given with the table.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Callable

import torch

from safevocab.bench.variants import make_step, trl_available
from safevocab.bench.worker import measure_steps, run_worker

__all__ = ["run_matrix", "measure_matrix", "format_matrix"]

_SPIN = "while True:\n    pass\n"

logger = logging.getLogger(__name__)


def _rule_args(args: argparse.Namespace, rule: str) -> argparse.Namespace:
    return argparse.Namespace(**vars(args) | {"rule": rule})


def measure_matrix(args: argparse.Namespace) -> dict[str, dict]:
    """Runs in the worker (:func:`safevocab.bench.run.run` calls this): floor, recompute_floor (when ``--variants``
    holds it), trl (when ``--variants`` holds it and it imports here) and one ``fused`` per rule (``fused[RULE]``),
    memory then timed round-robin (:func:`safevocab.bench.worker.measure_steps`)."""
    device = torch.device(args.device)
    named = args.variants.split(",")
    factories: dict[str, Callable[[], Callable[[], None]]] = {"floor": lambda: make_step("floor", args, device)}
    if "recompute_floor" in named:
        factories["recompute_floor"] = lambda: make_step("recompute_floor", args, device)
    if "trl" in named and trl_available():
        factories["trl"] = lambda: make_step("trl", args, device)
    for rule in split_rules(args.rules):
        factories[f"fused[{rule}]"] = lambda rule=rule: make_step("fused", _rule_args(args, rule), device)
    if args.replay:
        factories[f"fused_replay[{args.replay}]"] = lambda: make_step(
            "fused_replay", _rule_args(args, args.replay), device
        )
    return measure_steps(factories, args)


def split_rules(spec: str) -> list[str]:
    """``"none;min_p=0.001;top_k=50,min_p=0.01"`` -> the rules (``;`` separates rules, ``,`` joins a rule's parts)."""
    return [r.strip() for r in spec.split(";") if r.strip()]


def run_matrix(args: argparse.Namespace, argv: list[str]) -> dict[str, dict]:
    """One worker per thread count (each under ``--busy-cores`` spinning processes); results keyed by thread count."""
    results: dict[str, dict] = {}
    for threads in [int(t) for t in str(args.threads).split(",")]:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        logger.info("measuring %r at %d thread(s), %d busy core(s) ...", args.rules, threads, args.busy_cores)
        spinning = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(args.busy_cores)]
        try:
            results[str(threads)] = run_worker(["matrix"], [*argv, "--_threads", str(threads)], env)
        finally:
            for spinner in spinning:
                spinner.kill()
                spinner.wait()
    return results


def format_matrix(args: argparse.Namespace, results: dict[str, dict], load: tuple[float, float, float]) -> str:
    """Per thread count: the floor's and trl's times, then per rule the fused time and its ratios."""
    lines = [
        f"safevocab.bench  N={args.n} H={args.h} V={args.v} dtype={args.dtype} device={args.device} repeats={args.repeats} "
        f"max_chunk_bytes={args.max_chunk_bytes} keep_logits_bytes={args.keep_logits_bytes}; "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"busy cores: {args.busy_cores} spinning process(es) ran during the measurement",
    ]
    for threads, res in results.items():
        floor, trl, recompute = res["floor"], res.get("trl"), res.get("recompute_floor")
        lines += [
            "",
            f"threads={threads}: floor {floor['seconds']:.3f} s"
            + (f", recompute_floor {recompute['seconds']:.3f} s" if recompute else "")
            + (f", trl {trl['seconds']:.3f} s" if trl and "error" not in trl else ", trl not measured"),
            "",
            "| rule | fused fwd+bwd (s) | fused / floor |"
            + (" fused / recompute_floor |" if recompute else "")
            + " fused / trl | peak extra memory (MiB) |",
            "|---|---:|---:|" + ("---:|" if recompute else "") + "---:|---:|",
        ]
        for name, r in res.items():
            if not name.startswith("fused"):
                continue
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error']} | |" + (" |" if recompute else "") + " | |")
                continue
            vs_trl = f"{r['seconds'] / trl['seconds']:.2f}" if trl and "error" not in trl else "n/a"
            vs_recompute = f" {r['seconds'] / recompute['seconds']:.2f} |" if recompute else ""
            variant, _, rule = name[:-1].partition("[")  # fused[RULE] or fused_replay[RULE]
            label = rule if variant == "fused" else f"replay of {rule}"
            lines.append(
                f"| `{label}` | {r['seconds']:.3f} | {r['seconds'] / floor['seconds']:.2f} |{vs_recompute} {vs_trl} | "
                f"{r['peak_bytes'] / 2**20:.0f} |"
            )
    return "\n".join(lines)
