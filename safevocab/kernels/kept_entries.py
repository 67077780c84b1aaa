"""Kept entries: a chunk's logits at chosen places, transformed exactly as the forward kernel transforms them.

The sparse backward (:mod:`safevocab.kernels.sparse_backward`) needs ``S``'s entries (column, ``z - m``) with ``z``
the transformed logit the forward compared with ``t``. When the forward kernel transformed a half-precision GEMM
output itself, nothing holds those fp32 values; the kernels here recompute them from the GEMM output with the same
helper (:func:`safevocab.kernels.common.transform`, the same fp32 operations in the same order):

- :func:`compact_kept`: one program per row walks its columns, keeps ``z >= t`` and writes the kept entries
  compacted, in column order, at the row's CSR offset (``tl.cumsum`` of the keep mask gives each entry's place). Its
  count is checked against the forward's ``|S|``: a mismatch (a compiler that rounded the transform differently)
  returns ``None`` and the chunk takes the dense backward.
- :func:`gather_logits`: the transformed logits at given ``(row, column)`` pairs (replayed supports, targets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from safevocab.kernels import interpreter_on
from safevocab.kernels.common import transform

#: Whether these kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = interpreter_on()
#: Columns per step of a row (tests lower it to exercise the column loop).
MAX_BLOCK = 2048
#: Entries per program of :func:`gather_logits`.
GATHER_BLOCK = 1024


@triton.jit
def _compact_kept_kernel(
    z_ptr,
    z_stride,
    threshold_ptr,
    row_max_ptr,
    offsets_ptr,  # [n + 1] int64: each row's place in the outputs (from the forward's |S|)
    cols_out_ptr,
    shifted_out_ptr,
    count_out_ptr,
    n_cols,
    scale,
    softcap,
    temperature,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    acc = shifted_out_ptr.dtype.element_ty
    t = tl.load(threshold_ptr + row)
    m = tl.load(row_max_ptr + row)
    base = tl.load(offsets_ptr + row)
    room = tl.load(offsets_ptr + row + 1) - base
    count = tl.full((), 0, tl.int64)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        z = tl.load(z_ptr + row * z_stride + offs, mask=mask, other=0.0).to(acc)
        z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
        kept = mask & (z >= t)
        place = count + tl.cumsum(kept.to(tl.int64), axis=0) - 1
        write = kept & (place < room)  # never past the row's room, whatever the count
        tl.store(cols_out_ptr + base + place, offs.to(tl.int32), mask=write)
        tl.store(shifted_out_ptr + base + place, z - m, mask=write)
        count += tl.sum(kept.to(tl.int64), axis=0)
    tl.store(count_out_ptr + row, count)


@triton.jit
def _gather_logits_kernel(
    z_ptr,
    z_stride,
    rows_ptr,
    cols_ptr,
    out_ptr,
    n,
    scale,
    softcap,
    temperature,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = e < n
    row = tl.load(rows_ptr + e, mask=mask, other=0)
    col = tl.load(cols_ptr + e, mask=mask, other=0)
    z = tl.load(z_ptr + row * z_stride + col, mask=mask, other=0.0).to(out_ptr.dtype.element_ty)
    z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
    tl.store(out_ptr + e, z, mask=mask)


def _transform_args(scale: float, softcap: float | None, temperature: float, apply: bool) -> tuple[tuple, dict]:
    scalars = (float(scale), float(softcap) if softcap is not None else 1.0, float(temperature))
    flags = dict(
        HAS_SCALE=apply and scale != 1.0,
        HAS_SOFTCAP=apply and softcap is not None,
        HAS_TEMPERATURE=apply and temperature != 1.0,
    )
    return scalars, flags


def compact_kept(
    z: torch.Tensor,
    threshold: torch.Tensor,
    row_max: torch.Tensor,
    safe_size: torch.Tensor,
    scale: float,
    softcap: float | None,
    temperature: float,
    apply_transform: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``S = {z >= t}``'s entries of the chunk ``z`` ``[n, V]`` as CSR values: ``(cols int32, z - m)``, row after
    row, columns ascending; ``None`` when a row's count differs from the forward's ``safe_size``.

    Args:
        z: the GEMM output (``apply_transform``: transformed here as the forward kernel did) or transformed logits.
        threshold, row_max, safe_size: ``[n]`` the forward's ``t``, ``m`` (stats dtype) and ``|S|``.
    """
    n, n_cols = z.shape
    assert z.stride(1) == 1, "the chunk must be row-contiguous"
    offsets = torch.zeros(n + 1, device=z.device, dtype=torch.int64)
    torch.cumsum(safe_size, 0, out=offsets[1:])
    nnz = int(offsets[-1])
    cols = torch.empty(nnz, device=z.device, dtype=torch.int32)
    shifted = torch.empty(nnz, device=z.device, dtype=row_max.dtype)
    counts = torch.empty(n, device=z.device, dtype=torch.int64)
    if n == 0:
        return cols, shifted
    scalars, flags = _transform_args(scale, softcap, temperature, apply_transform)
    block = min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK)
    _compact_kept_kernel[(n,)](
        z,
        z.stride(0),
        threshold,
        row_max,
        offsets,
        cols,
        shifted,
        counts,
        n_cols,
        *scalars,
        **flags,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    if not torch.equal(counts, safe_size.to(torch.int64)):
        return None
    return cols, shifted


def gather_logits(
    z: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    dtype: torch.dtype,
    scale: float,
    softcap: float | None,
    temperature: float,
    apply_transform: bool,
) -> torch.Tensor:
    """``[k]`` the logits ``z[rows, cols]`` in ``dtype`` (the stats dtype), transformed here as the forward kernel
    transforms them when ``apply_transform`` (``z`` the GEMM output), else as they are."""
    out = torch.empty(rows.numel(), device=z.device, dtype=dtype)
    if rows.numel() == 0:
        return out
    assert z.stride(1) == 1, "the chunk must be row-contiguous"
    scalars, flags = _transform_args(scale, softcap, temperature, apply_transform)
    _gather_logits_kernel[(triton.cdiv(rows.numel(), GATHER_BLOCK),)](
        z,
        z.stride(0),
        rows.to(torch.int64).contiguous(),
        cols.to(torch.int64).contiguous(),
        out,
        rows.numel(),
        *scalars,
        **flags,
        BLOCK=GATHER_BLOCK,
    )
    return out
