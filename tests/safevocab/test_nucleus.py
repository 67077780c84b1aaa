"""The top-p threshold found without sorting (safevocab.nucleus) against a float64 full-sort reference.

The reference is written here from the definition: token ``a`` is kept iff the probability mass strictly above it
(tokens with a larger logit) is ``< q``, computed in float64 over a full sort; ties are kept together. A row is
*ambiguous* when some token's mass above it lies within the rounding of the implementation's float32 probabilities
of ``q`` (3e-7 relative: ``exp`` of a rounded ``z - m`` in float32; 1e-12 for float64 inputs): either answer is right
there, and such rows are skipped.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safevocab.rules import TopK, TopP

TOL = {torch.float32: 3e-7, torch.float64: 1e-12}


def reference_keep(
    z: torch.Tensor, q: float, kept: torch.Tensor | None = None, tol: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep mask, ambiguous rows) of top-p on ``z`` [R, V], renormalised over ``kept`` (default: all finite)."""
    zd = z.double()
    if kept is not None:
        zd = zd.masked_fill(~kept, -math.inf)
    p = torch.softmax(zd, -1)
    order = torch.argsort(zd, dim=-1, descending=True, stable=True)
    z_sorted, p_sorted = zd.gather(-1, order), p.gather(-1, order)
    inclusive = p_sorted.cumsum(-1)
    # mass strictly above each sorted token: the inclusive sum before its tie group starts
    group_start = torch.ones_like(z_sorted, dtype=torch.bool)
    group_start[:, 1:] = z_sorted[:, 1:] != z_sorted[:, :-1]
    before = torch.where(group_start, inclusive - p_sorted, torch.full_like(inclusive, -1.0))
    before = torch.cummax(before, -1).values  # carried over the tie group
    keep_sorted = (before < q) & (z_sorted > -math.inf)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    tol = (TOL[z.dtype] if tol is None else tol) * q
    ambiguous = (((before - q).abs() <= tol) & group_start & (z_sorted > -math.inf)).any(-1)
    return keep, ambiguous


@st.composite
def logit_rows(draw):
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 3000))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    z = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * draw(st.floats(0.05, 12.0))
    if draw(st.booleans()):  # ties: logits on a coarse grid
        z = (z * draw(st.sampled_from([1.0, 4.0, 32.0]))).round() / 4.0
    if vocab > 2 and draw(st.booleans()):  # tokens of probability 0
        z[:, torch.randperm(vocab, generator=g)[: vocab // 3]] = -math.inf
        z[:, 0] = z[:, 0].clamp_min(0.0)  # every row keeps a finite logit
    return (z + draw(st.floats(-1e3, 1e3))).to(dtype)


@settings(max_examples=300, deadline=None)
@given(logit_rows(), st.floats(1e-4, 0.9999))
def test_top_p_matches_the_float64_full_sort(z, q):
    keep, ambiguous = reference_keep(z, q)
    got = TopP(q).keep_mask(z)
    sure = ~ambiguous
    assert torch.equal(got[sure], keep[sure])


@settings(max_examples=150, deadline=None)
@given(logit_rows(), st.floats(1e-4, 0.9999), st.integers(1, 400))
def test_top_p_after_top_k_renormalises_over_the_kept_tokens(z, q, k):
    kept = TopK(k).keep_mask(z)
    keep, ambiguous = reference_keep(z, q, kept)
    got = (TopK(k) & TopP(q)).keep_mask(z)
    sure = ~ambiguous
    assert torch.equal(got[sure], (keep & kept)[sure])


def test_a_tie_at_the_boundary_keeps_the_whole_tie():
    # masses 0.4, 0.2, 0.2, 0.2: q = 0.5 needs the top token and one of the tied three; all three are kept
    z = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    assert TopP(0.5).keep_mask(z).tolist() == [[True, True, True, True]]
    assert TopP(0.4).keep_mask(z).tolist() == [[True, False, False, False]]


def test_large_vocabulary_rows_agree_with_the_reference():
    # LM-like spread (std 3) over 32k tokens: boundary tokens carry ~1e-5 of the mass; no row is within 1e-8 of q
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 32000, generator=g) * 3
    for q in (0.1, 0.5, 0.9, 0.99):
        keep, ambiguous = reference_keep(z, q, tol=1e-8)
        assert not ambiguous.any(), q
        assert torch.equal(TopP(q).keep_mask(z), keep), q
