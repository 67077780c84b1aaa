"""Two small Triton kernels for tests/safevocab/test_offline_compile.py (import after ``TRITON_INTERPRET=1``):
:func:`row_sums` compiles for a GPU; :func:`plus_one` runs under the interpreter but no GPU compiler takes it (its
helper lacks ``@triton.jit``: the interpreter runs it as Python, the compiler refuses to call it)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _halve(x):
    return x * 0.5


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, tl.cdiv(n_cols, BLOCK) * BLOCK, BLOCK):  # tl.cdiv: a @triton.jit function of Triton's
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, _halve(tl.sum(acc, axis=0)) * 2.0)


def row_sums(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.float32)
    _row_sums_kernel[(x.shape[0],)](x, out, x.shape[1], BLOCK=block)
    return out


def _add_one(x):  # no @triton.jit: the bug this fixture stands for
    return x + 1.0


@triton.jit
def _plus_one_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + cols, _add_one(tl.load(x_ptr + cols)))


def plus_one(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _plus_one_kernel[(1,)](x, out, BLOCK=x.numel())
    return out
