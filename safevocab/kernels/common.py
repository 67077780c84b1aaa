"""Triton helpers shared by the fold kernels: the sampler's logit transform, in fp32 (fp64 for fp64).

Imported only by the kernel modules, which import Triton at import time; see
:mod:`safevocab.kernels` for how the package stays importable without Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from safevocab.kernels import interpreter_on

#: Whether these helpers were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = interpreter_on()


@triton.jit
def tanh(x):
    """``tanh`` to under 0.6 ulp where it saturates (``|x| >= 0.55``), 2.6 ulp at most below (fp32, measured
    against float64 over ``[0.25, 9]``; torch's own is 0.5 ulp), so both backends see nearly the same
    softcapped logits. With ``e = exp(-2|x|)``:

    - ``|x| >= 0.55`` (``tanh >= 1/2``): ``1 - 2e / (1 + e)``; the correction is small next to 1, so its
      rounding (and ``exp``'s, a few ulps with the GPU's fast ``exp``) hardly reaches the result: this is
      where a softcap acts, and where ``/ temperature`` magnifies every ulp;
    - ``1/4 <= |x| < 0.55``: ``(1 - e) / (1 + e)`` (no cancellation there);
    - ``|x| < 1/4``: the odd Taylor series to ``x^9`` (its next term is under an ulp), where
      ``2 / (1 + exp(-2x)) - 1`` would lose the small result to the rounding of 1.

    Exact limits at ``+-inf``.
    """
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    saturating = 1.0 - 2.0 * e / (1.0 + e)
    middle = (1.0 - e) / (1.0 + e)
    big = tl.where(ax >= 0.55, saturating, middle)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(ax < 0.25, small, tl.where(x < 0, -big, big))


@triton.jit
def transform(
    z, scale, softcap, temperature, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMPERATURE: tl.constexpr
):
    """``logit_scale``, then ``softcap * tanh(z / softcap)``, then ``/ temperature`` (the sampler's order).

    Same operations, in the same order, as ``safevocab.fused.transform.Transform.apply_``; the identity steps
    are compiled out. The scalars are cast to ``z``'s dtype (a caller may pass fp64 Python floats).
    ``-inf`` stays ``-inf`` through the softcap (a token of probability 0 never enters ``S``).
    """
    if HAS_SCALE:
        z = z * tl.cast(scale, z.dtype)
    if HAS_SOFTCAP:
        c = tl.cast(softcap, z.dtype)
        z = tl.where(z == float("-inf"), z, tanh(z / c) * c)
    if HAS_TEMPERATURE:
        z = z / tl.cast(temperature, z.dtype)
    return z


def transform_flags(scale: float, softcap: float | None, temperature: float) -> dict[str, bool]:
    """:func:`transform`'s constexpr switches for a launch: which of its steps are not the identity."""
    return dict(HAS_SCALE=scale != 1.0, HAS_SOFTCAP=softcap is not None, HAS_TEMPERATURE=temperature != 1.0)
