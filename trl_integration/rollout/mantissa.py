"""Rounding floats to ``k`` mantissa bits: the precision of a low-precision engine, on float32 tensors.

A float32 ``x = (-1)^s · 1.m · 2^e`` has 23 explicit mantissa bits. :func:`round_mantissa` keeps the top ``k`` of
them and rounds the rest away, to nearest with ties to even (IEEE 754's default), on the float32 bit pattern:

    drop = 23 - k
    bits' = (bits + 2^(drop-1) - 1 + ((bits >> drop) & 1))  with the low ``drop`` bits cleared

applied to the magnitude bits, the sign kept. A carry out of the mantissa increments the exponent (``1.11…1 · 2^e``
rounds to ``2^(e+1)``), as a real conversion does, and the largest finite values round to infinity. The exponent
range stays float32's (8 bits): subnormals keep float32's fixed spacing ``2^-149`` coarsened by ``2^drop``, and
nothing underflows or overflows earlier than in float32. Hence

- ``k = 7`` is exactly a conversion to bfloat16 and back (bfloat16 is float32 with 7 mantissa bits);
- ``k = 10`` is exactly a conversion to float16 and back on float16's normal range ``[2^-14, 65504]`` (outside it
  float16's narrower exponent range underflows or overflows, which ``round_mantissa`` does not emulate);
- ``k = 23`` is the identity.

The relative rounding error of a normal value is at most ``2^-(k+1)``. NaN stays NaN and ``±inf`` stay ``±inf``.
"""

from __future__ import annotations

import torch

from trl_integration.options import MANTISSA_BITS_RANGE

__all__ = ["round_mantissa"]

_SIGN = -(2**31)  # 0x80000000 as an int32
_MAGNITUDE = 2**31 - 1  # 0x7FFFFFFF


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` mantissa bits, to nearest with ties to even (see the module docstring).

    Args:
        x: a float32, bfloat16 or float16 tensor of any shape. bfloat16/float16 values are rounded as the float32
            values they equal, and returned in their own dtype (exact for ``bits`` at most their mantissa width;
            wider ``bits`` leave them unchanged).
        bits: kept mantissa bits, an integer in ``[1, 23]``.

    Returns:
        A new tensor of ``x``'s shape, dtype and device.

    Raises:
        TypeError: ``x`` is not a tensor of one of those dtypes, or ``bits`` is not an integer.
        ValueError: ``bits`` is outside ``[1, 23]``.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float32, bfloat16 or float16 tensor, got {got}")
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an integer, got {type(bits).__name__}: {bits!r}")
    lo, hi = MANTISSA_BITS_RANGE
    if not lo <= bits <= hi:
        raise ValueError(f"bits={bits!r} is out of range: accepted an integer in [{lo}, {hi}]")
    source = x.float()
    drop = 23 - bits
    if drop == 0:
        return x.clone()
    pattern = source.contiguous().view(torch.int32)
    sign = pattern & _SIGN
    # int64 for the magnitude: the rounding increment of a NaN pattern would overflow int32 (NaN is restored below).
    magnitude = (pattern & _MAGNITUDE).to(torch.int64)
    odd = (magnitude >> drop) & 1  # the last kept bit: ties round to make it 0
    magnitude = (magnitude + ((1 << (drop - 1)) - 1) + odd) & ~((1 << drop) - 1)
    rounded = (magnitude.clamp(max=_MAGNITUDE).to(torch.int32) | sign).view(torch.float32)
    rounded = torch.where(torch.isnan(source), source, rounded)
    return rounded.to(x.dtype)
