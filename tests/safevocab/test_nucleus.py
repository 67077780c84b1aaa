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


@st.composite
def small_rows(draw):
    """Rows of at most ``SORT_MAX_VOCAB`` logits, with ties, ``-inf`` and an earlier rule's threshold."""
    from safevocab.nucleus import SORT_MAX_VOCAB

    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, SORT_MAX_VOCAB))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    z = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * draw(st.floats(0.05, 40.0))
    if draw(st.booleans()):  # ties: logits on a coarse grid
        z = (z * draw(st.sampled_from([1.0, 4.0]))).round() / 4.0
    if vocab > 2 and draw(st.booleans()):  # tokens of probability 0
        z[:, torch.randperm(vocab, generator=g)[: vocab // 3]] = -math.inf
        z[:, 0] = z[:, 0].clamp_min(0.0)
    z = z.to(dtype)
    kept_from = None
    if draw(st.booleans()):  # an earlier rule's threshold: one of the row's own logits
        pick = torch.randint(0, vocab, (rows, 1), generator=g)
        kept_from = torch.minimum(z.gather(-1, pick), z.amax(-1, keepdim=True))
    return z, kept_from


def _both_paths(z: torch.Tensor, q: float, kept_from: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The threshold by the sort (rows this small take it) and by the radix select (forced with a limit of 0); the
    sort's candidates must hold every kept entry."""
    import safevocab.nucleus as nucleus

    e = torch.exp(z - z.amax(-1, keepdim=True))
    t_sort, (row, col) = nucleus.nucleus_threshold(z, e, q, kept_from)
    covered = torch.zeros_like(z, dtype=torch.bool)
    covered[row, col] = True
    assert not (z >= t_sort)[~covered].any()
    limit = nucleus.SORT_MAX_VOCAB
    nucleus.SORT_MAX_VOCAB = 0
    try:
        t_radix, _ = nucleus.nucleus_threshold(z, e, q, kept_from)
    finally:
        nucleus.SORT_MAX_VOCAB = limit
    return t_sort, t_radix


@settings(max_examples=300, deadline=None)
@given(small_rows(), st.one_of(st.floats(1e-4, 0.9999), st.sampled_from([0.25, 0.5])))
def test_the_sort_of_small_rows_gives_the_radix_selects_threshold(rows, q):
    """Rows of at most ``SORT_MAX_VOCAB`` logits are sorted; the radix select gives the very same threshold, with
    ties, zero-mass tokens and an earlier rule."""
    z, kept_from = rows
    t_sort, t_radix = _both_paths(z, q, kept_from)
    assert torch.equal(t_sort, t_radix), (t_sort, t_radix)


@settings(max_examples=150, deadline=None)
@given(logit_rows(), st.floats(1e-4, 0.9999), st.booleans())
def test_the_sync_free_sort_gives_the_radix_selects_threshold_without_a_read(z, q, after_top_k):
    """``sync_free=True`` (the Triton path's bounded fallback batch) sorts rows of any size: no read of the device, and
    the radix select's threshold, with ties, zero-mass tokens and an earlier rule, on every row it does not mark as
    near its target (rows of ties on a coarse grid can sit exactly on it: ``[0, 0, 0, 0]`` at ``q = 0.5``)."""
    import safevocab.nucleus as nucleus
    from safevocab.testing.host_syncs import HostSyncs

    z = z.float()
    e = torch.exp(z - z.amax(-1, keepdim=True))
    kept_from = TopK(7).threshold(z) if after_top_k else None
    with HostSyncs() as reads:
        t_sorted, near = nucleus.nucleus_threshold(z, e, q, kept_from, sync_free=True)
    assert reads.count == 0, reads.report()
    assert near.dtype == torch.bool and near.shape == (z.shape[0],)
    limit = nucleus.SORT_MAX_VOCAB
    nucleus.SORT_MAX_VOCAB = 0  # the radix select, whatever the size
    try:
        t_radix, _ = nucleus.nucleus_threshold(z, e, q, kept_from)
    finally:
        nucleus.SORT_MAX_VOCAB = limit
    assert torch.equal(t_sorted[~near], t_radix[~near]), (t_sorted, t_radix, near)


def test_the_sync_free_sort_marks_no_row_of_continuous_logits():
    """LM-like spread over 32k tokens (as test_large_vocabulary_rows_agree_with_the_reference): no row is marked, and
    every threshold is the radix select's."""
    import safevocab.nucleus as nucleus

    z = torch.randn(64, 32000, generator=torch.Generator().manual_seed(0)) * 3
    e = torch.exp(z - z.amax(-1, keepdim=True))
    for q in (0.1, 0.5, 0.9, 0.99):
        t_sorted, near = nucleus.nucleus_threshold(z, e, q, sync_free=True)
        assert not bool(near.any()), q
        assert torch.equal(t_sorted, nucleus.nucleus_threshold(z, e, q)[0]), q


def tiny_tail_row() -> torch.Tensor:
    """One logit at 0 and 2 x 2^14 at -37 and -37.5 (each ``e ~ 8.5e-17``, below half an ulp of 1): sums of the tail
    in another order land on either side of ``q T`` for ``q = 0.9999999999985`` (found by an outside review)."""
    n = 2**14
    return torch.cat([torch.zeros(1), torch.full((n,), -37.0), torch.full((n,), -37.5)]).unsqueeze(0)


def test_the_sync_free_sort_marks_a_row_where_the_summation_order_decides():
    """On a row where the sort's and the radix select's float64 sums fall on either side of the target, the two give
    different thresholds, and the sort marks the row (the bounded batch then leaves it to the read path)."""
    import safevocab.nucleus as nucleus

    z, q = tiny_tail_row(), 0.9999999999985
    e = torch.exp(z - z.amax(-1, keepdim=True))
    t_sorted, near = nucleus.nucleus_threshold(z, e, q, sync_free=True)
    t_radix, _ = nucleus.nucleus_threshold(z, e, q)
    assert float(t_sorted) != float(t_radix)  # the case the mark is for
    assert near.tolist() == [True]


@settings(max_examples=60, deadline=None)
@given(small_rows())
def test_a_row_that_cannot_reach_the_target_keeps_every_token_with_mass(rows):
    """Where rounding leaves a row's float64 mass below ``q T`` (``T`` is summed in fp32 partial sums; here made
    larger by 1e-4, past any fp32 rounding, to force it), both paths keep every token with mass: ``t`` is the
    smallest such logit, never a token of probability 0 or one an earlier rule removed."""
    import safevocab.nucleus as nucleus

    z, kept_from = rows
    exact_sum = nucleus.row_sum64
    nucleus.row_sum64 = lambda x: exact_sum(x) * (1 + 1e-4)
    try:
        t_sort, t_radix = _both_paths(z, 1 - 1e-12, kept_from)
    finally:
        nucleus.row_sum64 = exact_sum
    e = torch.exp(z - z.amax(-1, keepdim=True))
    with_mass = (e > 0) if kept_from is None else (e > 0) & (z >= kept_from)
    smallest = torch.where(with_mass, z, torch.inf).amin(-1, keepdim=True)
    assert torch.equal(t_sort, smallest) and torch.equal(t_radix, smallest), (t_sort, t_radix, smallest)


def test_a_boundary_mass_of_exactly_q_stops_before_the_next_tie_group():
    """Masses 1/2, 1/4, 1/4 and ``q = 1/2``: the mass above the tied pair is exactly ``q T``, so only the top token is
    kept (kept iff the mass above is ``< q T``), by the sort and by the radix select alike."""
    z = torch.tensor([[0.0, math.log(0.5), math.log(0.5)]], dtype=torch.float64)
    t_sort, t_radix = _both_paths(z, 0.5, None)
    assert t_sort.item() == 0.0 and t_radix.item() == 0.0
