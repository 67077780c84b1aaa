"""Per-kernel profile of ``fused_safe_logprobs`` (the default backend: Triton on CUDA) beside trl's kernel.

For each rule (default ``none``, ``min_p=0.001``, ``top_k=50``, ``top_p=0.9``) and logits profile
(:mod:`safevocab.bench.inputs`), one process times forward + backward of safevocab's fused op and of trl's
``ChunkedLogProbFunction`` on the same inputs (mean of ``--steps`` after 2 warm-ups, interleaved), then records one
step of each under ``torch.profiler``: the top kernels by device time (CUDA) or ops by CPU time (CPU). Writes JSON
(``--out``) and prints the tables. On a CPU it runs at toy sizes (a check of the script).

    PYTHONPATH=$PWD python scripts/profile_fused_vs_trl.py --out profile.json                     # CUDA, N = 8192
    PYTHONPATH=$PWD python scripts/profile_fused_vs_trl.py --small --rules none --out /tmp/p.json  # CPU check

This is tooling, not product code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from safevocab import fused_safe_logprobs
from safevocab.bench.inputs import PROFILES, draw_logit_factors, kept_set_sizes, sample_targets

RULES = ("none", "min_p=0.001", "top_k=50", "top_p=0.9")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_rule(rule: str, logits_profile: str, shape: tuple[int, int, int], device: str, steps: int,
                 row_limit: int) -> dict:  # fmt: skip
    """Step times and the top kernels of ``fused`` and ``trl`` under ``rule`` on ``logits_profile`` logits."""
    n, h, v = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, weight = draw_logit_factors(n, h, v, profile=logits_profile, generator=gen, device=device)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    targets = sample_targets(hidden, weight, "none" if rule == "none" else rule, gen)
    grad_out = torch.randn(n, generator=gen, device=device)
    chunked = importlib.import_module("trl.kernels").ChunkedLogProbFunction

    budget = {"max_chunk_bytes": 2**30} if device == "cuda" else {}  # the GPU bench's 1 GiB chunk budget

    def fused() -> None:
        h_, w_ = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        fused_safe_logprobs(h_, w_, targets, rule, **budget).logprobs.backward(grad_out)

    def trl() -> None:
        h_, w_ = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        chunked.apply(h_, w_, None, targets, 1.0, 32768, None, 1.0, ())[0].backward(grad_out)

    variants = {"fused": fused, "trl": trl}
    for step in variants.values():  # warm-up (Triton compiles here)
        step()
        step()
    times = {name: [] for name in variants}
    for _ in range(steps):  # interleaved, so a drift of the machine hits both
        for name, step in variants.items():
            _sync(device)
            started = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - started)
    out = {
        "rule": rule,
        "logits_profile": logits_profile,
        "n": n,
        "h": h,
        "v": v,
        "dtype": str(dtype),
        "kept_set": kept_set_sizes(hidden, weight, rule),
    }
    sort_by = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for name, step in variants.items():
        with profile(activities=activities) as prof:
            step()
            _sync(device)
        averages = prof.key_averages()
        table = averages.table(sort_by=sort_by, row_limit=row_limit, max_name_column_width=60)
        key = "device_time_total" if device == "cuda" else "cpu_time_total"
        top = sorted(averages, key=lambda e: getattr(e, key, 0.0), reverse=True)[:row_limit]
        out[name] = {
            "mean_seconds": sum(times[name]) / len(times[name]),
            "seconds": times[name],
            "top": [{"name": e.key, "calls": e.count, "us": round(getattr(e, key, 0.0), 1)} for e in top],
            "table": table,
        }
    out["fused_over_trl"] = out["fused"]["mean_seconds"] / out["trl"]["mean_seconds"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU toy sizes (N=128, H=32, V=2000)")
    parser.add_argument("--rules", default=";".join(RULES), help="';'-separated rules (default: %(default)s)")
    parser.add_argument("--profiles", default="synthetic", help=f"','-separated logits profiles of {PROFILES}")
    parser.add_argument("--n", type=int, default=8192, help="tokens (default 8192; H=4096, V=151936 on CUDA)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant after 2 warm-ups (default 3)")
    parser.add_argument("--row-limit", type=int, default=15, help="kernels per table (default 15)")
    parser.add_argument("--out", default="profile_fused_vs_trl.json", help="results file (JSON)")
    args = parser.parse_args(argv)
    profiles = [p for p in args.profiles.split(",") if p]
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown:
        parser.error(f"--profiles: unknown {unknown}; accepted {','.join(PROFILES)}")
    device = "cpu" if args.small or not torch.cuda.is_available() else "cuda"
    shape = (128, 32, 2000) if device == "cpu" else (args.n, 4096, 151936)
    rows = []
    for logits_profile in profiles:
        for rule in filter(None, args.rules.split(";")):
            try:
                row = profile_rule(rule, logits_profile, shape, device, args.steps, args.row_limit)
            except Exception as err:  # one failing rule must not lose the others
                row = {"rule": rule, "logits_profile": logits_profile, "error": f"{type(err).__name__}: {err}"[:400]}
            rows.append(row)
            Path(args.out).write_text(json.dumps(rows, indent=1))  # what is done so far is never lost
            if "error" in row:
                print(f"== {rule} ({logits_profile}): {row['error']}", flush=True)
                continue
            print(
                f"== {rule} ({logits_profile}): fused {row['fused']['mean_seconds']:.4f} s, trl "
                f"{row['trl']['mean_seconds']:.4f} s, ratio {row['fused_over_trl']:.2f}; |S| median "
                f"{row['kept_set']['median']:.0f}",
                flush=True,
            )
            for name in ("fused", "trl"):
                print(f"-- {name}\n{row[name]['table']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
