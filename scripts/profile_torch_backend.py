"""Where the torch backend's time goes on a GPU: forward + backward time and torch.profiler's top ops.

Three cases at N = 8192, H = 4096, V = 151936 bf16 (the GPU bench's shapes, random weights with logits of std ~ 3):
``backend="torch"`` with no rule, with ``top_k=64``, and a replayed ``top_k=64`` support (the engine-exact path,
which always runs on the torch backend). Each time is the mean of 3 steps after 2 warm-up steps. On a CPU it runs
at toy sizes (a check of the script). Used for docs/performance.md, "Second GPU run":

    PYTHONPATH=$PWD python scripts/profile_torch_backend.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from safevocab import fused_safe_logprobs
from safevocab.bench.inputs import replay_support

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, H, V = (8192, 4096, 151936) if DEVICE == "cuda" else (256, 64, 3000)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def inputs():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(N, H, generator=gen, device=DEVICE).bfloat16()
    weight = (torch.randn(V, H, generator=gen, device=DEVICE) * (3.0 / H**0.5)).bfloat16()
    support = replay_support(hidden, weight, "top_k=64")  # the top_k=64 sets, built once outside the timing
    targets = support.token_ids[support.offsets[:-1]].clone()  # one kept id per row
    return hidden, weight, targets, support, torch.randn(N, device=DEVICE)


def main() -> None:
    hidden, weight, targets, support, grad_out = inputs()

    def step(case: str) -> None:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        if case == "replay":
            out = fused_safe_logprobs(h, w, targets, None, support=support, max_chunk_bytes=2**30)
        else:
            out = fused_safe_logprobs(h, w, targets, case, backend="torch", max_chunk_bytes=2**30)
        out.logprobs.backward(grad_out)

    sort_by = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
    for case in ("none", "top_k=64", "replay"):
        for _ in range(2):
            step(case)
        sync()
        started = time.perf_counter()
        for _ in range(3):
            step(case)
        sync()
        print(f"{case}: {(time.perf_counter() - started) / 3:.4f} s", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(case)
            sync()
        print(prof.key_averages().table(sort_by=sort_by, row_limit=14, max_name_column_width=50), flush=True)


if __name__ == "__main__":
    main()
