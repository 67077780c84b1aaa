"""Kept entries: ``S``'s entries ``(column, z - m)`` of a chunk, for the sparse backward.

The sparse backward (:mod:`safevocab.kernels.sparse_backward`) needs ``S``'s entries (column, ``z - m``) with ``z``
the transformed logit the forward compared with ``t``, as CSR: row after row, columns ascending.

- :class:`KeptPool` and :func:`pack_kept` (the forward's way): the fold's last pass
  (:func:`safevocab.kernels.forward_fold.forward_fold` with ``kept_capacity``) appends each column block's kept
  entries ``(column, z)`` to a bounded pool, at a place it reserves with one atomic add on an int32 counter (a block
  that keeps nothing reserves and writes nothing), and records the block's place and count in a ``[rows, blocks]``
  table; :func:`pack_kept` then copies them into CSR order, subtracting ``m``: work in the kept entries only, no second
  read of ``[rows, V]``. The values are the fold's own (the very ``z`` it compared with ``t``, in the statistics dtype),
  so the entries and ``|S|`` cannot disagree; the pool's order (the atomics') never reaches the result.
- :func:`compact_kept` (the fallback, and the reference in the tests): one program per row walks the chunk's columns
  again, keeps ``z >= t`` (the GEMM output transformed with the forward's helper,
  :func:`safevocab.kernels.common.transform`: the same fp32 operations in the same order) and writes the kept entries
  compacted at the row's CSR offset (``tl.cumsum`` of the keep mask gives each entry's place). Its count is checked
  against the forward's ``|S|``: a mismatch (a compiler that rounded the transform differently) returns ``None``.
  The forward uses it only where the pool was too small (counted and logged by its caller).
- :func:`gather_logits`: the transformed logits at given ``(row, column)`` pairs (replayed supports, targets).
"""

from __future__ import annotations

from dataclasses import dataclass

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
#: Column blocks (entries of the pool's table) per program of :func:`pack_kept`, and entries of each copied a step.
PACK_SLOTS, PACK_BLOCK = 32, 64
#: Most entries a :class:`KeptPool` holds, as a fraction of its chunk's logits, whatever the gate allows: at 8 bytes an
#: entry, a quarter of a bf16 chunk's own size. It binds only where the gate is raised above it (tests, a sweep that
#: forces the sparse backward); a chunk whose kept entries overflow it is compacted again by :func:`compact_kept`.
POOL_MAX_DENSITY = 1.0 / 16


@dataclass
class KeptPool:
    """Where the fold's last pass writes a chunk's kept entries, in column blocks (module docstring).

    Attributes:
        cols: ``[capacity]`` int32 columns of the kept entries, block after block in the order the blocks reserved
            their places.
        values: ``[capacity]`` the kept logits ``z`` (transformed, the statistics dtype), beside ``cols``.
        counter: ``[1]`` int32 (int64 for chunks of ``2^31`` logits or more): entries reserved so far; past
            ``capacity`` exactly when the kept entries overflow the pool (then not exact: a program stops reserving
            after its first overflow, and the entries past ``capacity`` are not written).
        block_start, block_count: ``[rows, blocks]`` each block's first place in the pool (the counter's dtype) and
            its number of kept entries (int32; 0: nothing written, ``block_start`` then meaningless).
        block: the fold's column block (columns per entry of the table).
    """

    cols: torch.Tensor
    values: torch.Tensor
    counter: torch.Tensor
    block_start: torch.Tensor
    block_count: torch.Tensor
    block: int

    @classmethod
    def empty(cls, n: int, n_cols: int, block: int, capacity: int, dtype: torch.dtype, device) -> KeptPool:
        """A pool of ``capacity`` entries (values in ``dtype``) for ``n`` rows of ``n_cols`` columns folded ``block``
        columns at a time; the counter at 0."""
        index = torch.int32 if n * n_cols < 2**31 else torch.int64
        blocks = triton.cdiv(max(n_cols, 1), block)
        return cls(
            cols=torch.empty(capacity, device=device, dtype=torch.int32),
            values=torch.empty(capacity, device=device, dtype=dtype),
            counter=torch.zeros(1, device=device, dtype=index),
            block_start=torch.empty(n, blocks, device=device, dtype=index),
            block_count=torch.empty(n, blocks, device=device, dtype=torch.int32),
            block=block,
        )

    @property
    def capacity(self) -> int:
        return self.cols.numel()

    def row_counts(self) -> torch.Tensor:
        """``[rows]`` int64: each row's kept entries, as the fold counted them (written or not, exact)."""
        return self.block_count.sum(1, dtype=torch.int64)


@triton.jit
def append_kept(kept, offs, z, slot, full, cols_ptr, values_ptr, counter_ptr, start_ptr, count_ptr, capacity):
    """One column block of the fold's last pass: append the kept ``(offs, z)`` to the pool and record the block's
    place and count at ``slot`` of the table; returns ``full``, updated: whether this program has seen the pool
    overflow.

    A block that keeps nothing touches neither the counter nor the pool. Once a program has seen an overflow it
    reserves no more places (the chunk cannot be stored from this pool: a dense chunk, ``none``, costs one atomic add a
    program, not one a block) and the counter, already past ``capacity``, stays past it; the table's counts stay
    exact."""
    keep = kept.to(tl.int32)
    n = tl.sum(keep, axis=0)
    start = tl.zeros((), counter_ptr.dtype.element_ty)
    if (n > 0) & (full == 0):
        start = tl.atomic_add(counter_ptr, n.to(counter_ptr.dtype.element_ty))
        if start < capacity:
            place = start + tl.cumsum(keep, axis=0) - 1  # int32 scan inside the block, in column order
            write = kept & (place < capacity)  # never past the pool, whatever the count
            tl.store(cols_ptr + place, offs.to(tl.int32), mask=write)
            tl.store(values_ptr + place, z.to(values_ptr.dtype.element_ty), mask=write)
    tl.store(start_ptr + slot, start)
    tl.store(count_ptr + slot, n)
    return full | ((n > 0) & (start + n > capacity)).to(tl.int32)


@triton.jit
def _pack_kept_kernel(
    cols_ptr,
    values_ptr,
    start_ptr,
    count_ptr,
    dest_ptr,  # [rows * blocks] int64: each block's place in the CSR outputs (exclusive scan of the counts)
    row_max_ptr,
    cols_out_ptr,
    shifted_out_ptr,
    n_slots,
    n_blocks,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``SLOTS`` entries of the ``[rows, blocks]`` table per program, ``[SLOTS, BLOCK]`` entries a step: each column
    block's entries copied from the pool to their CSR place, ``z - m`` formed on the way."""
    slot = tl.program_id(0).to(tl.int64) * SLOTS + tl.arange(0, SLOTS)
    live = slot < n_slots
    n = tl.load(count_ptr + slot, mask=live, other=0)
    src = tl.load(start_ptr + slot, mask=live & (n > 0), other=0).to(tl.int64)
    dst = tl.load(dest_ptr + slot, mask=live & (n > 0), other=0)
    m = tl.load(row_max_ptr + slot // n_blocks, mask=live & (n > 0), other=0.0)
    for e in range(0, tl.max(n, axis=0), BLOCK):  # blocks that kept nothing cost nothing past these loads
        o = e + tl.arange(0, BLOCK)
        mask = o[None, :] < n[:, None]
        c = tl.load(cols_ptr + src[:, None] + o[None, :], mask=mask)
        z = tl.load(values_ptr + src[:, None] + o[None, :], mask=mask)
        tl.store(cols_out_ptr + dst[:, None] + o[None, :], c, mask=mask)
        tl.store(shifted_out_ptr + dst[:, None] + o[None, :], z - m[:, None], mask=mask)


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


def pack_kept(pool: KeptPool, row_max: torch.Tensor, nnz: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pool's entries as CSR values: ``(counts int64 [n], cols int32 [nnz], z - m [nnz])``, row after row, columns
    ascending: what :func:`compact_kept` gives, bit for bit (the same ``z`` in the statistics dtype, the same ``z - m``).

    Args:
        pool: filled by the fold's last pass, without overflow (``nnz <= pool.capacity``).
        row_max: ``[n]`` the fold's ``m``.
        nnz: the pool's counter (the caller has read it: it sizes the outputs).
    """
    assert nnz <= pool.capacity, "the pool overflowed: compact the chunk again (compact_kept)"
    n, n_blocks = pool.block_count.shape
    counts = pool.block_count.flatten().to(torch.int64)
    dest = torch.cumsum(counts, 0) - counts
    cols = torch.empty(nnz, device=row_max.device, dtype=torch.int32)
    shifted = torch.empty(nnz, device=row_max.device, dtype=row_max.dtype)
    if n and nnz:
        _pack_kept_kernel[(triton.cdiv(n * n_blocks, PACK_SLOTS),)](
            pool.cols,
            pool.values,
            pool.block_start,
            pool.block_count,
            dest,
            row_max,
            cols,
            shifted,
            n * n_blocks,
            n_blocks,
            SLOTS=PACK_SLOTS,
            BLOCK=PACK_BLOCK,
        )
    return counts.view(n, n_blocks).sum(1), cols, shifted


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
