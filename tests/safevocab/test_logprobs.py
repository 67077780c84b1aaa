"""safe_log_softmax and fused_safe_logprobs: values, gradients, agreement, edge cases, errors."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from safevocab import fused_safe_logprobs, parse_rule, safe_log_softmax

RULES = [
    "none",
    "min_p=0.05",
    "min_p=1e-3",
    "min_prob=0.01",
    "top_k=7",
    "top_p=0.8",
    "top_k=20,min_p=0.02",
    "top_k=30,top_p=0.9,min_p=0.01,min_prob=0.005",
]
FIELDS = ("logprobs", "log_kept_mass", "entropy")


def make_inputs(n=33, h=12, v=101, dtype=torch.float32, seed=0, bias=True, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * scale / h**0.5).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_() if bias else None
    # Half of the targets are the argmax-ish tokens (in the safe set), half random (often outside).
    logits = hidden.detach().double() @ weight.detach().double().t()
    targets = torch.where(torch.rand(n, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, v, (n,), generator=g))
    return hidden, weight, b, targets


def brute_force(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor):
    """Row by row in float64, straight from the definitions."""
    out = {k: [] for k in ("logprobs", "log_kept_mass", "entropy", "safe_size", "in_safe")}
    for z, y, s in zip(logits.double(), targets.tolist(), keep):
        p = torch.softmax(z, -1)
        kept = p[s].sum()
        p_s = torch.where(s, p / kept, torch.zeros_like(p))
        out["in_safe"].append(bool(s[y]))
        out["logprobs"].append(math.log(p_s[y]) if s[y] else math.log(p[y]))
        out["log_kept_mass"].append(math.log(kept))
        out["entropy"].append(-(p_s[s] * p_s[s].log()).sum().item())
        out["safe_size"].append(int(s.sum()))
    return out


# ---------------------------------------------------------------------------------------------- materialised


@pytest.mark.parametrize("rule", RULES)
def test_safe_log_softmax_matches_definitions(rule):
    z = torch.randn(40, 60, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    y = torch.randint(0, 60, (40,), generator=torch.Generator().manual_seed(2))
    y[::2] = z[::2].argmax(-1)
    out = safe_log_softmax(z, y, rule, compute_entropy=True)
    ref = brute_force(z, y, parse_rule(rule).keep_mask(z))
    for field in FIELDS:
        torch.testing.assert_close(getattr(out, field), torch.tensor(ref[field], dtype=torch.float64))
    assert out.safe_size.tolist() == ref["safe_size"]
    assert out.in_safe.tolist() == ref["in_safe"]
    assert (out.log_kept_mass <= 0).all()


def test_gradient_is_masked_softmax_gradient():
    z = (torch.randn(5, 30, dtype=torch.float64) * 3).requires_grad_()
    y = z.detach().argmax(-1)
    out = safe_log_softmax(z, y, "min_p=0.05")
    out.logprobs.sum().backward()
    keep = parse_rule("min_p=0.05").keep_mask(z.detach())
    p_s = torch.softmax(z.detach().masked_fill(~keep, -math.inf), -1)
    expected = torch.nn.functional.one_hot(y, 30).double() - p_s
    torch.testing.assert_close(z.grad, expected)
    assert (z.grad[~keep] == 0).all()


def test_out_of_set_target_uses_full_log_softmax_value_and_gradient():
    z = torch.tensor([[4.0, 3.9, -5.0, 0.0]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([2])
    out = safe_log_softmax(z, y, "min_p=0.1")
    assert not out.in_safe.item()
    torch.testing.assert_close(out.logprobs, torch.log_softmax(z, -1)[:, 2])
    out.logprobs.sum().backward()
    torch.testing.assert_close(z.grad, torch.nn.functional.one_hot(y, 4).double() - torch.softmax(z.detach(), -1))


def test_transform_order_scale_softcap_temperature():
    z = torch.randn(6, 20, dtype=torch.float64) * 5
    y = torch.randint(0, 20, (6,))
    out = safe_log_softmax(z, y, "top_k=5", temperature=0.7, softcap=4.0, logit_scale=1.5)
    manual = 4.0 * torch.tanh(z * 1.5 / 4.0) / 0.7
    ref = safe_log_softmax(manual, y, "top_k=5")
    torch.testing.assert_close(out.logprobs, ref.logprobs)


def test_leading_dims_and_low_precision_inputs():
    z = torch.randn(2, 3, 50) * 3
    y = torch.randint(0, 50, (2, 3))
    out = safe_log_softmax(z.bfloat16(), y, "min_p=0.01", compute_entropy=True)
    assert out.logprobs.shape == (2, 3) and out.logprobs.dtype == torch.float32
    ref = safe_log_softmax(z.bfloat16().float(), y, "min_p=0.01", compute_entropy=True)
    torch.testing.assert_close(out.logprobs, ref.logprobs)


@pytest.mark.parametrize("rule", ["none", "min_p=0.1", "top_p=0.7", "top_k=4,min_prob=0.05"])
def test_gradcheck_materialised(rule):
    z = (torch.randn(4, 11, dtype=torch.float64) * 2).requires_grad_()
    y = torch.randint(0, 11, (4,))

    def fn(z):
        out = safe_log_softmax(z, y, rule, temperature=0.8, softcap=3.0, logit_scale=1.2, compute_entropy=True)
        return out.logprobs, out.log_kept_mass, out.entropy

    assert torch.autograd.gradcheck(fn, (z,))


# ---------------------------------------------------------------------------------------------- fused


def fused_and_reference(rule, dtype=torch.float32, max_chunk_bytes=4096, transform=None, seed=0, **shape):
    hidden, weight, bias, targets = make_inputs(dtype=dtype, seed=seed, **shape)
    transform = transform or {}
    fused = fused_safe_logprobs(
        hidden, weight, targets, rule, bias=bias, compute_entropy=True, max_chunk_bytes=max_chunk_bytes, **transform
    )
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    ref = safe_log_softmax(logits, targets, rule, compute_entropy=True, **transform)
    return (hidden, weight, bias), fused, ref


def grads(out, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = sum(
        (getattr(out, f).double() * torch.randn(out.logprobs.shape, generator=g, dtype=torch.float64)).sum()
        for f in FIELDS
    )
    return torch.autograd.grad(loss, [p for p in params if p is not None])


TRANSFORMS = [{}, {"temperature": 0.6}, {"softcap": 2.5, "logit_scale": 1.7, "temperature": 1.3}]


@pytest.fixture(params=["dense", "sparse", "auto"])
def backward_path(request, monkeypatch):
    """Force the dense backward (density cap 0), the sparse one (cap 1) or leave the library's choice."""
    import safevocab.fused.op as chunked

    if request.param != "auto":
        monkeypatch.setattr(chunked, "SPARSE_MAX_DENSITY", 0.0 if request.param == "dense" else 1.0)
    return request.param


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_fused_matches_materialised_fp32(rule, transform, backward_path):
    params, fused, ref = fused_and_reference(rule, transform=transform)
    assert torch.equal(fused.in_safe, ref.in_safe)
    assert torch.equal(fused.safe_size, ref.safe_size)
    for field in FIELDS:
        torch.testing.assert_close(getattr(fused, field), getattr(ref, field), atol=2e-5, rtol=1e-5)
    for a, b in zip(grads(fused, params), grads(ref, params)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 0.05), (torch.float16, 0.01)])
@pytest.mark.parametrize("rule", ["none", "min_p=0.01", "top_p=0.9"])
def test_fused_matches_materialised_half(dtype, tol, rule):
    params, fused, ref = fused_and_reference(rule, dtype=dtype, n=40, v=300)
    # The GEMM rounds logits to the input dtype in both paths, so at most boundary tokens may flip.
    assert (fused.in_safe == ref.in_safe).float().mean() > 0.95
    same = fused.in_safe == ref.in_safe
    for field in FIELDS:
        assert getattr(fused, field).dtype == torch.float32
        torch.testing.assert_close(getattr(fused, field)[same], getattr(ref, field)[same], atol=tol, rtol=tol)
    for p, g in zip(params, grads(fused, params)):
        assert g.dtype == p.dtype and torch.isfinite(g.float()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_grad_hidden_is_the_float64_gradient_rounded_once(dtype):
    """``grad_hidden`` of half inputs is accumulated in fp32 and rounded once (issue 41 point 4): on the CPU (fp32
    logits gradient, fp32 products) it is the float64 gradient, on the logits as the op defines them (the GEMM
    output rounded to the inputs' dtype), rounded once to the inputs' dtype, in practically every entry. Rounding
    the logits gradient and each chunk's product to half precision, as before, left 29-31 % of the entries off the
    rounded value (0.7061 correctly rounded for bf16, 0.6904 for fp16, with 8-row chunks)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 64, 256, 2048
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 2 / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    out = fused_safe_logprobs(hidden, weight, targets, "none", backend="torch", max_chunk_bytes=8 * v * 4)
    (grad_hidden,) = torch.autograd.grad((out.logprobs.double() * upstream).sum(), [hidden])
    assert grad_hidden.dtype == dtype
    z = (hidden.detach() @ weight.t()).double().requires_grad_()
    log_p = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    (grad_z,) = torch.autograd.grad((log_p * upstream).sum(), [z])
    expected = (grad_z @ weight.double()).to(dtype)
    assert (grad_hidden == expected).float().mean() > 0.99


def test_fp32_grad_hidden_buffer_accumulates_several_products_in_fp32():
    """Several products added into the same rows (the sparse and full-softmax parts of a row, several vocabulary
    pieces) stay in fp32 until the single rounding: each piece rounded to bf16 and summed in bf16 drifts."""
    from safevocab.fused.grads import accumulate_chunk_grads

    g = torch.Generator().manual_seed(3)
    n, h, v, pieces = 16, 64, 4096, 8
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) / 8).bfloat16()
    grad = torch.randn(n, v, generator=g).bfloat16()
    rows = torch.arange(n)
    buffer = torch.zeros(n, h)  # what FusedSafeLogProbs allocates for half inputs
    for cols in torch.arange(v).chunk(pieces):
        accumulate_chunk_grads(grad[:, cols], hidden, weight[cols], rows, (buffer, None, None))
    expected = (grad.double() @ weight.double()).bfloat16()
    assert (buffer.bfloat16() == expected).float().mean() > 0.99
    half_sum = torch.zeros(n, h, dtype=torch.bfloat16)
    for cols in torch.arange(v).chunk(pieces):
        half_sum += grad[:, cols] @ weight[cols]
    assert (half_sum == expected).float().mean() < 0.9  # the old bf16 accumulation: measurably off


def test_dw_side_stream_switch_changes_nothing_off_cuda(monkeypatch):
    """The private dW side-stream switch (issue 41) is guarded by ``device.type == "cuda"``: on the CPU it is a no-op."""
    import safevocab.fused.grads as grads_module

    hidden, weight, bias, targets = make_inputs(n=20, v=300, dtype=torch.bfloat16)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(grads_module, "_DW_SIDE_STREAM", on)
        out = fused_safe_logprobs(hidden, weight, targets, "min_p=0.1", bias=bias, compute_entropy=True)
        runs.append(grads(out, (hidden, weight, bias)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@given(
    n=st.integers(0, 40),
    v=st.integers(1, 150),
    chunk=st.sampled_from([1, 700, 5000, 10**9]),
    rule=st.sampled_from(RULES),
    seed=st.integers(0, 1000),
)
def test_fused_any_shape_and_chunking(n, v, chunk, rule, seed):
    params, fused, ref = fused_and_reference(rule, max_chunk_bytes=chunk, n=n, v=v, seed=seed, bias=seed % 2 == 0)
    assert fused.logprobs.shape == (n,)
    assert torch.equal(fused.in_safe, ref.in_safe)
    for field in FIELDS:
        torch.testing.assert_close(getattr(fused, field), getattr(ref, field), atol=2e-5, rtol=1e-5)
    if n:
        for a, b in zip(grads(fused, params), grads(ref, params)):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rule", ["none", "min_p=0.1", "top_p=0.8", "top_k=3,min_p=0.2", "min_prob=0.05"])
def test_gradcheck_fused(rule, backward_path):
    hidden, weight, bias, targets = make_inputs(n=6, h=4, v=13, dtype=torch.float64)

    def fn(hidden, weight, bias):
        out = fused_safe_logprobs(
            hidden,
            weight,
            targets,
            rule,
            bias=bias,
            temperature=0.7,
            softcap=3.0,
            logit_scale=1.3,
            compute_entropy=True,
            max_chunk_bytes=300,
        )
        return out.logprobs, out.log_kept_mass, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_fused_neg_inf_bias_rows():
    hidden, weight, _, targets = make_inputs(n=10, v=40, bias=False)
    bias = torch.zeros(40)
    bias[5:25] = -math.inf  # e.g. vocabulary entries the model may never emit
    targets = torch.where((targets >= 5) & (targets < 25), 0, targets)
    out = fused_safe_logprobs(hidden, weight, targets, "none", bias=bias, compute_entropy=True, max_chunk_bytes=900)
    ref = safe_log_softmax(hidden @ weight.t() + bias, targets, "none", compute_entropy=True)
    assert (out.safe_size <= 20).all()
    torch.testing.assert_close(out.logprobs, ref.logprobs)
    torch.testing.assert_close(out.entropy, ref.entropy)
    out.logprobs.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_fused_leading_dims_and_frozen_head():
    hidden, weight, _, targets = make_inputs(n=12, bias=False)
    weight = weight.detach()
    out = fused_safe_logprobs(hidden.reshape(3, 4, -1), weight, targets.reshape(3, 4), "min_p=0.05")
    assert out.logprobs.shape == (3, 4)
    out.logprobs.sum().backward()
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.parametrize("rule", ["top_k=10", "min_p=0.05", "top_p=0.7"])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_fused_gradient_confined_to_safe_set(rule, transform, backward_path):
    """The RL case: out-of-set tokens masked, gradients on logprobs and entropy only (sparse path)."""
    params, fused, ref = fused_and_reference(rule, transform=transform, n=50, v=400)
    weights = torch.randn(50, generator=torch.Generator().manual_seed(3))

    def loss(out):
        return (out.logprobs * weights * out.in_safe).sum() + 0.1 * out.entropy.sum()

    for x, y in zip(torch.autograd.grad(loss(fused), params), torch.autograd.grad(loss(ref), params)):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def test_fused_logprob_gradient_with_out_of_set_targets(backward_path):
    """Unmasked out-of-set targets: those rows take the dense path even when S was stored."""
    params, fused, ref = fused_and_reference("min_p=0.1", n=50, v=400)
    assert not fused.in_safe.all() and fused.in_safe.any()
    for x, y in zip(torch.autograd.grad(fused.logprobs.sum(), params), torch.autograd.grad(ref.logprobs.sum(), params)):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, exc, fragment",
    [
        ({"temperature": 0.0}, ValueError, "temperature=0.0"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"softcap": -1.0}, ValueError, "softcap=-1.0"),
        ({"logit_scale": 0}, ValueError, "logit_scale=0"),
        ({"rule": "min_p=2"}, ValueError, "min_p=2.0"),
        ({"backend": "cuda"}, ValueError, "backend='cuda'"),
        ({"backend": "triton"}, ValueError, "triton"),
        ({"max_chunk_bytes": 0}, ValueError, "max_chunk_bytes=0"),
        ({"targets": torch.tensor([0, 1, 999])}, ValueError, "token id 999"),
        ({"targets": torch.tensor([0, -1, 2])}, ValueError, "token id -1"),
        ({"targets": torch.tensor([0.0, 1.0, 2.0])}, TypeError, "targets.dtype"),
        ({"targets": torch.tensor([0, 1])}, ValueError, "targets.shape"),
        ({"hidden": torch.zeros(3, 5)}, ValueError, "hidden.shape"),
        ({"hidden": torch.zeros(3, 4, dtype=torch.long)}, TypeError, "hidden.dtype"),
        ({"hidden": torch.zeros(3, 4, dtype=torch.float64)}, TypeError, "must be equal"),
        ({"weight": torch.zeros(10)}, ValueError, "weight.shape"),
        ({"bias": torch.zeros(9)}, ValueError, "bias.shape"),
    ],
)
def test_fused_bad_inputs(kwargs, exc, fragment):
    args = {
        "hidden": torch.zeros(3, 4),
        "weight": torch.zeros(10, 4),
        "targets": torch.tensor([0, 1, 2]),
        "rule": "none",
    }
    args.update(kwargs)
    with pytest.raises(exc) as err:
        fused_safe_logprobs(**args)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "logits, targets, exc",
    [
        (torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long), TypeError),
        (torch.zeros(3, 5), torch.zeros(4, dtype=torch.long), ValueError),
        (torch.zeros(3, 5), torch.full((3,), 5), ValueError),
    ],
)
def test_materialised_bad_inputs(logits, targets, exc):
    with pytest.raises(exc):
        safe_log_softmax(logits, targets, "none")


@pytest.mark.parametrize("value", ["yes", "no", 1, 0, None, torch.tensor([True])])
@pytest.mark.parametrize("entry", ["materialised", "fused"])
def test_compute_entropy_must_be_a_bool(entry, value):
    """A string (even "no") or an int was read by truthiness; refused like every other argument of a wrong type."""
    hidden, weight = torch.randn(3, 4), torch.randn(10, 4)
    targets = torch.tensor([0, 1, 2])
    with pytest.raises(TypeError) as err:
        if entry == "fused":
            fused_safe_logprobs(hidden, weight, targets, "top_k=3", compute_entropy=value)
        else:
            safe_log_softmax(hidden @ weight.t(), targets, "top_k=3", compute_entropy=value)
    assert str(err.value).startswith(f"compute_entropy must be a bool (True or False), got {type(value).__name__}: ")


def test_compute_entropy_takes_numpy_and_torch_bools():
    import numpy as np

    hidden, weight = torch.randn(3, 4), torch.randn(10, 4)
    targets = torch.tensor([0, 1, 2])
    expected = safe_log_softmax(hidden @ weight.t(), targets, "top_k=3", compute_entropy=True).entropy
    for flag in (np.bool_(True), torch.tensor(True)):
        got = fused_safe_logprobs(hidden, weight, targets, "top_k=3", compute_entropy=flag).entropy
        torch.testing.assert_close(got, expected)
    assert safe_log_softmax(hidden @ weight.t(), targets, "top_k=3", compute_entropy=np.bool_(False)).entropy is None
