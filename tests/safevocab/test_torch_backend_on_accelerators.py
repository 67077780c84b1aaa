"""The torch backend on an accelerator: launch-sized row blocks, and tensor-core gradient GEMMs for bf16 inputs.

On an H200 at N = 8192, V = 151936, H = 4096 (docs/performance.md, "Second GPU run") the torch backend took 0.82 s,
14x trl's kernel: CPU-cache-sized row blocks (6 rows) launched ~1400 blocks of kernels, and the fp32 logits gradient
made ``grad.T @ h`` an fp32 SIMT GEMM (198 ms). Row blocks must change no value or gradient; the GEMM operand is
rounded to bf16 as the Triton backend's is (the GPU fuzz in tests/safevocab/test_reference_fuzz.py holds it to the reference).
"""

from __future__ import annotations

import pytest
import torch
from safevocab_reference import reference

from safevocab import SafeSupport, fused_safe_logprobs, parse_rule
from safevocab.backends import torch_backend
from safevocab.backends.torch_backend import ROW_BLOCK_BYTES, ROW_BLOCK_BYTES_ACCELERATOR, row_blocks
from safevocab.fused.grads import accumulate_chunk_grads, gemm_operand_dtype


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_blocks_stay_cache_sized(device):
    blocks = row_blocks(4096, 151936, device=device)
    assert blocks[0].stop == ROW_BLOCK_BYTES // (151936 * 4) == 6


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda", 0), "xpu"])
def test_accelerator_blocks_are_launch_sized(device):
    blocks = row_blocks(8192, 151936, device=device)
    assert blocks[0].stop == ROW_BLOCK_BYTES_ACCELERATOR // (151936 * 4) == 110
    assert len(blocks) == 75  # was 1366 kernel-launching blocks per 8192 rows
    assert [b.start for b in blocks] == list(range(0, 8192, 110)) and blocks[-1].stop == 8192


@pytest.mark.parametrize("rule", ["none", "min_p=0.05", "top_k=7", "top_p=0.8", "replay"])
def test_block_size_changes_no_value_or_gradient(rule, monkeypatch):
    torch.manual_seed(0)
    n, h, v = 37, 16, 101
    hidden = torch.randn(n, h, dtype=torch.float64)
    weight = torch.randn(v, h, dtype=torch.float64)
    targets = torch.randint(0, v, (n,))
    support, ids, parts = None, None, []
    if rule == "replay":
        ids = [sorted({int(t)} | set(torch.randperm(v)[:9].tolist())) for t in targets]
        support, rule = SafeSupport.from_lists(ids), None
    else:
        keep = parse_rule(rule).keep_mask(hidden @ weight.t())
        targets = torch.multinomial(keep.double(), 1).squeeze(-1)  # targets inside the kept set
        parts = [] if rule == "none" else [(rule.split("=")[0], float(rule.split("=")[1]))]

    def run(block_bytes: int):
        monkeypatch.setattr(torch_backend, "ROW_BLOCK_BYTES", block_bytes)
        hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fused_safe_logprobs(
            hid, w, targets, rule, support=support, compute_entropy=True, backend="torch", max_chunk_bytes=13 * v * 8
        )
        (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
        return out.logprobs.detach(), out.entropy.detach(), hid.grad, w.grad

    one_row, whole_chunk = run(v * 8), run(2**30)
    assert len(row_blocks(13, v, elem_bytes=8)) == 1  # the big size really is one block per chunk
    for a, b in zip(one_row, whole_chunk):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    ref = reference(hidden @ weight.t(), targets, parts, support=ids)  # the independent float64 reference
    torch.testing.assert_close(one_row[0], ref.logprobs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(one_row[1], ref.entropy, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "grad_dtype, input_dtype, device, want",
    [
        (torch.float32, torch.bfloat16, "meta", torch.bfloat16),  # an accelerator: tensor-core GEMMs, as Triton's
        (torch.float32, torch.bfloat16, "cpu", torch.float32),  # the CPU keeps the fp32 gradient
        (torch.float32, torch.float16, "meta", torch.float32),  # fp16's range: a tiny temperature's gradient overflows
        (torch.float32, torch.float32, "meta", torch.float32),
        (torch.bfloat16, torch.bfloat16, "meta", torch.bfloat16),  # the Triton backend's gradient: already bf16
    ],
)
def test_gradient_gemm_operand_dtype(grad_dtype, input_dtype, device, want):
    grad = torch.empty(3, 5, dtype=grad_dtype, device=device)
    h = torch.empty(3, 2, dtype=input_dtype, device=device)
    assert gemm_operand_dtype(grad, h) == want


def test_accumulated_weight_gradient_takes_bf16_operands_into_fp32_on_an_accelerator(monkeypatch):
    """On a non-CPU device the fp32 logits gradient enters the weight GEMM as bf16, accumulated in fp32."""
    from safevocab.fused import grads as grads_module

    seen = []
    monkeypatch.setattr(grads_module, "addmm_fp32", lambda acc, a, b: seen.append((acc.dtype, a.dtype, b.dtype)))
    grad = torch.empty(4, 7, device="meta")
    h, weight = (
        torch.empty(4, 3, dtype=torch.bfloat16, device="meta"),
        torch.empty(7, 3, dtype=torch.bfloat16, device="meta"),
    )
    grads = (torch.zeros(4, 3, dtype=torch.bfloat16, device="meta"), torch.zeros(7, 3, device="meta"), None)
    accumulate_chunk_grads(grad, h, weight, slice(0, 4), grads)
    assert seen == [(torch.float32, torch.bfloat16, torch.bfloat16)]
