"""Backward fold: a recomputed ``[rows, V]`` logits chunk -> the logits gradient, written in place.

Per row, with the forward's threshold ``t``, row maximum ``m``, ``log sum_S exp(z - m)``,
``log sum_V exp(z - m)``, entropy ``H`` and the per-row coefficients of
:class:`safevocab.fused.coefficients.Coefficients` (``c_S = g_lp 1[y in S] - g_k``,
``c_F = g_lp 1[y not in S] + g_k``)::

    grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi

with ``log pi_S = (z - m) - log sum_S exp(z - m)`` (max-shifted, as the forward),
then the transform's chain rule: times the softcap derivative ``1 - tanh^2`` (``tanh`` recovered from
``z`` as ``z * temperature / softcap``, ``tanh^2`` clamped to 1 so ``-inf`` logits get 0) and ``logit_scale / temperature``. The same operations in the
same order as ``safevocab.backends.torch_backend.dense_backward``, in fp32 (fp64 for fp64 inputs), for bf16/fp16/fp32
chunks. Grid ``(rows, column blocks)``: every program reads and writes its own block only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from safevocab.kernels import interpreter_on
from safevocab.kernels.common import transform

#: Whether these kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = interpreter_on()
#: Columns per program (tests lower it to exercise several blocks per row).
MAX_BLOCK = 2048


@triton.jit
def _backward_fold_kernel(
    z_ptr,
    z_stride,
    out_ptr,
    out_stride,
    targets_ptr,
    threshold_ptr,
    row_max_ptr,
    log_sum_safe_ptr,
    log_sum_full_ptr,
    c_safe_ptr,
    c_full_ptr,
    g_lp_ptr,
    g_ent_ptr,
    entropy_ptr,
    n_cols,
    scale,
    softcap,
    temperature,
    tanh_of_z,  # temperature / softcap: tanh = z * tanh_of_z
    grad_scale,  # logit_scale / temperature / grad_shift
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    SOFTCAP_GRAD: tl.constexpr,
    SCALE_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    acc = log_sum_safe_ptr.dtype.element_ty  # fp32, or fp64 for fp64 inputs

    z = tl.load(z_ptr + row * z_stride + offs, mask=mask, other=0.0).to(acc)
    z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
    dropped = z < tl.load(threshold_ptr + row)
    z_shift = z - tl.load(row_max_ptr + row)
    log_p = tl.where(dropped, 0.0, z_shift - tl.load(log_sum_safe_ptr + row))  # log pi_S on S; 0 off S (no -inf * 0)
    c_safe = tl.load(c_safe_ptr + row)
    p_safe = tl.where(dropped, 0.0, tl.exp(log_p))
    if HAS_ENTROPY_GRAD:
        per_logit = (log_p + tl.load(entropy_ptr + row)) * tl.load(g_ent_ptr + row) + c_safe
        per_logit = tl.where(dropped, 0.0, per_logit)
        grad = -(p_safe * per_logit)
    else:
        grad = p_safe * (-c_safe)
    c_full = tl.load(c_full_ptr + row)
    if c_full != 0:
        grad = grad - tl.exp(z_shift - tl.load(log_sum_full_ptr + row)) * c_full
    grad = grad + tl.where(offs == tl.load(targets_ptr + row), tl.load(g_lp_ptr + row), 0.0)
    if SOFTCAP_GRAD:
        tanh_z = z * tl.cast(tanh_of_z, acc)
        grad = grad * (1.0 - tl.minimum(tanh_z * tanh_z, 1.0))
    if SCALE_GRAD:
        grad = grad * tl.cast(grad_scale, acc)
    tl.store(out_ptr + row * out_stride + offs, grad.to(out_ptr.dtype.element_ty), mask=mask)


def backward_fold(
    z: torch.Tensor,
    out: torch.Tensor,
    targets: torch.Tensor,
    threshold: torch.Tensor,
    row_max: torch.Tensor,
    log_sum_safe: torch.Tensor,
    log_sum_full: torch.Tensor,
    c_safe: torch.Tensor,
    c_full: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    entropy: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    logit_scale: float,
    transform_in_kernel: bool,
    grad_shift: float = 1.0,
) -> None:
    """Write the logits gradient of the chunk ``z`` ``[n, V]`` into ``out`` (may be ``z`` itself).

    Args:
        z: raw GEMM output in the inputs' dtype (``transform_in_kernel``), or logits already transformed
            in torch (fp32/fp64), exactly as in the forward pass, so ``S = {z >= t}`` is rebuilt bit for bit.
        out: ``[n, V]`` gradient destination (the inputs' dtype).
        targets, threshold, row_max, log_sum_safe, log_sum_full, c_safe, c_full, g_lp: ``[n]`` per-row values
            (stats dtype).
        g_ent, entropy: ``[n]`` when the entropy has a gradient, else ``None``.
        temperature, softcap, logit_scale: the transform (its chain rule always runs here).
        transform_in_kernel: apply the transform to ``z`` in the kernel.
        grad_shift: write the logits gradient divided by this power of two (``Coefficients.grad_shift``: fp16
            inputs whose logits gradient would overflow fp16).
    """
    n, n_cols = z.shape
    if n == 0:
        return
    assert z.stride(1) == 1 and out.stride(1) == 1, "the chunks must be row-contiguous"
    block = min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK)
    has_ent = g_ent is not None
    grad_scale = logit_scale / temperature / grad_shift
    _backward_fold_kernel[(n, triton.cdiv(n_cols, block))](
        z,
        z.stride(0),
        out,
        out.stride(0),
        targets,
        threshold,
        row_max,
        log_sum_safe,
        log_sum_full,
        c_safe,
        c_full,
        g_lp,
        g_ent if has_ent else g_lp,  # unused without HAS_ENTROPY_GRAD
        entropy if has_ent else g_lp,
        n_cols,
        float(logit_scale),
        float(softcap) if softcap is not None else 1.0,
        float(temperature),
        float(temperature / softcap) if softcap is not None else 1.0,
        float(grad_scale),
        HAS_SCALE=transform_in_kernel and logit_scale != 1.0,
        HAS_SOFTCAP=transform_in_kernel and softcap is not None,
        HAS_TEMPERATURE=transform_in_kernel and temperature != 1.0,
        SOFTCAP_GRAD=softcap is not None,
        SCALE_GRAD=grad_scale != 1.0,
        HAS_ENTROPY_GRAD=has_ent,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
