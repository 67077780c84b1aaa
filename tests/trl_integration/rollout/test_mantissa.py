"""``trl_integration.rollout.mantissa.round_mantissa`` against independent references: torch's own bfloat16 and float16
conversions (7 and 10 mantissa bits), and a pure-Python round-half-to-even on ``math.frexp``'s significand."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_integration.rollout.mantissa import round_mantissa

FLOAT32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
float32s = st.floats(width=32, allow_nan=False, allow_infinity=False)
bits_st = st.integers(1, 23)


def reference(x: float, bits: int) -> float:
    """Round-half-to-even of a float32 value to ``bits`` mantissa bits, in Python floats (float64, exact here):
    normal values on their own binade's grid, subnormals on float32's fixed grid coarsened by ``2^(23 - bits)``."""
    if x == 0 or not math.isfinite(x):
        return x
    if abs(x) < 2.0**-126:  # float32 subnormal: absolute spacing 2^-149 before rounding
        step = 2.0 ** (-149 + 23 - bits)
        return round(x / step) * step  # Python's round() ties to even; x / step is exact in float64
    m, e = math.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1: the significand has bits + 1 binary digits
    scaled = m * 2.0 ** (bits + 1)
    out = round(scaled) * 2.0 ** (e - bits - 1)
    return out if abs(out) <= FLOAT32_MAX else math.copysign(math.inf, x)


def as_tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_seven_bits_is_bfloat16_and_ten_bits_is_float16():
    g = torch.Generator().manual_seed(0)
    # normal float16 range for the float16 comparison: |x| in [2^-14, 65504]
    mags = torch.exp2(torch.empty(200_000).uniform_(-14, 15.99, generator=g))
    signs = torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0)
    x = (mags * signs).float()
    assert torch.equal(round_mantissa(x, 10), x.to(torch.float16).float())
    # bfloat16 has float32's exponent range: every finite float32, subnormals included
    wide = torch.cat([x, x * 2.0**100, x * 2.0**-120, as_tensor([FLOAT32_MAX, -FLOAT32_MAX, 1e-45, -3e-39, 0.0])])
    assert torch.equal(round_mantissa(wide, 7), wide.to(torch.bfloat16).float())


def test_ties_go_to_even_and_carries_reach_the_exponent():
    # 1 + 2^-8 sits halfway between the 7-bit neighbours 1 and 1 + 2^-7: ties to even (1); 1 + 3 * 2^-8 to 1 + 2^-6
    assert round_mantissa(as_tensor([1 + 2**-8, 1 + 3 * 2**-8]), 7).tolist() == [1.0, 1 + 2**-6]
    # 1.1111111... rounds up into the next binade
    assert round_mantissa(as_tensor([2 - 2**-23]), 3).item() == 2.0
    # the largest float32 rounds up to infinity, as a bfloat16 conversion does
    assert round_mantissa(as_tensor([FLOAT32_MAX, -FLOAT32_MAX]), 7).tolist() == [math.inf, -math.inf]


def test_special_values_and_other_dtypes():
    x = as_tensor([math.nan, math.inf, -math.inf, 0.0, -0.0])
    out = round_mantissa(x, 3)
    assert math.isnan(out[0]) and out[1:3].tolist() == [math.inf, -math.inf]
    # a NaN whose payload sits in the dropped bits only would round to infinity bit-wise: it stays NaN
    nans = [0x7F800001, 0x7FFFFFFF, -1, -0x7FFFFF]  # as int32: -1 is 0xFFFFFFFF, -0x7FFFFF is 0xFF800001
    payload_nans = torch.tensor(nans, dtype=torch.int32).view(torch.float32)
    assert torch.isnan(round_mantissa(payload_nans, 3)).all()
    assert out[3:].tolist() == [0.0, -0.0] and math.copysign(1, out[4].item()) == -1
    assert torch.equal(round_mantissa(x[1:], 23), x[1:])
    b = torch.randn(1000, dtype=torch.bfloat16)
    assert round_mantissa(b, 3).dtype == torch.bfloat16
    assert torch.equal(round_mantissa(b, 7), b)  # bfloat16 already has 7 bits
    assert torch.equal(round_mantissa(b, 3), round_mantissa(b.float(), 3).bfloat16())
    with pytest.raises(ValueError, match=r"bits=0 is out of range: accepted an integer in \[1, 23\]"):
        round_mantissa(x, 0)
    with pytest.raises(ValueError, match="bits=24"):
        round_mantissa(x, 24)
    with pytest.raises(TypeError, match="bits must be an integer"):
        round_mantissa(x, 3.0)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        round_mantissa(x.double(), 3)


@settings(max_examples=400, deadline=None)
@given(st.lists(float32s, min_size=1, max_size=16), bits_st)
def test_matches_the_python_reference(values, bits):
    out = round_mantissa(as_tensor(values), bits).tolist()
    assert out == [reference(v, bits) for v in values]


@settings(max_examples=300, deadline=None)
@given(float32s, float32s, bits_st)
def test_properties(a, b, bits):
    x = as_tensor([a, b])
    r = round_mantissa(x, bits)
    assert torch.equal(round_mantissa(r, bits), r)  # idempotent
    assert torch.equal(round_mantissa(-x, bits), -r)  # symmetric in the sign
    if a <= b:  # monotone
        assert r[0] <= r[1]
    finite = torch.isfinite(r[0])
    if abs(a) >= 2.0**-126 and finite:  # normal: relative error at most half a unit in the last kept place
        assert abs(r[0].item() - a) <= abs(a) * 2.0 ** -(bits + 1)
    if finite:  # the dropped bits are zero
        pattern = struct.unpack("<I", struct.pack("<f", r[0].item()))[0]
        assert pattern & ((1 << (23 - bits)) - 1) == 0
