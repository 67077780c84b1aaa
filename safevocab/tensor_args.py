"""Validation of "tensor or number" arguments, shared by the functions on tensors (:mod:`safevocab.bounds`).

Such a function takes tensors or real scalars (Python, numpy, 0-dim tensors: :mod:`safevocab.validation`),
computes in the promoted floating dtype (at least fp32; fp64 for all-scalar calls), and returns a Python
``float`` when every input was a scalar. Out-of-range values raise a ``ValueError`` naming the argument,
the first bad value and its index; values a few ulps above 1 (a rounded softmax sum) are clamped.
"""

from __future__ import annotations

import numbers

import torch

from safevocab.validation import is_real_scalar

__all__ = [
    "TensorLike",
    "ROUNDING_ULPS",
    "is_number",
    "check_type",
    "first_bad",
    "rounding_tol",
    "compute_dtype",
    "device_of",
    "as_tensor",
    "broadcast",
    "check_probability",
    "check_kept_mass",
    "check_eps",
    "result_like",
]

TensorLike = torch.Tensor | int | float

# Probabilities and kept masses computed in floating point can land a few ulps above 1 (a softmax sum,
# ``exp`` of a rounded log). Values within this many machine epsilons of the limit are accepted and
# clamped; anything further out is an error.
ROUNDING_ULPS = 16


def is_number(x: object) -> bool:
    """A real scalar of any kind (Python, numpy, 0-dim tensor; not bool): :func:`safevocab.validation.is_real_scalar`."""
    return is_real_scalar(x)


def check_type(name: str, x: object, *, integer: bool = False) -> None:
    """Tensors must be floating (or integer when ``integer``); scalars must be real numbers (no bool)."""
    if isinstance(x, torch.Tensor):
        ok = (
            (not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool)
            if integer
            else x.dtype.is_floating_point
        )
        if not ok:
            kind = "an integer" if integer else "a floating-point"
            raise TypeError(f"{name} must be {kind} tensor, got dtype {x.dtype}")
        return
    if integer:
        if not isinstance(x, numbers.Integral) or isinstance(x, bool):
            raise TypeError(f"{name} must be an int or an integer tensor, got {type(x).__name__}: {x!r}")
        return
    if not is_number(x):
        raise TypeError(f"{name} must be a float or a floating-point tensor, got {type(x).__name__}: {x!r}")


def first_bad(name: str, x: torch.Tensor, bad: torch.Tensor, accepted: str) -> None:
    """Raise ``ValueError`` naming the first element of ``x`` where ``bad`` is True, if any."""
    if bool(bad.any()):
        flat = int(torch.nonzero(bad.reshape(-1))[0])
        value = x.reshape(-1)[flat].item()
        if x.dim() == 0:
            raise ValueError(f"{name}={value!r} is out of range: accepted {accepted}")
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x.shape))
        raise ValueError(f"{name} has value {value!r} at index {index}, out of range: accepted {accepted}")


def rounding_tol(dtype: torch.dtype) -> float:
    return ROUNDING_ULPS * torch.finfo(dtype).eps


def compute_dtype(*xs: object) -> torch.dtype:
    """The promoted floating dtype of the tensor arguments, at least float32 (float64 for all-scalars)."""
    tensors = [x for x in xs if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]
    if not tensors:
        return torch.float64
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.promote_types(dtype, torch.float32)


def device_of(*xs: object) -> torch.device:
    for x in xs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def as_tensor(x: TensorLike, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(dtype=dtype, device=device)
    return torch.tensor(float(x), dtype=dtype, device=device)


def broadcast(names: tuple[str, ...], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    try:
        return tuple(torch.broadcast_tensors(*xs))
    except RuntimeError:
        shapes = ", ".join(f"{n} {tuple(x.shape)}" for n, x in zip(names, xs))
        raise ValueError(f"shapes do not broadcast: {shapes}") from None


def float_inputs(**named: TensorLike) -> tuple[torch.dtype, tuple[torch.Tensor, ...]]:
    """Type-check float-or-tensor arguments, promote them to one dtype and device, and broadcast them.

    Returns ``(dtype, tensors)`` with the tensors in the keywords' order; errors name the argument.
    """
    for name, value in named.items():
        check_type(name, value)
    values = tuple(named.values())
    dtype, device = compute_dtype(*values), device_of(*values)
    return dtype, broadcast(tuple(named), *(as_tensor(v, dtype, device) for v in values))


def check_probability(name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``0 <= x <= 1`` (up to rounding above 1, which is clamped away)."""
    first_bad(name, x, ~((x >= 0) & (x <= 1 + rounding_tol(dtype))), f"0 <= {name} <= 1")
    return x.clamp(max=1.0)


def check_kept_mass(name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``0 < x <= 1`` (up to rounding above 1, which is clamped away)."""
    first_bad(name, x, ~((x > 0) & (x <= 1 + rounding_tol(dtype))), f"0 < {name} <= 1")
    return x.clamp(max=1.0)


def check_eps(name: str, x: torch.Tensor) -> torch.Tensor:
    first_bad(name, x, ~((x >= 0) & torch.isfinite(x)), f"finite {name} >= 0")
    return x


def result_like(out: torch.Tensor, *inputs: object) -> torch.Tensor | float:
    if all(not isinstance(x, torch.Tensor) for x in inputs):
        return float(out.item())
    return out
