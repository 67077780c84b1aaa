"""The benchmark's table of one run: each variant's time and peak extra memory, then ``fused``'s ratios to the others.

The matrix of several rules and thread counts has its own table (:func:`safevocab.bench.matrix.format_matrix`).
"""

from __future__ import annotations

import argparse

import torch

from safevocab.bench.variants import VARIANTS

__all__ = ["device_name", "format_table"]


def format_table(args: argparse.Namespace, results: dict[str, dict], kept_set: dict | None = None) -> str:
    """The Markdown report of one worker's ``results`` (:func:`safevocab.bench.worker.measure_variants`), headed by
    the run's settings and, when given, the kept sets' sizes of the timed rows."""
    lines = [
        f"safevocab.bench  N={args.n} H={args.h} V={args.v} dtype={args.dtype} rule={args.rule} "
        f"device={device_name(args.device)} threads={torch.get_num_threads()} repeats={args.repeats} "
        f"backend={args.backend} max_chunk_bytes={args.max_chunk_bytes} logits={args.logits_profile}",
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
    for other in ("floor", "fused_torch", "naive", "trl", "liger"):
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
