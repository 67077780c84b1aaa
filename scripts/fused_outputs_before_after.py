"""Same numbers bit for bit? The fused op's outputs and gradients from two source trees, compared with ``torch.equal``.

    OMP_NUM_THREADS=1 python scripts/fused_outputs_before_after.py OLD_TREE NEW_TREE

For a pure move (no behaviour change). Each tree runs, in a fresh subprocess whose ``PYTHONPATH`` is the tree (so its
``safevocab`` is imported), a fixed-seed ``fused_safe_logprobs`` forward + backward on both backends (Triton under its
interpreter, ``TRITON_INTERPRET=1``): 7 rules (every kind and compositions) x 3 logit transforms (none; scale, softcap
and temperature; ``T = 1e-5``) x fp32/bf16 x 2 chunk budgets (one chunk; many), with a bias holding ``-inf``, the
entropy and a random upstream gradient on ``logprobs``, ``log_kept_mass`` and ``entropy``; plus a replayed
``SafeSupport``. It also records how backend names resolve per device and the text of every backend-selection error.
Prints how many tensors differ (the exit status is 1 when any does, or when a message differs). About 15 s a tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

RUN = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
import torch
from safevocab import SafeSupport, fused_safe_logprobs

RULES = ["none", "min_p=0.05", "min_prob=0.01", "top_k=7", "top_p=0.8", "top_k=20,min_p=0.02",
         "top_k=30,top_p=0.9,min_p=0.01,min_prob=0.005"]
TRANSFORMS = [{}, {"softcap": 2.5, "logit_scale": 1.7, "temperature": 1.3}, {"temperature": 1e-5}]
results = {}
for backend in ("torch", "triton"):
    for dtype in (torch.float32, torch.bfloat16):
        for ri, rule in enumerate(RULES):
            for ti, transform in enumerate(TRANSFORMS):
                for chunk in (64 * 2**20, 600):
                    g = torch.Generator().manual_seed(1000 * ri + 10 * ti + (chunk == 600))
                    n, h, v = 13, 8, 37
                    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_()
                    weight = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
                    bias = torch.randn(v, generator=g).to(dtype)
                    bias[3] = -float("inf")
                    bias.requires_grad_()
                    targets = torch.randint(0, v, (n,), generator=g)
                    out = fused_safe_logprobs(hidden, weight, targets, rule, bias=bias, compute_entropy=True,
                                              max_chunk_bytes=chunk, backend=backend, **transform)
                    loss = (out.logprobs * torch.randn(n, generator=g)).sum() \
                        + (out.log_kept_mass * torch.randn(n, generator=g)).sum() \
                        + (torch.nan_to_num(out.entropy) * torch.randn(n, generator=g)).sum()
                    loss.backward()
                    results[(backend, str(dtype), rule, ti, chunk)] = [
                        out.logprobs, out.in_safe, out.log_kept_mass, out.safe_size, out.entropy,
                        hidden.grad, weight.grad, bias.grad]
    g = torch.Generator().manual_seed(7)
    n, h, v = 9, 6, 29
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    rows = [sorted(set(torch.randint(0, v, (5,), generator=g).tolist()) | {int(targets[i])}) for i in range(n)]
    out = fused_safe_logprobs(hidden, weight, targets, "min_p=0.001", compute_entropy=True, backend=backend,
                              support=SafeSupport.from_lists(rows), max_chunk_bytes=500)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    results[(backend, "support")] = [out.logprobs, out.in_safe, out.log_kept_mass, out.safe_size, out.entropy,
                                     hidden.grad, weight.grad]

import safevocab.kernels as probes
try:  # the home of backend selection before and after issue 29's move
    from safevocab.backends import resolve_backend
    import_error = "triton_import_error"
except ImportError:
    from safevocab.kernels import resolve_backend
    import_error = "_triton_import_error"
messages = []
def attempt(call):
    try:
        messages.append(repr(call()))
    except Exception as err:
        messages.append(f"{type(err).__name__}: {err}")
h, w, y = torch.randn(2, 3), torch.randn(4, 3), torch.zeros(2, dtype=torch.long)
for backend in ("bogus", None, ["torch"]):
    attempt(lambda: fused_safe_logprobs(h, w, y, "none", backend=backend))
attempt(lambda: fused_safe_logprobs(h, w, y, "bogus_rule=1", backend="bogus"))
for backend in ("auto", "torch", "triton"):
    for device in ("cpu", "cuda", "meta"):
        attempt(lambda: resolve_backend(backend, torch.device(device)))
os.environ["TRITON_INTERPRET"] = "0"
attempt(lambda: fused_safe_logprobs(h, w, y, "none", backend="triton"))
attempt(lambda: fused_safe_logprobs(h, w, y, "bogus_rule=1", backend="triton"))
os.environ["TRITON_INTERPRET"] = "1"
setattr(probes, import_error, lambda: "ImportError: no triton")
attempt(lambda: fused_safe_logprobs(h, w, y, "none", backend="triton"))
attempt(lambda: resolve_backend("auto", torch.device("cuda")))
results["messages"] = messages
torch.save(results, sys.argv[1])
"""


def outputs(tree: str, path: str) -> dict:
    import torch

    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    proc = subprocess.run([sys.executable, "-c", RUN, path], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return torch.load(path, weights_only=False)


def same(x, y) -> bool:
    import torch

    if x is None or y is None:
        return x is None and y is None
    return (
        x.dtype == y.dtype
        and x.shape == y.shape
        and bool(
            torch.equal(x, y) or (torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()))
        )
    )


def main() -> None:
    old_tree, new_tree = sys.argv[1:3]
    with tempfile.TemporaryDirectory() as tmp:
        old = outputs(old_tree, os.path.join(tmp, "old.pt"))
        new = outputs(new_tree, os.path.join(tmp, "new.pt"))
    assert old.keys() == new.keys(), sorted(map(str, set(old) ^ set(new)))
    old_messages, new_messages = old.pop("messages"), new.pop("messages")
    messages_differ = old_messages != new_messages
    compared = differ = 0
    for key in old:
        for x, y in zip(old[key], new[key], strict=True):
            compared += 1
            if not same(x, y):
                differ += 1
                print("differs:", key)
    print(
        f"{compared} tensors compared, {differ} differ; backend-selection messages "
        f"{'DIFFER' if messages_differ else 'identical'} ({len(new_messages)} outcomes)"
    )
    sys.exit(1 if differ or messages_differ else 0)


if __name__ == "__main__":
    main()
