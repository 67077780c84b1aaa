"""Fused-op speed before/after a change: ``python -m safevocab.bench`` on two source trees, interleaved.

    OMP_NUM_THREADS=1 python scripts/bench_before_after.py OLD_TREE NEW_TREE [--rules 'none;min_p=0.001;top_k=50']
        [--rounds 2] [--n 2048 --h 256 --v 32000] [--oos]

Each round runs, for each rule, the bench's ``fused`` variant (forward + backward, targets sampled from the
pruned policy) once from each tree (a fresh subprocess whose ``cwd`` is the tree, so its ``safevocab`` is
imported), alternating which tree goes first; the best time over rounds is kept. ``--oos`` also times an unmasked
loss whose targets are outside ``S`` on 1 % / 100 % of the rows (the full-softmax part of sparse chunks), which
the bench does not exercise. Prints new / old per rule.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

OOS = r"""
import json, sys, time, torch
from safevocab import fused_safe_logprobs
n, h, v, rule, frac = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
g = torch.Generator().manual_seed(0)
hidden = torch.randn(n, h, generator=g).requires_grad_()
weight = (torch.randn(v, h, generator=g) * (3.0 / h**0.5)).requires_grad_()
with torch.no_grad():
    targets = torch.cat([(hb @ weight.t()).argmax(-1) for hb in hidden.split(256)])  # in S
out_rows = torch.randperm(n, generator=g)[: max(1, int(frac * n))]
targets[out_rows] = torch.randint(0, v, (out_rows.numel(),), generator=g)  # mostly outside S
grad = torch.randn(n, generator=g)
best = float("inf")
for _ in range(4):
    t0 = time.perf_counter()
    out = fused_safe_logprobs(hidden, weight, targets, rule)
    out.logprobs.backward(grad)  # unmasked: out-of-set rows get a gradient
    best = min(best, time.perf_counter() - t0) if _ else best  # the first is a warm-up
    hidden.grad = weight.grad = None
print(json.dumps({"seconds": best, "out_of_set": int((~out.in_safe).sum())}))
"""


def run(tree: str, argv: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(tree: str, rule: str, args) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, PYTHONPATH=tree)
        cmd = [
            sys.executable,
            "-m",
            "safevocab.bench",
            "--variants",
            "fused",
            "--rule",
            rule,
            "--n",
            str(args.n),
            "--h",
            str(args.h),
            "--v",
            str(args.v),
            "--repeats",
            str(args.repeats),
            "--json",
            f.name,
        ]
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        return json.load(open(f.name))["results"]["fused"]["seconds"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rules", default="none;min_p=0.001;top_k=50;top_p=0.9")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--h", type=int, default=256)
    p.add_argument("--v", type=int, default=32000)
    p.add_argument("--oos", action="store_true")
    args = p.parse_args()
    rules = args.rules.split(";")
    best: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):
        for rule in rules:
            trees = [("old", args.old), ("new", args.new)][:: 1 if r % 2 == 0 else -1]
            for name, tree in trees:
                s = bench(tree, rule, args)
                best[(name, rule)] = min(best.get((name, rule), float("inf")), s)
                if args.oos:
                    for frac in (0.01, 1.0):
                        o = run(tree, ["-c", OOS, str(args.n), str(args.h), str(args.v), rule, str(frac)])
                        key = (name, f"{rule} unmasked, {frac:.0%} rows out of S")
                        best[key] = min(best.get(key, float("inf")), o["seconds"])
    print(f"n={args.n} h={args.h} v={args.v} threads={os.environ.get('OMP_NUM_THREADS')} rounds={args.rounds}")
    for key in dict.fromkeys(k for _, k in best):
        old, new = best[("old", key)], best[("new", key)]
        print(f"  {key:45s} old {old:7.3f} s  new {new:7.3f} s  new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
