"""How many rows a mass decision leaves to the rule's torch code (issue 56, point 2): the share of rows whose ``top_p``
crossing lies within ``MASS_MARGIN`` of ``q T`` (``safevocab.kernels.candidate_thresholds``), by logits profile, dtype
and ``q``, with the candidate phase's own decision (``decide_thresholds``) over whole rows.

These rows are why the Triton forward still reads the device once a chunk for ``top_p``/``min_prob`` rules: the rule's
code must run on them before the fold, while the chunk's logits exist. Where the share times the chunk's rows is well
below one, a bounded device-side batch could replace the read; where it is not, the read is the cheap part.

    python scripts/mass_margin_rows.py [--n 512] [--h 64] [--v 151936]
"""

from __future__ import annotations

import argparse

import torch

from safevocab.bench.inputs import PROFILES, draw_logit_factors
from safevocab.kernels.candidate_thresholds import decide_thresholds, selection_plan
from safevocab.rules import finite_floor, parse_rule


def flagged_share(z: torch.Tensor, q: float) -> tuple[float, float]:
    """``(share of rows flagged, median kept count)`` for ``top_p=q`` over the fp32 rows ``z`` ``[n, V]``."""
    plan = selection_plan(parse_rule(f"top_p={q}"))
    n, vocab = z.shape
    m = z.amax(-1)
    total = (z - m.unsqueeze(-1)).exp().double().sum(-1)
    count = torch.full((n,), vocab, dtype=torch.int32)
    floor = torch.full((n,), finite_floor(torch.float32))
    threshold, bad = decide_thresholds(plan.active(vocab), z, count, floor, m, total, vocab)
    kept = (z >= threshold.unsqueeze(-1)).sum(-1).float()
    return bad.float().mean().item(), kept.median().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=512, help="rows (default 512)")
    parser.add_argument("--h", type=int, default=64, help="hidden size of the logit factors (default 64)")
    parser.add_argument("--v", type=int, default=151936, help="vocabulary (default 151936)")
    args = parser.parse_args(argv)
    for flag in ("n", "h", "v"):
        if getattr(args, flag) < (2 if flag == "h" else 1):
            parser.error(f"--{flag} {getattr(args, flag)}: accepted an integer >= {2 if flag == 'h' else 1}")
    generator = torch.Generator().manual_seed(0)
    print("| logits | dtype | top_p | rows flagged | median kept |")
    print("|---|---|---:|---:|---:|")
    for profile in PROFILES:
        hidden, weight = draw_logit_factors(args.n, args.h, args.v, profile=profile, generator=generator, device="cpu")
        logits = hidden @ weight.T
        for dtype in (torch.bfloat16, torch.float32):
            z = logits.to(dtype).float()  # the kernels read the chunk in its dtype and decide in fp32
            for q in (0.9, 0.95, 0.99):
                share, kept = flagged_share(z, q)
                print(f"| {profile} | {str(dtype).removeprefix('torch.')} | {q} | {share:.2%} | {kept:.0f} |")


if __name__ == "__main__":
    main()
