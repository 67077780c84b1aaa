"""The top-p (nucleus) threshold without sorting the vocabulary: a radix select on the probabilities.

For one row of transformed logits ``z`` with ``e = exp(z - m)`` (``0`` for the tokens an earlier rule removed) and
``T = sum e``, top-p keeps the smallest highest-probability set of mass ``>= q``: token ``a`` is kept iff the mass
strictly above it (descending order) is ``< q T``, and every token tied with the last kept one is kept too. That set
is ``{z >= t}`` with::

    t = max { z_a : M(z_a) >= q T },    M(v) = sum_{b : z_b >= v} e_b

``M`` only matters near the crossing, so instead of sorting ``V`` logits per row (``O(V log V)``):

1. one pass adds, per row, the mass of ``e`` in each power-of-two bucket (the exponent bits of a non-negative float
   order it). The highest bucket ``[2^k, 2^(k+1))`` whose mass from the top reaches ``q T`` holds the crossing; the
   bucket sums are fp32, so ``k`` is taken with a margin of their worst-case rounding (``2 V`` ulps): only tokens
   with ``e >= 2^k`` stay candidates (the set itself plus a bucket: a few per cent of a 32k vocabulary for LM-like
   logits). They cover ``S``: the fused op takes ``S``'s entries from them instead of a pass over the vocabulary;
2. on the candidates, float64 histograms over the exponent, then 8 bits of mantissa at a time, narrow the crossing
   down to tokens that share one and the same ``e``, keeping the exact mass above them;
3. those few tokens, sorted by ``z``, give ``t``.

Small rows (at most :data:`SORT_MAX_VOCAB` logits) are sorted instead: ``M`` at each position of the descending
order is the float64 cumulative sum, and ``t`` is the ``z`` of the first position where it reaches ``q T``. The
histograms' fixed cost (256 bins a level in fp32, 2048 in fp64, over several levels) exceeds a sort of so few logits.
Both give the same ``t``; their float64 sums differ only in rounding order (~1e-16 relative, far inside the ~1e-9 to
which ``T`` itself is known).

Masses are float64 sums of the fp32 ``e``; ``T`` sums fp32 partial sums of 64 in float64 (~1e-9 relative), so
the set is decided by the mass to ~1e-9; HF's warper (sort, fp32 softmax, cumulative sum) decides it to ~1e-7. The two can differ only when the mass at
the boundary lies within fp32 rounding of ``q`` (one token more or less, at a boundary that exact arithmetic puts
within ~1e-7 of ``q``). Tokens with ``e = 0`` (``-inf`` logits, or removed by an earlier rule) have no mass and are
never candidates unless a row has nothing else.
"""

from __future__ import annotations

import torch

__all__ = ["SORT_MAX_VOCAB", "nucleus_threshold"]

#: Rows of at most this many logits take the sort (:func:`_sorted_threshold`) instead of the radix select.
SORT_MAX_VOCAB = 256


def _bit_layout(dtype: torch.dtype) -> tuple[torch.dtype, int, int, list[tuple[int, int]]]:
    """(integer view dtype, exponent shift, exponent bins, [(shift, bins) of the mantissa levels])."""
    if dtype == torch.float64:
        return torch.int64, 52, 2048, [(44, 256), (36, 256), (28, 256), (20, 256), (12, 256), (4, 256), (0, 16)]
    return torch.int32, 23, 256, [(15, 256), (7, 256), (0, 128)]


def row_sum64(x: torch.Tensor) -> torch.Tensor:
    """``[R, V] -> [R]`` float64 row sums: fp32 partial sums of 64 elements, added in float64."""
    if x.dtype == torch.float64:
        return x.sum(-1)
    n_rows, vocab = x.shape
    body = vocab - vocab % 64
    total = x[:, :body].reshape(n_rows, body // 64, 64).sum(-1).to(torch.float64).sum(-1)
    if body < vocab:
        total = total + x[:, body:].to(torch.float64).sum(-1)
    return total


def _crossing_bin(
    hist: torch.Tensor, above: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the highest bin whose mass from the top (plus ``above``) reaches ``target``; the mass above it; and
    whether such a bin exists (else the lowest non-empty bin: the row keeps all that is left)."""
    n_rows, bins = hist.shape
    suffix = torch.cat([hist.flip(-1).cumsum(-1).flip(-1), hist.new_zeros(n_rows, 1)], -1) + above.unsqueeze(-1)
    count = (suffix[:, :bins] >= target.unsqueeze(-1)).sum(-1)
    found = count > 0
    lowest_nonempty = torch.argmax((hist > 0).to(torch.uint8), -1)
    b = torch.where(found, count - 1, lowest_nonempty)
    return b, suffix.gather(-1, (b + 1).unsqueeze(-1)).squeeze(-1), found


def _sorted_threshold(
    z: torch.Tensor, e: torch.Tensor, target: torch.Tensor, sync_free: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | torch.Tensor]:
    """:func:`nucleus_threshold` by a sort: ``t`` is the ``z`` of the first position (``z`` descending) whose float64
    cumulative mass reaches ``target``; a row whose mass cannot reach it (rounding) keeps every token with mass, as the
    radix select does. ``e`` is ``0`` for tokens an earlier rule removed, which lie below the others (``e`` grows with
    ``z``): the tokens with mass are a prefix of the order. Returns the candidates, or (``sync_free``: fixed shapes, no
    read of the device) the rows :func:`_near_target` marks."""
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices
    e_sorted = e.gather(-1, order).to(torch.float64)
    cumulative = e_sorted.cumsum(-1)
    reached = cumulative >= target.unsqueeze(-1)
    with_mass = (e_sorted > 0).sum(-1)
    found = reached.any(-1)
    pick = torch.where(found, reached.to(torch.uint8).argmax(-1), (with_mass - 1).clamp_min(0))
    t = z.gather(-1, order.gather(-1, pick.unsqueeze(-1)))
    t = torch.where(with_mass.unsqueeze(-1) > 0, t, z.amax(-1, keepdim=True))
    if sync_free:
        return t, _near_target(cumulative, pick, found, target) & (with_mass > 0)
    return t, (z >= t).nonzero(as_tuple=True)  # host sync: the candidates' count


def _near_target(
    cumulative: torch.Tensor, pick: torch.Tensor, found: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """``[R]`` bool: rows whose decision another order of the same float64 sums could change. A sum of ``V``
    non-negative terms is off its exact value by at most ``V 2^-53`` of it in any order, so two orders differ by less
    than ``V 2^-52 T``; a row is marked where the mass just before its crossing (``0`` at the first position), the mass
    at it, or the whole mass of a row that does not reach ``target``, lies within ``V 2^-51 T`` of ``target`` (twice
    that bound). The radix select sums the same terms in another order: those rows are the only ones where the sort
    and it may disagree (about 3e-11 of the mass for ``V = 151936``)."""
    vocab = cumulative.shape[-1]
    slack = vocab * 2.0**-51 * cumulative[:, -1]
    at = cumulative.gather(-1, pick.unsqueeze(-1)).squeeze(-1)
    before = torch.where(pick > 0, cumulative.gather(-1, (pick - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0)
    crossing_near = ((at - target).abs() <= slack) | ((target - before).abs() <= slack)
    short_near = (target - cumulative[:, -1]).abs() <= slack
    return torch.where(found, crossing_near, short_near)


@torch.no_grad()
def nucleus_threshold(
    z: torch.Tensor, e: torch.Tensor, q: float, kept_from: torch.Tensor | None = None, sync_free: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | torch.Tensor]:
    """The top-p threshold ``t`` ``[R, 1]`` of each row (``S = {z >= t}``, see the module docstring) and the
    candidates ``(row, col)``: every entry with ``z >= t`` is among them.

    Args:
        z: ``[R, V]`` transformed logits (fp32, or fp64), each row with a finite maximum ``m``.
        e: ``[R, V]`` ``exp(z - m)`` in ``z``'s dtype (the forward computes it anyway).
        q: ``0 < q < 1``.
        kept_from: ``[R, 1]`` threshold of the rules applied before (the distribution is renormalised over
            ``{z >= kept_from}``), or ``None``.
        sync_free: sort every row, whatever its size: fixed shapes, so no read of the device (the radix select reads
            it to size its candidates); for the few rows of the Triton path's bounded fallback batch
            (:mod:`safevocab.kernels.rule_rows`). Returns, instead of the candidates, ``[R]`` bool flags of the rows
            whose crossing lies within float64 summation-order rounding of ``q T`` (:func:`_near_target`): the radix
            select gives the same ``t`` on every other row.
    """
    n_rows, vocab = z.shape
    if kept_from is not None:
        e = torch.where(z >= kept_from, e, 0.0)
    target = q * row_sum64(e)
    if vocab <= SORT_MAX_VOCAB or sync_free:
        return _sorted_threshold(z, e, target, sync_free)
    int_dtype, shift, bins, levels = _bit_layout(e.dtype)
    # 1. bucket masses over the exponent of e, in one index_add over the whole rows (flat bin index per entry; the
    # & drops the sign bit a NaN may carry, so every key names a bin: such a row raises later anyway)
    flat = torch.bitwise_right_shift(e.view(int_dtype), shift).bitwise_and_(bins - 1)
    flat += (torch.arange(n_rows, device=e.device, dtype=int_dtype) * bins).unsqueeze(-1)
    hist = torch.zeros(n_rows * bins, dtype=e.dtype, device=e.device).index_add_(0, flat.view(-1), e.reshape(-1))
    first, _, _ = _crossing_bin(hist.view(n_rows, bins).to(torch.float64), torch.zeros_like(target), target)
    offsets = torch.arange(n_rows, device=e.device) * bins
    # The fp32 bucket sums may round the crossing one bucket too high: rows whose candidates' exact (float64) mass
    # misses q T take one bucket more, then (a NaN row, say) all of them.
    for retry in range(3):
        row, col = (flat >= (first + offsets).to(int_dtype).unsqueeze(-1)).nonzero(as_tuple=True)
        at = row * vocab + col  # flat positions: index_select is several times faster than z[row, col]
        cand_e = e.reshape(-1).index_select(0, at)
        mass = torch.zeros_like(target).index_add_(0, row, cand_e.to(torch.float64))
        short = (mass < target) & (first > 0)
        if retry == 2 or not bool(short.any()):
            break
        first = torch.where(short, first - 1 if retry == 0 else torch.zeros_like(first), first)
    cover = (row, col)
    cand_z = z.reshape(-1).index_select(0, at)
    if kept_from is not None:
        cand_z = torch.where(cand_e > 0, cand_z, -torch.inf)  # removed by an earlier rule: never the threshold
    bits = cand_e.view(int_dtype).to(torch.int64)
    weight = cand_e.to(torch.float64)
    above = torch.zeros_like(target)
    found = torch.ones_like(target, dtype=torch.bool)
    # 2. narrow to the tokens sharing the crossing's exact e: exponent, then 8 bits of mantissa at a time (float64)
    for level_shift, level_bins in [(shift, bins), *levels]:
        key = torch.bitwise_right_shift(bits, level_shift).bitwise_and_(level_bins - 1)
        level = torch.zeros(n_rows * level_bins, dtype=torch.float64, device=z.device)
        level = level.index_add_(0, row * level_bins + key, weight).view(n_rows, level_bins)
        b, above_b, found_b = _crossing_bin(level, above, target)
        above, found = torch.where(found, above_b, above), found & found_b
        keep = (key == b.index_select(0, row)).nonzero().squeeze(-1)
        row, cand_z, weight, bits = (x.index_select(0, keep) for x in (row, cand_z, weight, bits))
    # 3. the tokens left, by z descending within each row; the first whose cumulative mass reaches the target
    order = torch.sort(cand_z, descending=True, stable=True).indices
    order = order[torch.sort(row[order], stable=True).indices]
    row, cand_z, weight = row[order], cand_z[order], weight[order]
    counts = torch.bincount(row, minlength=n_rows)
    ends = counts.cumsum(0)
    cumulative = weight.cumsum(0)
    if row.numel():
        starts = (ends - counts).clamp(max=row.numel() - 1)
        before_row = cumulative[starts] - weight[starts]
        reached = above[row] + (cumulative - before_row[row]) >= target[row]
        positions = torch.arange(row.numel(), device=z.device)
        hit = torch.full((n_rows,), row.numel(), device=z.device, dtype=torch.long)
        hit.scatter_reduce_(0, row, torch.where(reached & found[row], positions, row.numel()), "amin")
        # no crossing (a row whose candidates cannot reach q T by rounding): keep them all
        pick = torch.where(hit < row.numel(), hit, ends - 1).clamp(0, row.numel() - 1)
        t = torch.where(counts > 0, cand_z[pick], z.amax(-1))
    else:
        t = z.amax(-1)
    return t.unsqueeze(-1), cover
