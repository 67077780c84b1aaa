"""Per-chunk building blocks shared by the fused op and its backends: the data that crosses them.

The fused op (:mod:`safevocab.fused_op`) walks ``[N, H]`` hidden states in chunks of rows, never
materialising ``[N, V]``. A backend (:mod:`safevocab.backends.torch_backend`, the Triton one in
:mod:`safevocab.backends.triton_backend`) folds each chunk's logits into per-row statistics and, in backward, turns a
recomputed chunk into its logits gradient. What they exchange lives here:

- :class:`Transform`: the sampler's logit transform (``logit_scale``, softcap, ``/ temperature``);
- :func:`chunk_slices` and :class:`ChunkLogits`: the row slices and the chunk GEMM, identical in forward and
  backward, so a recomputed chunk is bit-identical to the forward's; :func:`balanced_chunk_rows`: equal chunk sizes;
- :class:`RowStats`: the max-shifted per-row outputs of the forward; :class:`SparseChunk`: a chunk's safe
  sets stored as CSR; :class:`Coefficients`: the per-row backward coefficients;
- :func:`accumulate_chunk_grads`: a chunk's logits gradient into the input gradients (fp32 weight gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "FP16_GRAD_PEAK",
    "ChunkLogits",
    "Coefficients",
    "RowStats",
    "SparseChunk",
    "Transform",
    "accumulate_chunk_grads",
    "addmm_fp32",
    "balanced_chunk_rows",
    "chunk_slices",
    "forward_chunks_of",
    "fp16_grad_shift",
    "log_normalised",
]


@dataclass(frozen=True)
class Transform:
    """The sampler's logit transform: ``logit_scale``, then softcap, then ``/ temperature``.

    ``-inf`` logits stay ``-inf`` through the softcap (``c * tanh(-inf / c)`` would be the finite
    ``-c``): a token of probability 0 never enters ``S``.
    """

    temperature: float
    softcap: float | None
    logit_scale: float

    def apply_(self, z: torch.Tensor, neg_inf_cols: torch.Tensor | None = None) -> torch.Tensor:
        """In-place transform of a scratch chunk ``[n, V]``; ``neg_inf_cols``: columns whose raw logit is
        ``-inf`` in every row (a ``-inf`` bias entry), restored to ``-inf`` after a softcap."""
        if self.logit_scale != 1.0:
            z.mul_(self.logit_scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
            if neg_inf_cols is not None and neg_inf_cols.numel():
                z.index_fill_(-1, neg_inf_cols, -torch.inf)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z

    def softcap_derivative(self, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``1 - tanh^2`` of the softcap at transformed logits ``z`` into ``out`` (see :meth:`backward_`)."""
        torch.mul(z, self.temperature / self.softcap, out=out).square_().clamp_(max=1.0)
        return out.neg_().add_(1.0)

    def backward_(self, grad_z: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """In-place chain rule from transformed ``z`` back to raw logits.

        The softcap derivative ``1 - tanh^2`` is recovered from ``z`` itself
        (``tanh = z * temperature / softcap``), so no extra buffer of raw logits is kept. ``tanh^2`` is
        clamped to 1 (its true range), which makes the derivative 0, not ``-inf``, at ``-inf`` logits.
        """
        if self.softcap is not None:
            tanh_sq = (z * (self.temperature / self.softcap)).square_().clamp_(max=1.0)
            grad_z.mul_(tanh_sq.neg_().add_(1.0))
        scale = self.logit_scale / self.temperature
        if scale != 1.0:
            grad_z.mul_(scale)
        return grad_z


#: Row chunks are sized in multiples of this (:func:`balanced_chunk_rows`): the GEMMs of a chunk tile its rows by 128
#: (cuBLAS/CUTLASS output tiles on Hopper), so a chunk of ``128 k + 1`` rows runs a nearly idle extra tile row.
CHUNK_ROW_MULTIPLE = 128


def balanced_chunk_rows(n_rows: int, max_rows: int, multiple: int = CHUNK_ROW_MULTIPLE) -> int:
    """Rows per chunk for ``n_rows`` rows and at most ``max_rows`` a chunk: as few chunks as ``max_rows``-row ones
    (``n = ceil(n_rows / max_rows)``), of balanced sizes ``ceil(n_rows / n)`` rounded up to a multiple of
    ``multiple`` where that still fits ``max_rows`` (else left unrounded: rounding down would add a chunk).

    ``max_rows``-row chunks leave a short tail (8192 rows by 3533: 3533, 3533, 1126), a GEMM too small to fill the
    device; balanced ones do not (2816, 2816, 2560). Never more chunks than ``max_rows``-row ones, never more rows
    than ``max_rows``, never fewer than 1; ``n_rows <= max_rows`` gives one chunk of ``n_rows``.
    """
    max_rows = max(1, max_rows)
    if n_rows <= max_rows:
        return max(1, n_rows)
    n_chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // n_chunks)
    rounded = -(-rows // multiple) * multiple
    return rounded if rounded <= max_rows else rows


def chunk_slices(n_rows: int, chunk_rows: int) -> list[slice]:
    """The row slices of the chunks, identical in forward and backward."""
    return [slice(start, min(start + chunk_rows, n_rows)) for start in range(0, n_rows, chunk_rows)]


def forward_chunks_of(idx: torch.Tensor, n_rows: int, chunk_rows: int) -> list[tuple[slice, slice | torch.Tensor]]:
    """The forward chunks (:func:`chunk_slices`) holding the rows ``idx`` (ascending), each with the rows to fold:
    ``[(rows, at)]``, ``at`` the slice ``rows`` itself (the whole chunk, no gather) when ``idx`` holds at least half
    of its rows, else that chunk's part of ``idx``. The whole chunk is for callers to whose other rows the
    computation adds nothing (the full-softmax part: zero coefficients there)."""
    if idx.numel() == 0:
        return []
    chunk_of = torch.div(idx, chunk_rows, rounding_mode="floor")
    chunks, counts = torch.unique_consecutive(chunk_of, return_counts=True)
    out: list[tuple[slice, slice | torch.Tensor]] = []
    for chunk, part in zip(chunks.tolist(), idx.split(counts.tolist())):
        rows = slice(chunk * chunk_rows, min((chunk + 1) * chunk_rows, n_rows))
        out.append((rows, rows if 2 * part.numel() >= rows.stop - rows.start else part))
    return out


class ChunkLogits:
    """Computes transformed logits of a chunk of rows into one reused buffer (no page faults per chunk).

    Forward and backward build one each with the same ``rows`` and call it on the same row slices of
    ``hidden``, so a recomputed chunk is bit-identical to the forward's.
    """

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: Transform, rows: int
    ):
        self.weight_t, self.bias, self.transform = weight.t(), bias, transform
        stat = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        vocab = weight.shape[0]
        self.buf = torch.empty(rows, vocab, device=hidden.device, dtype=stat)
        self.raw = None if hidden.dtype == stat else torch.empty(rows, vocab, device=hidden.device, dtype=hidden.dtype)
        self.neg_inf_cols = None
        if bias is not None and transform.softcap is not None:
            self.neg_inf_cols = (bias == -torch.inf).nonzero().squeeze(-1)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        out = self.buf[:n] if self.raw is None else self.raw[:n]
        if self.bias is None:
            torch.mm(h, self.weight_t, out=out)
        else:
            torch.addmm(self.bias, h, self.weight_t, out=out)
        z = self.buf[:n]
        if self.raw is not None:
            z.copy_(out)  # the GEMM rounds to the inputs' dtype, exactly as materialised logits would be
        return self.transform.apply_(z, self.neg_inf_cols)


@dataclass
class SparseChunk:
    """The safe sets of one chunk of rows, as CSR: the shifted logits ``z - m`` at the kept columns.

    ``log pi_S = (z - m) - log sum_S exp(z - m)`` and, for the softcap derivative, ``z = (z - m) + m``
    are both recovered to ``z``'s own precision (storing ``log pi_S`` instead would lose ``z - m`` to
    the rounding of ``log sum_S``, which dominates when the logits are tiny, e.g. at large temperatures).
    """

    start: int
    counts: torch.Tensor  # [n] int64, |S| per row
    cols: torch.Tensor  # [nnz] int32
    shifted: torch.Tensor  # [nnz] stats dtype, z - m


@dataclass
class RowStats:
    """Per-row outputs of the forward (each ``[N]``), written chunk by chunk by a backend.

    Max-shifted: with ``m`` the row maximum of the transformed logits ``z``,
    ``lse_S = m + log_sum_safe`` and ``lse_V = m + log_sum_full``, but the sums are never formed, so
    ``z_y - lse_S`` keeps full precision when ``|m|`` is huge.

    A replayed set (``support=``) need not hold the argmax and may sit far below it: then ``S`` has its own
    shift ``m_S`` (``set_max``), ``log_sum_safe`` is ``log sum_S exp(z - m_S)`` and ``target_shift_safe`` is
    ``z_y - m_S``, while the full softmax keeps ``m``. Both stay ``None`` for rules (``m_S = m``).
    """

    target_shift: torch.Tensor  # z_y - m
    log_sum_safe: torch.Tensor  # log sum_S exp(z - m)
    log_sum_full: torch.Tensor  # log sum_V exp(z - m)
    row_max: torch.Tensor  # m
    threshold: torch.Tensor  # t: S = {z >= t}
    entropy: torch.Tensor | None  # H(pi_S)
    in_safe: torch.Tensor  # bool, z_y >= t
    safe_size: torch.Tensor  # int64, |S|
    set_max: torch.Tensor | None = None  # m_S (replay only)
    target_shift_safe: torch.Tensor | None = None  # z_y - m_S (replay only)

    @staticmethod
    def empty(
        n_rows: int, device: torch.device, dtype: torch.dtype, compute_entropy: bool, replay: bool = False
    ) -> RowStats:
        def new() -> torch.Tensor:
            return torch.empty(n_rows, device=device, dtype=dtype)

        return RowStats(
            target_shift=new(),
            log_sum_safe=new(),
            log_sum_full=new(),
            row_max=new(),
            threshold=new(),
            entropy=new() if compute_entropy else None,
            in_safe=torch.empty(n_rows, device=device, dtype=torch.bool),
            safe_size=torch.empty(n_rows, device=device, dtype=torch.int64),
            set_max=new() if replay else None,
            target_shift_safe=new() if replay else None,
        )

    def rows(self, rows: slice) -> dict[str, torch.Tensor | None]:
        """Views of the rule fields on a row slice (keyword arguments of the forward kernel)."""
        skip = ("set_max", "target_shift_safe")
        return {name: (None if t is None else t[rows]) for name, t in vars(self).items() if name not in skip}


@dataclass
class Coefficients:
    """Per-row backward coefficients (each ``[N]``, stats dtype) and the forward statistics they need.

    ``grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi`` with
    ``c_S = g_lp 1[y in S] - g_k`` and ``c_F = g_lp 1[y not in S] + g_k`` (``g_k``: the
    ``log_kept_mass`` gradient); ``g_target_out = g_lp 1[y not in S]`` is the target term of the
    full-softmax part.

    ``grad_shift`` (a power of two, 1 unless the inputs are fp16): the backends write the logits gradient divided
    by it, so that it fits fp16 (:func:`fp16_grad_shift`), and :func:`accumulate_chunk_grads` multiplies the
    products back in fp32 or exactly.
    """

    g_lp: torch.Tensor
    g_ent: torch.Tensor | None
    c_safe: torch.Tensor
    c_full: torch.Tensor
    g_target_out: torch.Tensor
    row_max: torch.Tensor
    set_max: torch.Tensor  # the shift of S: row_max for rules, the maximum over a replayed S
    log_sum_safe: torch.Tensor
    log_sum_full: torch.Tensor
    entropy: torch.Tensor | None
    threshold: torch.Tensor
    safe_size: torch.Tensor
    targets: torch.Tensor
    grad_shift: float = 1.0

    def logits_grad_bound(self) -> torch.Tensor:
        """``[N]``: a bound on ``|grad_z|`` of each row before the transform's chain rule (whose softcap factor is
        at most 1): ``|g_lp| + |c_S| + |c_F| + |g_H| (1/e + H)``, since ``pi, pi_S <= 1``,
        ``pi_S |log pi_S| <= 1/e`` and ``pi_S H <= H``."""
        bound = self.g_lp.abs() + self.c_safe.abs() + self.c_full.abs()
        if self.g_ent is not None:
            bound = bound + self.g_ent.abs() * (math.exp(-1.0) + self.entropy.abs())
        return bound


#: Largest magnitude an fp16 logits gradient is scaled to (65504 is fp16's largest finite number; the margin
#: absorbs the rounding of the kernels' fp32 arithmetic).
FP16_GRAD_PEAK = 2.0**14


def fp16_grad_shift(coef: Coefficients, grad_scale: float) -> float:
    """The power of two ``2^k >= 1`` that brings the fp16 logits gradient (``grad_scale``: the transform's
    ``logit_scale / temperature``) under :data:`FP16_GRAD_PEAK`, from :meth:`Coefficients.logits_grad_bound`.

    At ``1 / T > 65504`` the logits gradient itself overflows fp16 although the gradients of ``hidden`` and
    ``weight`` (its products with ``weight`` and ``hidden``) may fit: it is stored divided by ``2^k`` and the
    products multiplied back (exact: a power of two). ``1`` where it fits already, so ordinary temperatures
    keep the rounding they had."""
    if not coef.g_lp.numel():
        return 1.0
    peak = float(coef.logits_grad_bound().max()) * abs(grad_scale)
    if not math.isfinite(peak) or peak <= FP16_GRAD_PEAK:
        return 1.0  # a non-finite upstream gradient gives non-finite gradients whatever the shift
    return 2.0 ** math.ceil(math.log2(peak / FP16_GRAD_PEAK))


def accumulate_chunk_grads(
    grad: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    rows: slice | torch.Tensor,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    shift: float = 1.0,
) -> None:
    """Add a chunk's logits gradient ``shift * grad`` (``grad`` ``[n, V]``; ``shift``: ``Coefficients.grad_shift``)
    to the input gradients: ``grad @ weight`` into ``grad_hidden[rows]``, ``grad.T @ h`` into the fp32
    ``grad_weight`` (rounding each chunk's product to bf16 would bias training), column sums into ``grad_bias``.

    For half inputs ``grad_hidden`` is an fp32 buffer (``FusedSafeLogProbs`` allocates it and rounds it to the
    inputs' dtype once, at the end): the ``grad @ weight`` product is accumulated in fp32 (:func:`addmm_fp32`), as
    trl's ``_addmm_fp32`` does, not rounded to half precision and then added in half precision."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_bias is not None:
        grad_bias.add_(grad.sum(0, dtype=grad_bias.dtype), alpha=shift)
    grad = grad.to(gemm_operand_dtype(grad, h))
    side = _dw_side_stream(grad.device) if grad_weight is not None and grad_hidden is not None else None
    if side is not None:  # the dW GEMM overlaps the dX GEMM, then the chunk's buffer may be reused
        main = torch.cuda.current_stream(grad.device)
        side.wait_stream(main)  # grad, h and grad_weight as the main stream left them
        with torch.cuda.stream(side):
            _add_grad_weight(grad_weight, grad, h, shift)
        _add_grad_hidden(grad_hidden, grad, weight, rows, shift)
        main.wait_stream(side)  # before the caller's next GEMM overwrites grad, and before grad_weight is read
        return
    if grad_hidden is not None:
        _add_grad_hidden(grad_hidden, grad, weight, rows, shift)
    if grad_weight is not None:
        _add_grad_weight(grad_weight, grad, h, shift)


#: Private switch (issue 41): issue each chunk's dW GEMM on a side CUDA stream so that it overlaps the dX GEMM's tail
#: wave (FlashInfer's ``DW_STREAM``). Off until a device measurement shows it helps; never used off CUDA.
_DW_SIDE_STREAM = False
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _dw_side_stream(device: torch.device) -> torch.cuda.Stream | None:
    if not _DW_SIDE_STREAM or device.type != "cuda":
        return None
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def _add_grad_hidden(
    grad_hidden: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, rows: slice | torch.Tensor, shift: float
) -> None:
    """``grad_hidden[rows] += shift * grad @ weight``."""
    if grad_hidden.dtype == weight.dtype:  # fp32/fp64 inputs
        product = grad.to(grad_hidden.dtype) @ weight
        if shift != 1.0:
            product.mul_(shift)  # a power of two: exact, and finite wherever the true product fits its dtype
        if isinstance(rows, slice):
            grad_hidden[rows] += product
        else:
            grad_hidden.index_add_(0, rows, product)
    else:  # half inputs, fp32 buffer; on an accelerator the operand is the weight's dtype (tensor cores)
        operand = grad.to(weight.dtype) if grad_hidden.device.type != "cpu" else grad
        if isinstance(rows, slice):
            addmm_fp32(grad_hidden[rows], operand, weight, alpha=shift)
        else:
            product = torch.zeros(grad.shape[0], weight.shape[1], device=grad.device, dtype=grad_hidden.dtype)
            addmm_fp32(product, operand, weight, alpha=shift)
            grad_hidden.index_add_(0, rows, product)


def _add_grad_weight(grad_weight: torch.Tensor, grad: torch.Tensor, h: torch.Tensor, shift: float) -> None:
    """``grad_weight += shift * grad.T @ h`` (fp32/fp64 ``grad_weight``)."""
    if grad.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad.t(), h.to(grad.dtype), alpha=shift)
    elif shift != 1.0:  # fp16 at tiny temperatures only: the plain fp32 product, scaled
        grad_weight.addmm_(grad.t().to(grad_weight.dtype), h.to(grad_weight.dtype), alpha=shift)
    else:
        addmm_fp32(grad_weight, grad.t(), h)


def gemm_operand_dtype(grad: torch.Tensor, h: torch.Tensor) -> torch.dtype:
    """The dtype the logits gradient ``grad`` enters the two gradient GEMMs in.

    An fp32 ``grad`` (the torch backend's) with bf16 inputs on an accelerator is rounded to bf16 once, as the Triton
    backend and trl's kernel write it; the products still accumulate in fp32 (:func:`addmm_fp32`). Kept in fp32, the
    ``grad.T @ h`` GEMM ran as an fp32 SIMT kernel without tensor cores: 198 of the torch backend's 310 ms at
    N = 8192, V = 151936, H = 4096 on an H200. On a CPU (no tensor cores to gain) and for fp16 inputs (whose range
    a gradient at a tiny temperature can leave) ``grad`` stays as it is.
    """
    if grad.dtype == torch.float32 and h.dtype == torch.bfloat16 and grad.device.type != "cpu":
        return torch.bfloat16
    return grad.dtype


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """``acc += alpha * a @ b`` for an fp32/fp64 ``acc``, without rounding the product to half precision first.

    On CUDA half operands go through one mixed-dtype GEMM (``out_dtype=torch.float32``); elsewhere they are upcast,
    ``b`` in column blocks of at most :data:`UPCAST_BLOCK_BYTES` (``b`` may be the ``[V, H]`` weight)."""
    global _OUT_DTYPE_MM
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b, alpha=alpha)
        return
    if _OUT_DTYPE_MM and acc.device.type == "cuda" and acc.dtype == torch.float32 and a.dtype == b.dtype:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, alpha=alpha, out=acc)
            return
        except (TypeError, RuntimeError):  # torch without mixed-dtype addmm: the upcast below
            _OUT_DTYPE_MM = False
    a = a.to(acc.dtype)
    step = max(1, UPCAST_BLOCK_BYTES // max(1, b.shape[0] * acc.element_size()))
    if step >= b.shape[1]:
        acc.addmm_(a, b.to(acc.dtype), alpha=alpha)
        return
    for start in range(0, b.shape[1], step):
        acc[:, start : start + step].addmm_(a, b[:, start : start + step].to(acc.dtype), alpha=alpha)


#: Largest upcast copy of an operand :func:`addmm_fp32` makes at once where no mixed-dtype GEMM runs (CPU).
UPCAST_BLOCK_BYTES = 64 * 2**20
_OUT_DTYPE_MM = True


def log_normalised(
    z: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor, one_pass: bool = True
) -> torch.Tensor:
    """``(z - m) - log_sum`` as a new ``[n, V]`` tensor (``row_max``, ``log_sum``: ``[n, 1]``), max-shifted.

    The forward forms ``log_sum`` from ``fl(z - m)``; two passes reproduce that rounding exactly. With
    ``one_pass`` (sets that hold the argmax, so ``0 <= log_sum <= log V``), ``z - fl(m + log_sum)`` is used
    instead when forming ``m + log_sum`` rounds away less than an ulp of ``log_sum`` (ordinary temperatures):
    one pass over ``[n, V]`` instead of two, equal to fp32 rounding. At ``|m| ~ 1e7`` (tiny temperatures)
    ``m + log 3`` would lose the ``log 3`` that separates three tied logits, and a replayed set far below the
    maximum (``log_sum`` very negative) needs the forward's own rounding of ``z - m``: two passes then.
    """
    if one_pass:
        offset = row_max + log_sum
        exact = ((offset - row_max) - log_sum).abs() <= torch.finfo(log_sum.dtype).eps * (1 + log_sum.abs())
        if bool(exact.all()):
            return z - offset
    return (z - row_max).sub_(log_sum)
