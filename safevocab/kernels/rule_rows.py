"""The rows the selection kernels leave to the rule's own torch code, and how they get there.

:func:`~safevocab.kernels.threshold_select.select_thresholds` decides most rows' thresholds in its kernels; a row
whose ``top_p`` or ``min_prob`` decision lies within ``MASS_MARGIN`` of a boundary (or whose maximum or total is not
finite) is flagged on the device and decided here, by ``rule.threshold_of`` on the row's logits transformed in fp32 by
the fold kernels' own transform (:func:`transformed_rows`), so the set is the rule's:

- :func:`decide_read`: the flagged rows read from the device (one read), decided in batches near the chunk's size;
- :func:`decide_in_batch`: no read. Always ``B = ceil(n / BATCH_DIVISOR)`` rows: the first ``B`` flagged ones, their
  indices from ``torch.nonzero_static`` (padding decides a scratch row, written to a scratch slot ``n``), decided with
  fixed shapes (:class:`~safevocab.shifted_logits.ShiftedLogits` ``sync_free``: ``top_p`` sorts those rows instead of
  its radix select). The flagged rows past ``B`` are set in ``undecided`` for the caller to
  decide again (the Triton forward folds the chunk again with :func:`decide_read`), and so are the batch's rows whose
  sorted ``top_p`` crossing lies within float64 summation-order rounding of its target (``ShiftedLogits.near``: the
  read path's radix select sums in another order).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from safevocab.kernels.common import transform, transform_flags
from safevocab.rules import SafeVocabRule
from safevocab.shifted_logits import ShiftedLogits

__all__ = ["BATCH_DIVISOR", "decide_in_batch", "decide_read", "transformed_rows"]

#: The bounded batch (:func:`decide_in_batch`) decides ``ceil(rows / BATCH_DIVISOR)`` rows a chunk: LM-like bf16
#: chunks leave 0-1.2 % of their rows to the rule's code (docs/performance.md, "Host synchronisation"), a sixty-fourth
#: covers them; flat fp32 rows near ``q = 1`` (up to all of them) overflow it.
BATCH_DIVISOR = 64
#: Column block of :func:`transformed_rows` (at most).
_BLOCK = 2048


@triton.jit
def _transform_rows_kernel(
    z_ptr,
    z_stride,
    rows_ptr,
    out_ptr,
    n_cols,
    scale,
    softcap,
    temperature,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    src = z_ptr + tl.load(rows_ptr + i).to(tl.int64) * z_stride
    dst = out_ptr + i * n_cols
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        z = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        z = transform(z, scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
        tl.store(dst + offs, z, mask=mask)


def transformed_rows(
    z: torch.Tensor, rows: torch.Tensor, scale: float = 1.0, softcap: float | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """The rows ``rows`` of the raw chunk ``z`` ``[n, V]`` transformed in fp32 by the fold kernels' own transform:
    ``[len(rows), V]`` (the fallback's input, and the tests' reference logits)."""
    n_rows, n_cols = rows.numel(), z.shape[1]
    out = torch.empty(n_rows, n_cols, device=z.device, dtype=torch.float32)
    if n_rows:
        _transform_rows_kernel[(n_rows,)](
            z,
            z.stride(0),
            rows.to(torch.int64).contiguous(),
            out,
            n_cols,
            float(scale),
            float(softcap) if softcap is not None else 1.0,
            float(temperature),
            **transform_flags(scale, softcap, temperature),
            BLOCK=min(triton.next_power_of_2(n_cols), _BLOCK),
        )
    return out


def decide_read(
    z: torch.Tensor,
    rule: SafeVocabRule,
    flags: torch.Tensor,
    threshold: torch.Tensor,
    row_max: torch.Tensor,
    scale: float,
    softcap: float | None,
    temperature: float,
) -> torch.Tensor:
    """Read which rows of the raw chunk ``z`` ``[n, V]`` ``flags`` marks and write their ``threshold`` and ``row_max``
    (``[n]``) from the rule's torch code; returns their indices."""
    n = z.shape[0]
    # host sync: the chunk's one read, its fallback rows (the rule's torch code runs on those rows only, and they must
    # be known before the fold reads the thresholds; the chunk's logits are gone after it)
    rows = flags.nonzero().squeeze(-1)
    # fallback rows in batches whose fp32 copy and the rule's scratch (~16 B a logit) stay near the raw chunk's size,
    # which is all the chunk sizing (triton_chunk_rows) budgets for
    for part in rows.split(max(1, n * z.element_size() // 16)) if rows.numel() else ():
        exact = transformed_rows(z, part, scale, softcap, temperature)
        t_part, m_part = rule.threshold_and_max(exact)
        threshold.index_copy_(0, part, t_part.squeeze(-1))
        row_max.index_copy_(0, part, m_part.squeeze(-1))
        del exact
    return rows


def decide_in_batch(
    z: torch.Tensor,
    rule: SafeVocabRule,
    flags: torch.Tensor,
    threshold: torch.Tensor,
    row_max: torch.Tensor,
    undecided: torch.Tensor,
    scale: float,
    softcap: float | None,
    temperature: float,
) -> None:
    """The rule's torch code on the first ``ceil(n / BATCH_DIVISOR)`` rows ``flags`` marks, always that many (padding
    decides a scratch row), with no read of the device: their indices from ``torch.nonzero_static``, their fp32 rows
    transformed in the kernel (:func:`transformed_rows`), the rule's thresholds with fixed shapes
    (:class:`~safevocab.shifted_logits.ShiftedLogits` ``sync_free``: ``top_p`` sorts the rows), written through a
    scratch slot (row ``n``) that takes the padding. The flagged rows past the batch are set in ``undecided``, and the
    batch's rows the sort decides within rounding of a boundary (``ShiftedLogits.near``: their threshold stays the
    sort's, which the read path may not give).

    Memory, by count: ``B x V`` fp32 rows and the sort's scratch (about 40 bytes a logit of the batch), about 0.6
    bytes a logit of the chunk, within what the read's batches (up to the chunk's own size) were allowed."""
    n = z.shape[0]
    size = math.ceil(n / BATCH_DIVISOR)
    rows = torch.nonzero_static(flags, size=size, fill_value=n).squeeze(-1)
    undecided.copy_(flags & (flags.cumsum(0) > size))  # nonzero_static takes the first flagged rows, in order
    exact = transformed_rows(z, rows.clamp_max(n - 1), scale, softcap, temperature)
    z_max = exact.amax(-1, keepdim=True)
    shifted = ShiftedLogits(exact, z_max, sync_free=True)
    t = rule.threshold_of(shifted)
    for out, value in ((threshold, t), (row_max, z_max)):
        out.copy_(torch.cat([out, out.new_zeros(1)]).index_copy_(0, rows, value.squeeze(-1))[:n])
    if shifted.near is not None:  # the sort's crossing within rounding of q T: the read path's radix select decides
        near = torch.zeros(n + 1, dtype=torch.bool, device=z.device).index_copy_(0, rows, shifted.near.reshape(-1))
        undecided |= near[:n]
