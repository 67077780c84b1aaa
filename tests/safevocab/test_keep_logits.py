"""``keep_logits_bytes`` (issue "GPU IV", point 4): the forward keeps its first chunks' logits buffers within a byte
cap (:class:`safevocab.fused.chunking.KeptLogits`) and the backward folds them instead of recomputing them.

Kept or recomputed, a chunk's logits are the forward's bit for bit, so every output and gradient must equal the
``keep_logits_bytes=0`` call's exactly (that call is itself checked against the materialised definitions in
``test_logprobs.py``), while the LM-head GEMMs counted here show which chunks were recomputed. The torch backend here;
the Triton backend (under its interpreter on CPU) in ``test_keep_logits_triton.py``, which reuses these helpers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from backward_path import set_sparse_max_density

from safevocab import fused_safe_logprobs
from safevocab.backends.registry import get_backend
from safevocab.fused import chunking
from safevocab.fused.chunking import KeptLogits, chunk_slices
from safevocab.rules import parse_rule

N, H, V = 20, 8, 61
FIELDS = ("logprobs", "log_kept_mass", "entropy")


# ---------------------------------------------------------------------------------------------- helpers


class GemmSpy:
    """Counts the chunk GEMMs (the torch backend's and the Triton torch route's ``ChunkLogits.gemm``, and the GEMMs of
    ``more``: the Triton raw routes' ``ChunkGemm.__call__``) per phase, which the test sets around its forward and its
    backward (:meth:`during`). This module imports no Triton: collected before ``test_kernels.py``, it would import
    Triton before that module can set its interpreter up."""

    def __init__(self, monkeypatch, more: tuple[tuple[type, str], ...] = ()):
        self.phase, self.calls = "forward", {"forward": 0, "backward": 0}
        for owner, name in ((chunking.ChunkLogits, "gemm"), *more):
            original = getattr(owner, name)

            def counting(obj, *args, _original=original, **kwargs):
                self.calls[self.phase] += 1
                return _original(obj, *args, **kwargs)

            monkeypatch.setattr(owner, name, counting)

    @contextlib.contextmanager
    def during(self, phase: str):
        self.phase, self.calls[phase] = phase, 0
        yield
        self.phase = "forward"


def make_inputs(dtype=torch.float32, device="cpu", seed=0, n=N):
    """A head whose targets are half the argmax (in ``S``), half random (often outside), and a bias."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 2 / H**0.5
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    logits = hidden @ weight.t() + bias
    targets = torch.where(torch.rand(n, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, V, (n,), generator=g))
    params = tuple(t.to(device, dtype).requires_grad_() for t in (hidden, weight, bias))
    return params, targets.to(device)


def chunk_bytes(backend: str, rule: str, dtype: torch.dtype, rows: int) -> int:
    """A ``max_chunk_bytes`` giving chunks of at most ``rows`` rows on ``backend`` (its own scratch per logit)."""
    budget = rows * V * 64
    while get_backend(backend).rows_per_chunk(N, V, parse_rule(rule), dtype.itemsize, budget) > rows:
        budget -= V
    return budget


def mixed_loss(out, seed=1):
    """Every output with a gradient, out-of-set targets and ``log_kept_mass`` included: the full-softmax part too."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(out.logprobs.shape, generator=g, dtype=torch.float64).to(out.logprobs.device) for _ in FIELDS]
    return sum((getattr(out, f).double() * wi).sum() for f, wi in zip(FIELDS, w))


def rl_loss(out, seed=2):
    """trl GRPO's shape: out-of-set tokens masked, no ``log_kept_mass`` gradient: stored chunks need no logits."""
    w = torch.randn(out.logprobs.shape, generator=torch.Generator().manual_seed(seed)).to(out.logprobs.device)
    return (out.logprobs * w * out.in_safe).sum() + 0.1 * out.entropy.sum()


def run(spy, params, targets, rule, keep, backend="torch", loss=mixed_loss, max_chunk_bytes=None, **kwargs):
    """Forward and backward of one call: ``(out, grads, kept store after the forward or None)``, GEMMs in ``spy``."""
    hidden, weight, bias = params
    budget = max_chunk_bytes or chunk_bytes(backend, rule, hidden.dtype, 8)
    with spy.during("forward"):
        out = fused_safe_logprobs(hidden, weight, targets, rule, bias=bias, compute_entropy=True, backend=backend,
                                  max_chunk_bytes=budget, keep_logits_bytes=keep, **kwargs)  # fmt: skip
    store = op_node(out).kept_logits  # the op's kept buffers until the backward
    with spy.during("backward"):
        grads = torch.autograd.grad(loss(out), params)
    return out, grads, store


def op_node(out):
    """The fused op's autograd node (its ``ctx``) under the entry point's reshape of ``out.logprobs``."""
    node = out.logprobs.grad_fn
    while not hasattr(node, "kept_logits"):
        node = node.next_functions[0][0]
    return node


def assert_same_bits(a, b):
    out_a, grads_a, _ = a
    out_b, grads_b, _ = b
    for field in (*FIELDS, "in_safe", "safe_size"):
        assert torch.equal(getattr(out_a, field), getattr(out_b, field)), field
    for name, ga, gb in zip(("hidden", "weight", "bias"), grads_a, grads_b):
        assert ga.dtype == gb.dtype and torch.equal(ga, gb), name


def n_chunks(backend, rule, dtype, budget=None) -> int:
    rows = get_backend(backend).rows_per_chunk(
        N, V, parse_rule(rule), dtype.itemsize, budget or chunk_bytes(backend, rule, dtype, 8)
    )
    return len(chunk_slices(N, rows))


def chunk_sizes(backend, rule, dtype) -> list[int]:
    rows = get_backend(backend).rows_per_chunk(
        N, V, parse_rule(rule), dtype.itemsize, chunk_bytes(backend, rule, dtype, 8)
    )
    return [s.stop - s.start for s in chunk_slices(N, rows)]


def first_chunk_cap(sizes: list[int], itemsize: int) -> int:
    """A cap that holds the first chunk and the last, but not the first two: only the first is kept (forward order)."""
    assert len(sizes) >= 3 and sizes[-1] <= sizes[1]
    return (sizes[0] + sizes[-1]) * V * itemsize


# ---------------------------------------------------------------------------------------------- the store


def test_kept_logits_keep_in_forward_order_within_the_cap_and_hand_each_buffer_over_once():
    store = KeptLogits(100)
    assert store.reserve(40) and store.reserve(40)
    assert not store.reserve(30)  # 110 > 100: refused, and the store closes
    assert not store.reserve(10)  # would fit, but a later chunk is never kept once one was refused
    a, b = torch.zeros(5, 2), torch.ones(5, 2)
    store.put(0, a)
    store.put(8, b)
    assert (len(store), store.reserved, store.nbytes) == (2, 80, 80)
    assert store.take(0) is a and store.take(0) is None  # handed over once: the backward overwrites it
    assert store.take(16) is None  # never kept
    store.clear()
    assert len(store) == 0 and store.take(8) is None


# ---------------------------------------------------------------------------------------------- torch backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rule", ["min_p=0.05", "top_k=5"])
def test_torch_backend_kept_chunks_give_the_same_bits_with_one_gemm_fewer(rule, dtype, monkeypatch):
    """Dense chunks: every chunk kept, only the first (a smaller last chunk would fit the cap's rest, but chunks are
    kept in forward order) or none; outputs and gradients equal bit for bit, and the backward recomputes exactly the
    chunks that were not kept (the kept ones' |S| check runs on the kept logits too)."""
    set_sparse_max_density(monkeypatch, 0.0)
    spy = GemmSpy(monkeypatch)
    params, targets = make_inputs(dtype)
    sizes = chunk_sizes("torch", rule, dtype)
    ref = run(spy, params, targets, rule, 0)
    assert ref[2] is None and spy.calls == {"forward": len(sizes), "backward": len(sizes)}
    for cap, kept in ((10**9, len(sizes)), (first_chunk_cap(sizes, dtype.itemsize), 1)):
        got = run(spy, params, targets, rule, cap)
        assert_same_bits(got, ref)
        assert spy.calls == {"forward": len(sizes), "backward": len(sizes) - kept}, cap
        assert got[2].reserved == sum(sizes[:kept]) * V * dtype.itemsize  # rows x V x itemsize a kept chunk
        assert len(got[2]) == 0  # every buffer handed over and dropped by the backward


def test_torch_backend_sparse_chunks_keep_their_logits_for_the_full_softmax_part(monkeypatch):
    """Stored (sparse) chunks whose rows' gradient leaves S (out-of-set targets, ``log_kept_mass``): their full-softmax
    part folds the kept logits instead of recomputing the chunk; with the RL loss nothing reads them, and the backward
    drops them all the same."""
    set_sparse_max_density(monkeypatch, 1.0)
    spy = GemmSpy(monkeypatch)
    params, targets = make_inputs(torch.float32)
    chunks = n_chunks("torch", "top_k=5", torch.float32)
    ref = run(spy, params, targets, "top_k=5", 0)
    assert not bool(ref[0].in_safe.all()) and spy.calls["backward"] == chunks  # every chunk has a leaving row
    got = run(spy, params, targets, "top_k=5", 10**9)
    assert_same_bits(got, ref)
    assert spy.calls["backward"] == 0 and len(got[2]) == 0
    ref = run(spy, params, targets, "top_k=5", 0, loss=rl_loss)
    got = run(spy, params, targets, "top_k=5", 10**9, loss=rl_loss)
    assert_same_bits(got, ref)
    assert spy.calls["backward"] == 0 and len(got[2]) == 0


def test_torch_backend_gives_back_a_stored_chunk_whose_targets_are_all_in_s(monkeypatch):
    """A stored chunk whose targets are all in ``S`` needs no logits in its backward (the sparse one): the forward
    gives its buffer back and keeps no further chunk (a fresh buffer and a copy each, for nothing: 5-12 % of a
    pruning rule's time on the CPU benchmark). With a ``log_kept_mass`` gradient the backward then recomputes those
    chunks, bit for bit the same."""
    set_sparse_max_density(monkeypatch, 1.0)
    spy = GemmSpy(monkeypatch)
    params, targets = make_inputs(torch.float32)
    hidden, weight, bias = params
    logits = (hidden @ weight.t() + bias).detach()
    targets = logits.argmax(-1)  # every target in S
    chunks = n_chunks("torch", "top_k=5", torch.float32)
    ref = run(spy, params, targets, "top_k=5", 0, loss=rl_loss)
    got = run(spy, params, targets, "top_k=5", 10**9, loss=rl_loss)
    assert bool(got[0].in_safe.all()) and chunks > 1
    assert_same_bits(got, ref)
    assert got[2] is None, "nothing kept once the forward ends"
    assert spy.calls["backward"] == 0  # the sparse backward reads no logits
    ref = run(spy, params, targets, "top_k=5", 0)  # mixed_loss: log_kept_mass has a gradient
    got = run(spy, params, targets, "top_k=5", 10**9)
    assert_same_bits(got, ref)
    assert spy.calls["backward"] == chunks  # given back, so recomputed for the full-softmax part


def test_torch_backend_checks_kept_sets_against_the_saved_size(monkeypatch):
    """The torch backend rebuilds ``S = {z >= t}`` from kept logits as from recomputed ones and checks it against the
    saved ``|S|``: a kept buffer whose boundary logit moved an ulp (as a nondeterministic GEMM would move it) is
    repaired from the saved size, as in test_core_regressions.py's recomputation case."""
    set_sparse_max_density(monkeypatch, 0.0)
    (hidden, weight, _), targets = make_inputs()
    out = fused_safe_logprobs(hidden, weight, targets, "top_k=3", keep_logits_bytes=10**9)
    store = op_node(out).kept_logits
    raw = store.take(0)  # one chunk: its GEMM output, which temperature 1 leaves as the logits
    kth = torch.topk(raw, 3).values[:, -1:]
    store.put(0, torch.where(raw == kth, torch.nextafter(raw, torch.full_like(raw, -torch.inf)), raw))
    (got,) = torch.autograd.grad(-(out.logprobs * out.in_safe).sum(), (hidden,))
    ref = fused_safe_logprobs(hidden, weight, targets, "top_k=3")
    (want,) = torch.autograd.grad(-(ref.logprobs * ref.in_safe).sum(), (hidden,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_second_backward_recomputes_and_gives_the_same_gradients(dtype, monkeypatch):
    """``retain_graph=True``: the first backward folds (and overwrites) the kept buffers, the second recomputes every
    chunk; both give the ``keep_logits_bytes=0`` gradients bit for bit."""
    set_sparse_max_density(monkeypatch, 0.0)
    check_second_backward(GemmSpy(monkeypatch), make_inputs(dtype), "min_p=0.05", "torch")


def check_second_backward(spy, inputs, rule, backend):
    params, targets = inputs
    hidden, weight, bias = params
    budget = chunk_bytes(backend, rule, hidden.dtype, 8)
    chunks = n_chunks(backend, rule, hidden.dtype)
    want = run(spy, params, targets, rule, 0, backend=backend)[1]
    out = fused_safe_logprobs(hidden, weight, targets, rule, bias=bias, compute_entropy=True, backend=backend,
                              max_chunk_bytes=budget, keep_logits_bytes=10**9)  # fmt: skip
    assert len(op_node(out).kept_logits) == chunks
    loss = mixed_loss(out)
    with spy.during("backward"):
        first = torch.autograd.grad(loss, params, retain_graph=True)
    first_gemms, store = spy.calls["backward"], op_node(out).kept_logits
    with spy.during("backward"):
        second = torch.autograd.grad(loss, params)
    for name, a, b, c in zip(("hidden", "weight", "bias"), first, second, want):
        assert torch.equal(a, c), f"first backward, grad {name}"
        assert torch.equal(b, c), f"second backward, grad {name}: the kept buffers hold the first one's gradient"
    assert (first_gemms, store, spy.calls["backward"]) == (0, None, chunks)  # dropped; the second one recomputes


def test_nothing_is_kept_where_no_backward_can_follow(monkeypatch):
    """No graph (``no_grad``, ``inference_mode``) or no input needing a gradient: no buffer is kept, whatever the cap."""
    kept = []
    put = KeptLogits.put
    monkeypatch.setattr(KeptLogits, "put", lambda self, start, buffer: (kept.append(start), put(self, start, buffer)))
    (hidden, weight, bias), targets = make_inputs()
    call = dict(bias=bias, max_chunk_bytes=chunk_bytes("torch", "none", hidden.dtype, 8), keep_logits_bytes=10**9)
    with torch.no_grad():
        fused_safe_logprobs(hidden, weight, targets, "none", **call)
    with torch.inference_mode():
        fused_safe_logprobs(hidden, weight, targets, "none", **call)
    call["bias"] = bias.detach()
    fused_safe_logprobs(hidden.detach(), weight.detach(), targets, "none", **call)
    assert kept == []
    fused_safe_logprobs(hidden, weight, targets, "none", **call)
    assert kept == [0, 8, 16]


@pytest.mark.parametrize(
    "value, error, message",
    [
        (-1, ValueError, "keep_logits_bytes=-1 is out of range: accepted an integer >= 0 (0: recompute)"),
        (1.5, TypeError, "keep_logits_bytes must be an integer, got float: 1.5"),
        (True, TypeError, "keep_logits_bytes must be an integer, got bool: True"),
        ("1", TypeError, "keep_logits_bytes must be an integer, got str: '1'"),
    ],
)
def test_keep_logits_bytes_is_checked_naming_the_argument(value, error, message):
    (hidden, weight, _), targets = make_inputs()
    with pytest.raises(error) as info:
        fused_safe_logprobs(hidden, weight, targets, "none", keep_logits_bytes=value)
    assert str(info.value) == message
