"""Does a second torch thread pay for a GRPO step on a CPU? One vs two intra-op threads, by model size.

    python examples/bench_threads.py                                   # sizes 0.5M..~30M parameters, 1 and 2 threads
    taskset -c 0,1 python examples/bench_threads.py --busy 6           # two cores, six spinning processes beside it

A GRPO step of the main job's shape without trl (torch and transformers only, so that it runs on any machine with
them): ``generate`` 8 sampled tokens for 64 prompts of 12 tokens (KV-cached decoding), then one forward and backward
pass over the 64 x 20 tokens and an AdamW step. The models are random Llamas: the bundled tiny model's shape
(hidden 128, 3 layers, vocabulary 19: 0.5M parameters) and 4-layer ones with a 4096-token vocabulary and hidden
sizes 256 to 768. Each size runs one warm-up step per thread count, then ``--repeats`` rounds that alternate the
thread counts step by step, so the slow drifts of a shared machine fall on both alike; the median step time of each
count and their ratio are printed. ``--busy N`` starts N spinning processes (``while True: pass``) for the whole
run and stops them at the end. Timings are a measurement on one machine; nothing asserts them.

This is the measurement behind ``trl_integration.harness.threads.SMALL_MODEL_PARAMETERS`` (docs/trl.md, "Threads").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

#: (name, hidden size, layers, vocabulary): the bundled tiny model's shape, then wider 4-layer models.
SIZES = {
    "tiny": (128, 3, 19),
    "h256": (256, 4, 4096),
    "h384": (384, 4, 4096),
    "h512": (512, 4, 4096),
    "h768": (768, 4, 4096),
}


def build(hidden: int, layers: int, vocab: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, intermediate_size=2 * hidden,
        num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32, head_dim=32,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, prompts: torch.Tensor) -> float:
    """One generate + forward + backward + optimizer step; its wall time in seconds."""
    start = time.perf_counter()
    model.eval()
    with torch.no_grad():
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, min_new_tokens=8, do_sample=True,
            top_k=0, pad_token_id=0,
        )  # fmt: skip
    model.train()
    loss = model(out, labels=out).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated names of {list(SIZES)}")
    parser.add_argument("--threads", default="1,2", help="thread counts to compare (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per thread count (default: %(default)s)")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside the run (default: 0)")
    args = parser.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(
            f"torch {torch.__version__}, default threads {torch.get_num_threads()}, {args.busy} busy, load {load:.2f}"
        )
        for name in args.sizes.split(","):
            model = build(*SIZES[name])
            params = sum(p.numel() for p in model.parameters())
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
            prompts = torch.randint(3, SIZES[name][2], (64, 12), generator=torch.Generator().manual_seed(0))
            times: dict[int, list[float]] = {n: [] for n in counts}
            for n in counts:  # warm-up
                torch.set_num_threads(n)
                step(model, optimizer, prompts)
            for r in range(args.repeats):
                for n in counts if r % 2 == 0 else reversed(counts):
                    torch.set_num_threads(n)
                    times[n].append(step(model, optimizer, prompts))
            medians = {n: statistics.median(t) for n, t in times.items()}
            cells = "  ".join(f"{n} thread(s) {medians[n]:.3f} s" for n in counts)
            ratio = medians[counts[0]] / medians[counts[-1]]
            print(
                f"{name:5s} {params / 1e6:6.2f}M params  {cells}  speed-up of {counts[-1]} over {counts[0]}: "
                f"{ratio:.2f}x",
                flush=True,
            )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
