"""Regression tests for the defects an outside float64 reference and fuzzer found in the core op.

Each test fails on the code before the fix (see the closing note of the change that added this file).
The general guarantees are fuzzed in ``test_reference_fuzz.py``; these pin the exact reported cases.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from backward_path import set_sparse_max_density
from out_of_set_cases import audit_case, check_case, d6_inputs

from safevocab import (
    MinP,
    TopK,
    TopP,
    fused_safe_logprobs,
    parse_rule,
    safe_log_softmax,
    transform_logits,
)
from safevocab.fused.chunking import ChunkLogits
from safevocab.schedulers import LengthDecayLR, SurgeDetector

# ---------------------------------------------------------------------------------------------- 1. backward uses the forward's S


def _head(seed: int, n: int = 37, h: int = 13, v: int = 500, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=dtype) / 4).requires_grad_()
    targets = torch.distributions.Categorical(logits=(hidden.detach() @ weight.detach().t()).float()).sample()
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", ["top_k=3", "top_p=0.5", "min_p=1.0", "min_prob=0.9"])
def test_dense_backward_past_the_first_chunk_uses_the_forward_set(rule, dtype, monkeypatch):
    """Boundary rules (the threshold is itself a logit), dense backward, rows past the first chunk, an odd H
    (row slices not 64-byte aligned): the fused gradient equals the materialised one on the same logits.
    Before the fix the backward recomputed the logits on an ``index_select`` copy, MKL returned them one ulp
    apart, the boundary token left S and the gradient was off by up to 100 %."""
    set_sparse_max_density(monkeypatch, 0.0)
    worst = 0.0
    for seed in range(40):
        hidden, weight, targets = _head(seed, dtype=dtype)
        out = fused_safe_logprobs(hidden, weight, targets, rule, max_chunk_bytes=500 * 16 * 5)
        fused = torch.autograd.grad(-(out.logprobs * out.in_safe).sum(), (hidden, weight))
        h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        ref = safe_log_softmax(h2 @ w2.t(), targets, rule)
        assert torch.equal(ref.in_safe, out.in_safe)
        materialised = torch.autograd.grad(-(ref.logprobs * ref.in_safe).sum(), (h2, w2))
        for a, b in zip(fused, materialised):
            worst = max(worst, float((a - b).double().norm() / (b.double().norm() + 1e-12)))
    assert worst < (1e-5 if dtype == torch.float32 else 1e-12), worst


def test_recomputed_set_that_moved_is_repaired_from_the_saved_size(monkeypatch):
    """If a recomputation ever moved a boundary logit by an ulp (a BLAS that is not deterministic), the
    backward still uses |S| logits: the saved size repairs the rebuilt set."""
    set_sparse_max_density(monkeypatch, 0.0)
    hidden, weight, targets = _head(0, n=8, v=50)
    calls = []
    original = ChunkLogits.__call__

    def nudged(self, h):
        z = original(self, h)
        calls.append(1)
        if len(calls) > 1:  # the backward's recomputation: push each row's k-th largest logit one ulp down
            kth = torch.topk(z, 3).values[:, -1:]
            z.copy_(torch.where(z == kth, torch.nextafter(z, torch.full_like(z, -math.inf)), z))
        return z

    monkeypatch.setattr(ChunkLogits, "__call__", nudged)
    out = fused_safe_logprobs(hidden, weight, targets, "top_k=3")
    (g,) = torch.autograd.grad(-(out.logprobs * out.in_safe).sum(), (hidden,))
    monkeypatch.setattr(ChunkLogits, "__call__", original)
    h2 = hidden.detach().clone().requires_grad_()
    ref = safe_log_softmax(h2 @ weight.detach().t(), targets, "top_k=3")
    (want,) = torch.autograd.grad(-(ref.logprobs * ref.in_safe).sum(), (h2,))
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_out_of_set_targets_in_a_sparse_chunk_keep_the_stored_set(monkeypatch):
    """Unmasked out-of-set targets in chunks whose S was stored: their safe-set part comes from the stored S
    and only the (S-independent) full-softmax part is recomputed."""
    set_sparse_max_density(monkeypatch, 1.0)
    hidden, weight, targets = _head(3)
    out = fused_safe_logprobs(hidden, weight, targets, "top_k=3", max_chunk_bytes=500 * 16 * 5)
    assert not bool(out.in_safe.all())
    (g,) = torch.autograd.grad(-(out.logprobs.sum() + out.log_kept_mass.sum()), (weight,))
    w2 = weight.detach().clone().requires_grad_()
    ref = safe_log_softmax(hidden.detach() @ w2.t(), targets, "top_k=3")
    (want,) = torch.autograd.grad(-(ref.logprobs.sum() + ref.log_kept_mass.sum()), (w2,))
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_out_of_set_rows_of_a_stored_set_get_the_forward_softmax():
    """Issue 28 N1, the audit's reproducer (N=4, V=26, H=3, weights x300/sqrt(H), 5 ids banned, top_k=1, T=1e-6,
    a gradient on rows 0-2 only) and the next 39 seeds of its generator: the full-softmax part of rows whose S was
    stored is normalised with the forward's row max and log-sum, so it must use the forward's logits. Before the
    fix it recomputed them on ``hidden.index_select`` of those rows: an ulp off, a factor exp(delta / T) (seed 6:
    max|dW| 9.2e33, 1.7e27 x the softmax bound; the materialised path: 2.6e6)."""
    for seed in [6, *range(6), *range(7, 40)]:
        check_case(audit_case(seed), "torch")


# ---------------------------------------------------------------------------------------------- 2. max-shifted arithmetic


def _tied(temperature: float, dtype=torch.float32):
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.5, -2.0]], dtype=dtype)
    return logits, torch.tensor([0]), temperature


@pytest.mark.parametrize("temperature", [1e-7, 1e-6, 1e-4])
@pytest.mark.parametrize("backend", ["materialised", "fused"])
def test_tied_logits_at_tiny_temperature_give_minus_log_3(temperature, backend):
    logits, targets, t = _tied(temperature)
    if backend == "materialised":
        z = logits.clone().requires_grad_()
        out = safe_log_softmax(z, targets, "none", temperature=t, compute_entropy=True)
        (grad,) = torch.autograd.grad(out.logprobs.sum(), (z,))
    else:
        hidden = torch.ones(1, 1, requires_grad=True)
        weight = logits.t().contiguous().requires_grad_()  # [V, 1]: hidden @ weight.T == logits
        out = fused_safe_logprobs(hidden, weight, targets, "none", temperature=t, compute_entropy=True)
        (grad,) = torch.autograd.grad(out.logprobs.sum(), (weight,))
        grad = grad.t()
    assert out.logprobs.item() == pytest.approx(-math.log(3), abs=1e-6)
    assert out.entropy.item() == pytest.approx(math.log(3), abs=1e-6)
    # d log p_y / d z = (1[a=y] - p) / T sums to zero
    assert abs(grad.sum().item()) <= 1e-6 / t
    assert grad[0, 0].item() == pytest.approx(2 / 3 / t, rel=1e-5)


def test_fp16_gradient_at_small_temperature_is_finite():
    """T=1e-4, fp16 inputs: the true gradient (1/T)(1[a=y] - 1/3) fits fp16; before the fix it did not sum to
    zero and overflowed."""
    hidden = torch.ones(1, 1, dtype=torch.float16, requires_grad=True)
    weight = torch.tensor([[1.0], [1.0], [1.0], [0.5]], dtype=torch.float16, requires_grad=True)
    out = fused_safe_logprobs(hidden, weight, torch.tensor([0]), "none", temperature=1e-4)
    (g,) = torch.autograd.grad(out.logprobs.sum(), (weight,))
    assert torch.isfinite(g).all()
    assert g[0].item() == pytest.approx(20000 / 3, rel=1e-2) and abs(g.float().sum().item()) < 20


def test_fp16_backward_beyond_65504_over_temperature_is_finite():
    """Issue 28 D6: T = 1e-5, two tokens one fp16 ulp apart and near-tied, the target the smaller one. The logits
    gradient (+-9.98e4) leaves fp16's range, d/dh (-97.4) and d/dW (+-6237) do not; before the fix d/dh was NaN."""
    hidden, weight, targets = d6_inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_safe_logprobs(h, w, targets, "none", temperature=1e-5)
    got = torch.autograd.grad(out.logprobs.sum(), (h, w))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits = (h64 @ w64.t()) / 1e-5  # exact in fp16 and fp32 here
    want = torch.autograd.grad(torch.log_softmax(logits, -1)[0, 0], (h64, w64))
    assert want[0][0, 0].item() == pytest.approx(-97.4, abs=0.05)
    for g, wnt in zip(got, want):
        assert torch.isfinite(g).all(), g
        torch.testing.assert_close(g.double(), wnt, rtol=2**-9, atol=1e-3)


# ---------------------------------------------------------------------------------------------- 3. non-finite input raises


def _fused(hidden=None, weight=None, bias=None, **kwargs):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, generator=g) if hidden is None else hidden
    weight = torch.randn(10, 4, generator=g) if weight is None else weight
    return fused_safe_logprobs(
        hidden, weight, torch.zeros(hidden.shape[0], dtype=torch.long), "min_p=0.1", bias=bias, **kwargs
    )


def _with(x: torch.Tensor, index, value) -> torch.Tensor:
    x = x.clone()
    x[index] = value
    return x


def test_non_finite_inputs_raise_naming_the_argument():
    g = torch.Generator().manual_seed(0)
    logits, hidden, weight = (
        torch.randn(3, 8, generator=g),
        torch.randn(6, 4, generator=g),
        torch.randn(10, 4, generator=g),
    )
    targets = torch.zeros(3, dtype=torch.long)
    cases = [
        (lambda: safe_log_softmax(_with(logits, (1, 2), math.nan), targets, "none"), "logits has a NaN at row 1"),
        (lambda: safe_log_softmax(_with(logits, (2, 0), math.inf), targets, "min_p=0.1"), "logits has +inf at row 2"),
        (
            lambda: safe_log_softmax(_with(logits, 0, -math.inf), targets, "none"),
            "logits is -inf for every token at row 0",
        ),
        (lambda: safe_log_softmax(logits * 100, targets, "none", temperature=1e-40), "temperature=1e-40"),
        (lambda: _fused(hidden=_with(hidden, (4, 1), math.nan)), "hidden has a non-finite value"),
        (lambda: _fused(weight=_with(weight, (7, 0), math.nan)), "weight has a non-finite value (NaN or inf) in row 7"),
        # issue 37: a -inf weight with positive hidden values made a -inf logit (a banned token) and passed silently
        (
            lambda: _fused(hidden=hidden.abs() + 0.1, weight=_with(weight, (7, 0), -math.inf)),
            "weight has a non-finite value (NaN or inf) in row 7",
        ),
        (
            lambda: _fused(hidden=hidden.abs() + 0.1, weight=_with(weight, (7, 0), -math.inf), bias=torch.zeros(10)),
            "weight has a non-finite value (NaN or inf) in row 7",
        ),
        (lambda: _fused(bias=_with(torch.zeros(10), 3, math.nan)), "bias has value nan at token 3"),
        (lambda: _fused(bias=_with(torch.zeros(10), 3, math.inf)), "bias has value inf at token 3"),
        (lambda: _fused(bias=torch.full((10,), -math.inf)), "bias is -inf for every token"),
        (lambda: _fused(temperature=1e-40), "temperature=1e-40"),
        (
            lambda: _fused(
                hidden=torch.full((2, 4), 200.0, dtype=torch.float16),
                weight=torch.full((10, 4), 100.0, dtype=torch.float16),
            ),
            "overflows torch.float16",
        ),
    ]
    for call, fragment in cases:
        with pytest.raises(ValueError) as err:
            call()
        message = str(err.value)
        assert fragment in message, message
        assert "\n" not in message


def test_minus_inf_entries_stay_allowed_and_are_never_kept():
    logits = torch.tensor([[2.0, -math.inf, 1.0, 0.0]])
    out = safe_log_softmax(logits, torch.tensor([0]), "none")
    assert out.safe_size.item() == 3
    fused = _fused(bias=torch.cat([torch.tensor([0.0, -math.inf]), torch.zeros(8)]))
    assert bool((fused.safe_size <= 9).all())


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_minus_inf_bias_is_never_kept_with_softcap(softcap):
    """A softcap maps -inf to -softcap: the banned token used to come back finite and be kept."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g)
    bias = torch.tensor([0.0, -math.inf, 0.0, 0.0])
    out = fused_safe_logprobs(hidden, weight, torch.zeros(5, dtype=torch.long), "none", bias=bias, softcap=softcap)
    assert bool((out.safe_size == 3).all())
    z = transform_logits(hidden @ weight.t() + bias, softcap=softcap)
    assert bool((z[:, 1] == -math.inf).all())
    mat = safe_log_softmax(hidden @ weight.t() + bias, torch.zeros(5, dtype=torch.long), "none", softcap=softcap)
    assert bool((mat.safe_size == 3).all())


# ---------------------------------------------------------------------------------------------- 4. scalars of any kind


def test_real_scalars_of_any_kind_are_accepted():
    assert MinP(np.float32(0.1)) == MinP(float(np.float32(0.1)))
    assert TopK(np.int64(50)).k == 50 and isinstance(TopK(np.int64(50)).k, int)
    assert TopK(torch.tensor(5)).k == 5
    assert TopP(np.float64(0.9)).q == 0.9
    hidden, weight = torch.randn(4, 3), torch.randn(7, 3)
    targets = torch.zeros(4, dtype=torch.long)
    a = fused_safe_logprobs(
        hidden, weight, targets, "none", temperature=torch.tensor(0.7), max_chunk_bytes=np.int64(4096)
    )
    b = fused_safe_logprobs(hidden, weight, targets, "none", temperature=float(torch.tensor(0.7)), max_chunk_bytes=4096)
    torch.testing.assert_close(a.logprobs, b.logprobs)
    safe_log_softmax(hidden @ weight.t(), targets, "none", temperature=np.float32(0.5), softcap=np.int32(3))
    assert SurgeDetector(window=np.int64(5)).window == 5
    scheduler = LengthDecayLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), decay_period=np.int64(3))
    assert scheduler.decay_period == 3


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: MinP("0.1"), "min_p must be a real number, got str"),
        (lambda: TopK(2.5), "top_k must be an integer, got float"),
        (lambda: TopK(True), "top_k must be an integer, got bool"),
        (
            lambda: fused_safe_logprobs(
                torch.randn(2, 3), torch.randn(4, 3), torch.zeros(2, dtype=torch.long), "none", temperature="1"
            ),
            "temperature must be a real number, got str",
        ),
        (
            lambda: fused_safe_logprobs(
                torch.randn(2, 3), torch.randn(4, 3), torch.zeros(2, dtype=torch.long), "none", max_chunk_bytes=4096.0
            ),
            "max_chunk_bytes must be an integer, got float",
        ),
        (lambda: SurgeDetector(window="5"), "window must be an integer, got str"),
        (lambda: transform_logits([1.0, 2.0]), "logits must be a torch.Tensor, got list"),
    ],
)
def test_wrong_types_raise_type_error_naming_the_argument(call, fragment):
    with pytest.raises(TypeError) as err:
        call()
    assert fragment in str(err.value)


def test_surge_detector_counts_lengths_of_any_real_type():
    """np.float32 and 0-dim tensors used to be ignored silently, so the schedule never triggered."""
    for make in (np.float32, lambda x: torch.tensor(x), float):
        detector = SurgeDetector(window=3, baseline_window=3, warmup=0)
        fired = [detector.update(step, make(100.0 if step < 6 else 300.0)) for step in range(10)]
        assert any(fired) and detector.surge_step == 6, make
    detector = SurgeDetector()
    assert detector.update(0, float("nan")) is False and detector.n_updates == 0  # a step with no completions
    for bad, error in [("12", TypeError), (None, TypeError), (-1.0, ValueError)]:
        with pytest.raises(error, match="mean_length"):
            detector.update(1, bad)
    for step, error in [(math.nan, TypeError), (-1, ValueError), ("3", TypeError)]:
        with pytest.raises(error, match="step"):
            detector.update(step, 10.0)


# ---------------------------------------------------------------------------------------------- 5. top_p=1 and fp64 rows


def test_top_p_one_keeps_every_token_even_underflowing_ones():
    logits = torch.tensor([[0.0, -120.0, -200.0, 5.0]])  # exp(-200) underflows in fp32
    for rule in ("top_p=1.0", TopP(1.0), "top_k=4,top_p=1.0"):
        out = safe_log_softmax(logits, torch.tensor([2]), rule)
        assert out.safe_size.item() == 4 and out.in_safe.item()
    assert parse_rule("top_p=1.0").threshold(logits).item() <= -120


def test_fp64_rows_far_below_fp32_range_keep_their_argmax():
    logits = torch.tensor([[-1e300, -2e300, -1.5e300]], dtype=torch.float64)
    for rule in ("none", "min_p=0.5", "top_k=1", "top_p=0.5", "min_prob=0.5"):
        out = safe_log_softmax(logits, torch.tensor([0]), rule)
        assert out.in_safe.item() and out.safe_size.item() >= 1, rule
        assert out.logprobs.item() == 0.0


# ---------------------------------------------------------------------------------------------- 6. degenerate shapes


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (
            lambda: safe_log_softmax(torch.zeros(0, 0), torch.zeros(0, dtype=torch.long), "none"),
            ValueError,
            "logits.shape=(0, 0)",
        ),
        (
            lambda: fused_safe_logprobs(torch.zeros(3, 0), torch.zeros(5, 0), torch.zeros(3, dtype=torch.long), "none"),
            ValueError,
            "weight.shape=(5, 0)",
        ),
        (
            lambda: fused_safe_logprobs(torch.zeros(3, 0), torch.zeros(5, 2), torch.zeros(3, dtype=torch.long), "none"),
            ValueError,
            "hidden.shape=(3, 0)",
        ),
        (
            lambda: fused_safe_logprobs(torch.zeros(3, 2), torch.zeros(0, 2), torch.zeros(3, dtype=torch.long), "none"),
            ValueError,
            "weight.shape=(0, 2)",
        ),
        (lambda: transform_logits([1.0, 2.0]), TypeError, "logits must be a torch.Tensor"),
    ],
)
def test_degenerate_shapes_and_types_raise_naming_the_argument(call, error, fragment):
    with pytest.raises(error) as err:
        call()
    assert fragment in str(err.value)
