"""A chunk's logits gradient into the input gradients: the two gradient GEMMs, accumulated in fp32.

:func:`accumulate_chunk_grads` adds ``grad @ weight`` to ``grad_hidden``, ``grad.T @ h`` to ``grad_weight`` and the
column sums to ``grad_bias`` (the :data:`Grads` a backward adds into), for every backend and every backward path that
forms a dense logits gradient; :func:`addmm_fp32` accumulates half-precision products in fp32 without rounding them
first, and :func:`gemm_operand_dtype` chooses the dtype the logits gradient enters the GEMMs in.
"""

from __future__ import annotations

import torch

__all__ = ["Grads", "UPCAST_BLOCK_BYTES", "accumulate_chunk_grads", "addmm_fp32", "gemm_operand_dtype"]

#: The gradients of ``(hidden, weight, bias)`` a backward adds into (``None``: not needed): ``[N, H]`` (fp32 for
#: half inputs, rounded once by the fused op), ``[V, H]`` and ``[V]`` accumulators.
Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def accumulate_chunk_grads(
    grad: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    rows: slice | torch.Tensor,
    grads: Grads,
    shift: float = 1.0,
    keep_fp32: bool = False,
) -> None:
    """Add a chunk's logits gradient ``shift * grad`` (``grad`` ``[n, V]``; ``shift``: ``Coefficients.grad_shift``)
    to the input gradients: ``grad @ weight`` into ``grad_hidden[rows]``, ``grad.T @ h`` into the fp32
    ``grad_weight`` (rounding each chunk's product to bf16 would bias training), column sums into ``grad_bias``.

    For half inputs ``grad_hidden`` is an fp32 buffer (``FusedSafeLogProbs`` allocates it and rounds it to the
    inputs' dtype once, at the end): the ``grad @ weight`` product is accumulated in fp32 (:func:`addmm_fp32`), as
    trl's ``_addmm_fp32`` does, not rounded to half precision and then added in half precision.

    ``keep_fp32``: an fp32 ``grad`` enters both GEMMs as it is, also on an accelerator (no bf16 operand): for a part
    of the gradient that must meet another part before it is rounded (the Triton backend's full-softmax part)."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_bias is not None:
        grad_bias.add_(grad.sum(0, dtype=grad_bias.dtype), alpha=shift)
    if not keep_fp32:
        grad = grad.to(gemm_operand_dtype(grad, h))
    side = _dw_side_stream(grad.device) if grad_weight is not None and grad_hidden is not None else None
    if side is not None:  # the dW GEMM overlaps the dX GEMM, then the chunk's buffer may be reused
        main = torch.cuda.current_stream(grad.device)
        side.wait_stream(main)  # grad, h and grad_weight as the main stream left them
        with torch.cuda.stream(side):
            _add_grad_weight(grad_weight, grad, h, shift)
        _add_grad_hidden(grad_hidden, grad, weight, rows, shift, keep_fp32)
        main.wait_stream(side)  # before the caller's next GEMM overwrites grad, and before grad_weight is read
        return
    if grad_hidden is not None:
        _add_grad_hidden(grad_hidden, grad, weight, rows, shift, keep_fp32)
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
    grad_hidden: torch.Tensor,
    grad: torch.Tensor,
    weight: torch.Tensor,
    rows: slice | torch.Tensor,
    shift: float,
    keep_fp32: bool = False,
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
        operand = grad.to(weight.dtype) if grad_hidden.device.type != "cpu" and not keep_fp32 else grad
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
