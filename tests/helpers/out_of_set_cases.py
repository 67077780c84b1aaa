"""Random cases whose out-of-set rows receive a gradient, and the three checks of their fused gradients.

Shared by ``test_out_of_set_fuzz.py`` (torch backend) and ``test_kernels.py`` (Triton backend, which needs Triton's
interpreter set up before its first import). A case is drawn from a seed: continuous inputs (normal ``hidden``,
``weight`` scaled by 1, 3, 30 or 300 / sqrt(H): raw logits up to ~10^3, as in the audit's reproducer) or exact
dyadic ones (multiples of 1/8: the GEMM is exact in any layout), ``-inf`` bias entries, a rule whose sets are
small (so targets drawn uniformly are mostly outside ``S``), several chunks, the sparse backward forced (the path
whose full-softmax part recomputed rows on another layout) or, for a quarter of the cases, the dense one. The loss
is *not* masked by ``in_safe``: ``sum_r a_r logprob_r + b_r log_kept_mass_r``, ``a`` on a random subset of rows,
``b`` (the ``log_kept_mass`` gradient) on a third of the cases.

Per row the logits gradient is ``(logit_scale / T) u`` with ``u = a (1[v=y] - p~) + b (pi_S 1_S - pi)`` (``p~`` is
``pi_S`` or ``pi``): ``max_v |u| <= |a| + |b|`` and ``sum_v |u| <= 2 (|a| + |b|)``. Hence the *softmax bound*,
element-wise, ``s = logit_scale / T``::

    |dW[v, i]| <= s sum_r (|a_r| + |b_r|) |h[r, i]|
    |dh[r, i]| <= s 2 (|a_r| + |b_r|) max_v |W[v, i]|
    |db[v]|    <= s sum_r (|a_r| + |b_r|)

The checks (:func:`check_case`), each element-wise against that bound ``B``:

1. finite, and ``|got| <= B (1 + 2^-17)`` (``2^-17``: fp32 rounding of sums of at most a few dozen terms);
2. equal to the materialised path (``safe_log_softmax`` under autograd) on the *same* fp32 logits (computed with the
   forward's row slices, so only fp32 arithmetic separates the two): ``|got - want| <= 2^-17 B``, at every ``T``;
3. equal to the independent float64 reference (``safevocab_reference.py``) on the fp32-rounded logits within what
   fp32 rounding of the logits allows: the fp32 GEMM may put a transformed logit ``delta <= (H + 4) eps max|raw|
   logit_scale / T`` away from the reference's (0 for exact inputs), which moves every probability by a factor
   within ``exp(+-2 delta)``, so ``|got - want| <= (2 (exp(2 delta) - 1) + 2^-17) B``. A case with a row whose
   safe set such a ``delta`` could change (the reference's ambiguity check) is not compared.

fp16 at ``1 / T > 65504`` (issue 28 D6; :func:`fp16_near_tie_case`, :func:`check_fp16_case`): dyadic fp16 inputs
with a group of tokens one fp16 ulp apart, targets in it, a fixed bias that keeps it on top; where the float64
gradients of ``hidden`` and ``weight`` fit fp16, the fused ones must be finite and within ``2^-9`` of the softmax
bound of them (the logits gradient is rounded to fp16, 2^-11, before the GEMMs, and so is the result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from backward_path import sparse_max_density
from safevocab_reference import reference

from safevocab import fused_safe_logprobs, parse_rule, safe_log_softmax
from safevocab.backends import get_backend
from safevocab.logprobs import DEFAULT_MAX_CHUNK_BYTES

EPS32 = 2.0**-23
#: Element-wise tolerance of fp32 arithmetic, relative to the softmax bound.
ARITH_TOL = 2.0**-17
#: Rules as (key, value) parts, in the reference's terms; small sets, so most uniform targets fall outside S.
RULES = (
    [("top_k", 1)],
    [("top_k", 3)],
    [("top_p", 0.5)],
    [("min_p", 0.1)],
    [("min_p", 0.5)],
    [("min_prob", 0.05)],
    [("top_k", 4), ("min_p", 0.2)],
    [],  # S = V: only a log_kept_mass gradient reaches the full-softmax part (it cancels to 0)
)
WEIGHT_SCALES = (1.0, 3.0, 30.0, 300.0)


def rule_string(parts: list[tuple[str, float]]) -> str:
    return ",".join(f"{k}={v!r}" for k, v in parts) or "none"


@dataclass
class Case:
    seed: int
    hidden: torch.Tensor  # fp32 [N, H]
    weight: torch.Tensor  # fp32 [V, H]
    bias: torch.Tensor | None  # fp32 [V]
    targets: torch.Tensor
    parts: list[tuple[str, float]]
    temperature: float
    logit_scale: float
    exact: bool
    dense: bool | None  # force the dense (True) or sparse (False) backward; None: the library's choice
    max_chunk_bytes: int
    a: torch.Tensor  # [N] float64, logprobs gradient
    b: torch.Tensor  # [N] float64, log_kept_mass gradient
    bias_grad: bool = True  # whether the bias is a trained parameter

    @property
    def rule(self) -> str:
        return rule_string(self.parts)

    def __str__(self) -> str:
        return (
            f"seed {self.seed}: N={self.hidden.shape[0]} H={self.hidden.shape[1]} V={self.weight.shape[0]} "
            f"rule {self.rule} T={self.temperature:g} logit_scale={self.logit_scale:g} "
            f"{'exact' if self.exact else 'continuous'} {({True: 'dense', False: 'sparse'}).get(self.dense, 'default path')}"
        )


def draw_case(seed: int, temperature: float) -> Case:
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    n, h, v = randint(2, 9), randint(1, 8), randint(4, 40)
    exact = seed % 4 == 0
    if exact:
        hidden = torch.randint(-8, 9, (n, h), generator=g).float() / 8
        weight = torch.randint(-8, 9, (v, h), generator=g).float() / 8
    else:
        hidden = torch.randn(n, h, generator=g)
        weight = torch.randn(v, h, generator=g) * WEIGHT_SCALES[randint(0, 3)] / math.sqrt(h)
    bias = None
    if randint(0, 1):
        bias = torch.randint(-16, 17, (v,), generator=g).float() / 8 if exact else torch.randn(v, generator=g)
        bias[torch.randperm(v, generator=g)[: randint(0, v // 4)]] = -math.inf
    allowed = torch.arange(v) if bias is None else torch.isfinite(bias).nonzero().squeeze(-1)
    targets = allowed[torch.randint(0, allowed.numel(), (n,), generator=g)]
    raw = hidden @ weight.t() + (0 if bias is None else bias)
    targets = torch.where(torch.rand(n, generator=g) < 0.25, raw.argmax(-1), targets)  # some rows in S
    parts = RULES[randint(0, len(RULES) - 1)]
    logit_scale = 1.0 if randint(0, 1) else float(torch.rand(1, generator=g)) * 1.5 + 0.5
    a = torch.randn(n, generator=g, dtype=torch.float64) * (torch.rand(n, generator=g) < 0.7)
    b = torch.randn(n, generator=g, dtype=torch.float64) * (randint(0, 2) == 0 or not parts)
    rows_per_chunk = randint(1, 4)
    return Case(
        seed,
        hidden,
        weight,
        bias,
        targets,
        parts,
        temperature,
        logit_scale,
        exact,
        dense=seed % 4 == 3,
        max_chunk_bytes=rows_per_chunk * v * 8,
        a=a,
        b=b,
    )


def _loss(out, case: Case) -> torch.Tensor:
    """The unmasked loss ``sum_r a_r logprob_r + b_r log_kept_mass_r``, on the outputs' device."""
    a, b = case.a.to(out.logprobs.device), case.b.to(out.logprobs.device)
    return (out.logprobs.double() * a).sum() + (out.log_kept_mass.double() * b).sum()


def fused_grads(case: Case, backend: str, device: str = "cpu"):
    """The fused op's (dh, dW, db), on ``device``, with the case's backward path forced; and its outputs."""
    trained = (True, True, case.bias_grad)
    params = [
        None if x is None else x.detach().to(device).requires_grad_(train)
        for x, train in zip((case.hidden, case.weight, case.bias), trained)
    ]
    with sparse_max_density(None if case.dense is None else 0.0 if case.dense else 1.0):
        out = fused_safe_logprobs(
            params[0],
            params[1],
            case.targets.to(device),
            case.rule,
            bias=params[2],
            temperature=case.temperature,
            logit_scale=case.logit_scale,
            max_chunk_bytes=case.max_chunk_bytes,
            backend=backend,
        )
        grads = iter(torch.autograd.grad(_loss(out, case), [p for p in params if p is not None and p.requires_grad]))
    return tuple(next(grads).cpu() if p is not None and p.requires_grad else None for p in params), out


def forward_layout_logits(case: Case, backend: str, device: str = "cpu") -> torch.Tensor:
    """The raw fp32 logits as the fused forward computes them on ``device``: one GEMM per chunk of rows."""
    n, v = case.hidden.shape[0], case.weight.shape[0]
    chunk = get_backend(backend).rows_per_chunk(n, v, parse_rule(case.rule), 4, case.max_chunk_bytes)
    hidden, weight = case.hidden.to(device), case.weight.to(device)
    bias = None if case.bias is None else case.bias.to(device)
    with torch.no_grad():
        parts = []
        for start in range(0, n, chunk):
            h = hidden[start : start + chunk]
            parts.append(h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t()))
    return torch.cat(parts)


def materialised_grads(case: Case, backend: str, device: str = "cpu"):
    """``safe_log_softmax`` under autograd on the forward's own logits; (dh, dW, db) by the chain rule in float64;
    its outputs (on the CPU)."""
    logits = forward_layout_logits(case, backend, device).requires_grad_()
    out = safe_log_softmax(
        logits, case.targets.to(device), case.rule, temperature=case.temperature, logit_scale=case.logit_scale
    )
    (g,) = torch.autograd.grad(_loss(out, case), (logits,))
    g = g.double().cpu()
    grads = (g @ case.weight.double(), g.t() @ case.hidden.double(), None if case.bias is None else g.sum(0))
    return grads, SimpleNamespace(in_safe=out.in_safe.cpu(), safe_size=out.safe_size.cpu())


def logit_delta(case: Case) -> float:
    """Largest distance fp32 rounding may put a transformed logit from the reference's (0 for exact inputs)."""
    if case.exact:
        return 0.0
    size = case.hidden.double().abs() @ case.weight.double().abs().t()
    if case.bias is not None:
        size = size + case.bias.double().nan_to_num(neginf=0.0).abs()
    return (case.hidden.shape[1] + 4) * EPS32 * float(size.max()) * case.logit_scale / case.temperature


def reference_grads(case: Case):
    """The float64 reference on the fp32-rounded transformed logits (rounding not differentiated): (dh, dW, db),
    its outputs, and whether a row's set is ambiguous within :func:`logit_delta`."""
    h64, w64 = case.hidden.double().requires_grad_(), case.weight.double().requires_grad_()
    b64 = None if case.bias is None else case.bias.double().requires_grad_()
    raw = h64 @ w64.t() + (0 if b64 is None else b64)
    exact_z = raw * case.logit_scale / case.temperature
    rounded = ((raw.detach().float() * case.logit_scale) / case.temperature).double()  # the fp32 transform
    z = torch.where(torch.isfinite(rounded), exact_z + (rounded - exact_z).detach(), rounded)
    zmag = float(rounded[torch.isfinite(rounded)].abs().max())
    tol_z = 8 * EPS32 * (1 + zmag) + 4 * logit_delta(case)
    ref = reference(z, case.targets, case.parts, tol_z=tol_z, tol_p=1e-4, z_exact=exact_z.detach())
    params = [p for p in (h64, w64, b64) if p is not None]
    grads = torch.autograd.grad(_loss(ref, case), params)
    return ((*grads, None) if b64 is None else grads), ref


def softmax_bounds(case: Case):
    """Element-wise bounds of (dh, dW, db) (module docstring)."""
    s = case.logit_scale / case.temperature
    m = (case.a.abs() + case.b.abs()).unsqueeze(-1)  # [N, 1]
    h, w = case.hidden.double(), case.weight.double()
    bound_h = s * 2 * m * w.abs().amax(0, keepdim=True)  # [N, H]
    bound_w = s * (m * h.abs()).sum(0, keepdim=True).expand(w.shape[0], -1)  # [V, H]
    bound_b = None if case.bias is None else torch.full((w.shape[0],), s * float(m.sum()), dtype=torch.float64)
    return bound_h, bound_w, bound_b


@dataclass
class CaseResult:
    """Worst element-wise errors of one case, in units of the softmax bound (``None``: not compared)."""

    over_bound: float  # max |got| / B - 1
    vs_materialised: float | None
    vs_reference: float | None
    reference_tol: float


NAMES = ("hidden", "weight", "bias")


def check_case(case: Case, backend: str, device: str = "cpu") -> CaseResult:
    """Run the three checks of the module docstring; raise ``AssertionError`` naming the case on a failure."""
    got, out = fused_grads(case, backend, device)
    bounds = softmax_bounds(case)
    over = -1.0
    for name, g, bound in zip(NAMES, got, bounds):
        if g is None:
            continue
        g = g.double()
        assert bool(torch.isfinite(g).all()), f"{case}, {backend}: non-finite d{name} {g}"
        excess = (g.abs() - bound * (1 + ARITH_TOL)).max()
        ratio = float((g.abs() / bound.clamp_min(1e-300)).max())
        assert float(excess) <= 1e-30, f"{case}, {backend}: |d{name}| {ratio:.4g} x the softmax bound"
        over = max(over, ratio - 1)

    want, mat = materialised_grads(case, backend, device)
    vs_mat = None
    if torch.equal(mat.in_safe, out.in_safe.cpu()) and torch.equal(mat.safe_size, out.safe_size.cpu()):
        vs_mat = _worst(got, want, bounds)
        assert vs_mat <= ARITH_TOL, f"{case}, {backend}: off the materialised gradient by {vs_mat:.3g} x the bound"

    want, ref = reference_grads(case)
    delta = logit_delta(case)
    tol = 2 * math.expm1(min(2 * delta, 50.0)) + ARITH_TOL
    vs_ref = None
    if not ref.ambiguous and torch.equal(ref.in_safe, out.in_safe.cpu()):
        vs_ref = _worst(got, want, bounds)
        assert vs_ref <= tol, (
            f"{case}, {backend}: off the float64 reference by {vs_ref:.3g} x the bound (tolerance {tol:.3g}, "
            f"logit rounding delta {delta:.3g})"
        )
    return CaseResult(over, vs_mat, vs_ref, tol)


def _worst(got, want, bounds) -> float:
    worst = 0.0
    for g, w, bound in zip(got, want, bounds):
        if g is None:
            continue
        worst = max(worst, float(((g.double() - w.double()).abs() / bound.clamp_min(1e-300)).max()))
    return worst


def summary(backend: str, temperature: float, results: list[CaseResult]) -> str:
    """One line: the worst and median errors (in units of the softmax bound) and how many cases were compared."""

    def stats(values: list[float]) -> str:
        if not values:
            return "none compared"
        t = torch.tensor(values, dtype=torch.float64)
        return f"{len(values)} compared, median {float(t.median()):.2g}, max {float(t.max()):.2g}"

    mat = [r.vs_materialised for r in results if r.vs_materialised is not None]
    ref = [r.vs_reference for r in results if r.vs_reference is not None]
    tight = [r.vs_reference for r in results if r.vs_reference is not None and r.reference_tol <= ARITH_TOL]
    return (
        f"{backend} T={temperature:g}, {len(results)} cases: max |grad| / bound {1 + max(r.over_bound for r in results):.3g}; "
        f"vs materialised: {stats(mat)}; vs reference: {stats(ref)} ({len(tight)} of them exact inputs, at the tolerance 2^-17)"
    )


def run_cases(
    backend: str, temperature: float, count: int, first_seed: int = 0, device: str = "cpu"
) -> list[CaseResult]:
    """``count`` cases at ``temperature``; asserts the checks on each and that most were compared."""
    results = [check_case(draw_case(first_seed + i, temperature), backend, device) for i in range(count)]
    compared_mat = sum(r.vs_materialised is not None for r in results)
    compared_ref = sum(r.vs_reference is not None for r in results)
    print(summary(backend, temperature, results))
    # the same logits and the same rule code give the same sets (in-kernel thresholds may round an ulp apart)
    assert compared_mat >= 0.95 * count, f"only {compared_mat} of {count} cases had the materialised path's sets"
    assert compared_ref >= 0.5 * count, f"only {compared_ref} of {count} cases were unambiguous for the reference"
    return results


# ---------------------------------------------------------------------------------------------- fp16 at 1/T > 65504

#: fp16's resolution of the logits gradient (2^-11, rounded once for the GEMMs) and of the result (2^-11).
FP16_TOL = 2.0**-9


def audit_inputs(seed: int, n: int = 4, v: int = 26, h: int = 3, banned: int = 5):
    """The audit's generator (issue 28 N1): weights x300/sqrt(H), a -inf bias on ``banned`` ids, uniform targets."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 300 / math.sqrt(h)
    bias = torch.randn(v, generator=g)
    bias[torch.randperm(v, generator=g)[:banned]] = -math.inf
    allowed = torch.isfinite(bias).nonzero().squeeze(-1)
    targets = allowed[torch.randint(0, allowed.numel(), (n,), generator=g)]
    return hidden, weight, bias, targets


def audit_case(seed: int, temperature: float = 1e-6) -> Case:
    """The audit's reproducer: rule ``top_k=1``, a gradient on the log-probabilities of rows 0-2 only, the library's
    defaults (one chunk; its ``S`` is stored, so out-of-set rows take the full-softmax part)."""
    hidden, weight, bias, targets = audit_inputs(seed)
    a = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    return Case(
        seed,
        hidden,
        weight,
        bias,
        targets,
        [("top_k", 1)],
        temperature,
        1.0,
        exact=False,
        dense=None,
        max_chunk_bytes=DEFAULT_MAX_CHUNK_BYTES,
        a=a,
        b=torch.zeros(4, dtype=torch.float64),
    )


def d6_inputs():
    """Issue 28 D6: two tokens whose fp16 weights differ by one ulp (2^-10), logits 1/16 and 1/16 + 2^-14 (exact in
    fp16), the target the smaller one. At T = 1e-5 their logits gradients are +-0.998 / T = +-9.98e4 > 65504, while
    d/dh = 9.98e4 (W_0 - W_1) = -97.4 and d/dW = +-9.98e4 h = +-6237 fit fp16."""
    hidden = torch.tensor([[2.0**-4, 0.5]], dtype=torch.float16)
    weight = torch.tensor([[1.0, 0.0], [1.0 + 2.0**-10, 0.0], [-1.0, -1.0]], dtype=torch.float16)
    return hidden, weight, torch.tensor([0])


def fp16_near_tie_case(seed: int, temperature: float) -> Case:
    """fp16 dyadic inputs with a group of tokens whose weights are one fp16 ulp (2^-10) apart and targets in that
    group: at ``1 / T > 65504`` their logits gradients leave fp16's range while the gradients of ``hidden`` (a
    difference of near-equal weight rows) and of ``weight`` (times a small ``hidden``) may fit."""
    g = torch.Generator().manual_seed(seed)
    n, h, v = (int(torch.randint(lo, hi + 1, (1,), generator=g)) for lo, hi in ((1, 4), (1, 4), (3, 12)))
    weight = torch.randint(-8, 9, (v, h), generator=g).double() / 8
    group = torch.randperm(v, generator=g)[: int(torch.randint(2, 4, (1,), generator=g))]
    weight[group] = weight[group[0]] + torch.randint(-1, 2, (group.numel(), h), generator=g).double() * 2.0**-10
    # |h| <= 2^-3 at T = 1e-5, 2^-7 at T = 1e-6: dW = grad_z h may fit, and h 2^-10 / T is a gap of a few units
    scale = 2.0 ** round(math.log2(temperature * 2**13))
    hidden = torch.randint(-8, 9, (n, h), generator=g).double() / 8 * scale
    targets = group[torch.randint(0, group.numel(), (n,), generator=g)]
    bias = torch.full((v,), -1.0, dtype=torch.float64)
    bias[group] = 0.0  # the group holds the largest logits (|hidden @ weight.T| <= 1/2): the others have pi = 0
    parts = ([], [("min_p", 0.1)], [("top_k", 2)])[seed % 3]
    a = torch.randn(n, generator=g, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64) * (seed % 2)
    return Case(
        seed,
        hidden.half(),
        weight.half(),
        bias.half(),
        targets,
        parts,
        temperature,
        1.0,
        exact=True,
        dense=None,
        max_chunk_bytes=2**20,
        a=a,
        b=b,
        bias_grad=False,  # a fixed bias: db sums 1/T-sized entries over rows
    )


def fp16_reference_grads(case: Case):
    """(dh, dW) of the float64 reference on the library's logits: the fp16 GEMM's result (exact products, one
    rounding to fp16) divided by T in fp32; the largest |logits gradient|; the reference's outputs."""
    h64, w64 = case.hidden.double().requires_grad_(), case.weight.double().requires_grad_()
    raw = h64 @ w64.t() + case.bias.double()
    rounded = (raw.detach().half().float() / case.temperature).double()
    exact_z = raw / case.temperature
    z = exact_z + (rounded - exact_z).detach()
    ref = reference(z, case.targets, case.parts, tol_z=8 * EPS32 * (1 + float(rounded.abs().max())), tol_p=1e-4)
    dh, dw, draw = torch.autograd.grad(_loss(ref, case), (h64, w64, raw))
    return (dh, dw), float(draw.abs().max()), ref


def check_fp16_case(case: Case, backend: str, device: str = "cpu") -> bool | None:
    """Where the true gradients fit fp16 (with room for fp16 rounding), the fused ones are finite and within
    ``FP16_TOL`` x the softmax bound of them. Returns whether a logits gradient left fp16's range (the case
    exercises D6), or ``None`` when not compared (an ambiguous set, or true gradients beyond fp16)."""
    want, logits_grad, ref = fp16_reference_grads(case)
    if ref.ambiguous:
        return None
    bounds = softmax_bounds(case)[:2]
    room = 65504 - max(float((FP16_TOL * b).max()) for b in bounds)
    if max(float(w.abs().max()) for w in want) >= room:
        return None
    got, out = fused_grads(case, backend, device)
    assert torch.equal(out.in_safe.cpu(), ref.in_safe), f"{case}, {backend}: safe sets differ from the reference's"
    for name, g, w, bound in zip(NAMES, got, want, bounds):
        g = g.double()
        assert bool(torch.isfinite(g).all()), f"{case}, {backend}: non-finite fp16 d{name} {g} (float64: {w})"
        err = float(((g - w).abs() / bound.clamp_min(1e-300)).max())
        assert err <= FP16_TOL, f"{case}, {backend}: fp16 d{name} {g} off the float64 {w} by {err:.3g} x the bound"
    return logits_grad > 65504
