"""Argument validation shared by the whole ``safevocab`` package: one error style everywhere.

Every public entry point checks its arguments before any work and raises

- ``TypeError("<name> must be <kind>, got <type>: <value>")`` when the *type* is wrong, and
- ``ValueError("<name>=<value> is out of range: accepted <range>")`` when the value is.

A *real number* is any real scalar a user may hold: a Python ``int``/``float``, a numpy scalar
(``np.float32(0.1)``, ``np.int64(50)``), a 0-dim numpy array, or a 0-dim real ``torch.Tensor``
(``torch.tensor(0.7)``). Booleans are not numbers here (``True`` as a temperature is a bug). An
*integer* is the same with an integer type; floats are refused even when integral, as ``range`` does. A
*boolean* flag is ``True``/``False`` (a numpy or 0-dim torch bool too): ``"yes"``, ``1`` or ``None`` are refused,
since any of them would otherwise be read by truthiness. The functions return plain Python ``float``/``int``/``bool``
so that callers store hashable, printable values;
:func:`real_text` gives the shortest decimal of a real in the precision it was given in (``np.float32(0.1)``:
``"0.1"``, not the ``"0.10000000149011612"`` of its float64 value).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping

import torch

__all__ = [
    "real",
    "integer",
    "boolean",
    "check_range",
    "is_real_scalar",
    "require_keys",
    "real_text",
    "not_meta",
    "float_tensor",
    "raise_on_nan_or_inf_rows",
]


def _unwrap(value: object) -> object:
    """The Python scalar inside a 0-dim tensor or numpy array/scalar; ``value`` itself otherwise."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.dtype != torch.bool and not value.dtype.is_complex:
            return value.item()
        return value
    # numpy without importing it: numpy scalars and 0-dim arrays have ``ndim == 0`` and ``dtype.kind``
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if getattr(value, "ndim", None) == 0 and kind in ("i", "u", "f") and hasattr(value, "item"):
        return value.item()
    return value


def is_real_scalar(value: object) -> bool:
    """Whether ``value`` is a real number in the sense above (bool excluded; NaN and inf included)."""
    value = _unwrap(value)
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _describe(value: object) -> str:
    return f"{type(value).__name__}: {value!r}"


def check_range(name: str, value: object, ok: bool, accepted: str) -> None:
    """Raise ``ValueError("<name>=<value> is out of range: accepted <accepted>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range: accepted {accepted}")


def real(
    name: str,
    value: object,
    ok: Callable[[float], bool] | None = None,
    accepted: str = "a finite real number",
    *,
    finite: bool = True,
) -> float:
    """``value`` as a Python ``float`` after checking its type and range.

    Args:
        name: the argument's name, used in the message.
        value: the argument.
        ok: range predicate on the float (``None``: any value).
        accepted: the accepted range, in words, for the message.
        finite: also refuse NaN and infinities (default).

    Raises:
        TypeError: ``value`` is not a real number (a string, ``None``, a bool, a tensor with elements).
        ValueError: ``value`` is NaN/infinite (with ``finite``) or ``ok`` says no.
    """
    scalar = _unwrap(value)
    if not isinstance(scalar, numbers.Real) or isinstance(scalar, bool):
        raise TypeError(f"{name} must be a real number, got {_describe(value)}")
    as_float = float(scalar)
    good = (math.isfinite(as_float) or not finite) and (ok is None or ok(as_float))
    check_range(name, scalar, good, accepted)
    return as_float


def integer(
    name: str,
    value: object,
    ok: Callable[[int], bool] | None = None,
    accepted: str = "an integer",
) -> int:
    """``value`` as a Python ``int`` after checking its type and range (see :func:`real`).

    Raises:
        TypeError: ``value`` is not an integer (floats too, even integral ones; bools).
        ValueError: ``ok`` says no.
    """
    scalar = _unwrap(value)
    if not isinstance(scalar, numbers.Integral) or isinstance(scalar, bool):
        raise TypeError(f"{name} must be an integer, got {_describe(value)}")
    as_int = int(scalar)
    check_range(name, scalar, ok is None or ok(as_int), accepted)
    return as_int


def boolean(name: str, value: object) -> bool:
    """``value`` as a Python ``bool`` after checking its type: ``True``/``False``, a numpy bool or a 0-dim torch bool.

    Raises:
        TypeError: anything else (a string, ``None``, an int, a tensor with elements).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.bool:
        return bool(value.item())
    # numpy without importing it: a numpy bool scalar or 0-dim array has ``ndim == 0`` and ``dtype.kind == "b"``
    if getattr(value, "ndim", None) == 0 and getattr(getattr(value, "dtype", None), "kind", None) == "b":
        return bool(value.item())
    raise TypeError(f"{name} must be a bool (True or False), got {_describe(value)}")


def require_keys(name: str, mapping: object, keys: Iterable[str], accepted: str) -> None:
    """Check that ``mapping`` is a dict holding every key of ``keys`` (a saved state, a checkpoint's content).

    Raises:
        TypeError: ``mapping`` is not a mapping (``"<name> must be a dict, got <type>: <value>"``).
        ValueError: one line naming every missing key: ``"<name> lacks 'a', 'b': accepted <accepted>"``.
    """
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{name} must be a dict, got {_describe(mapping)}")
    missing = [key for key in keys if key not in mapping]
    if missing:
        raise ValueError(f"{name} lacks {', '.join(repr(key) for key in missing)}: accepted {accepted}")


def _narrow_float_dtype(value: object) -> torch.dtype | None:
    """The torch dtype of a 0-dim float32/float16/bfloat16 tensor or numpy value; ``None`` for anything else."""
    if isinstance(value, torch.Tensor):
        return (
            value.dtype if value.dim() == 0 and value.dtype in (torch.float32, torch.float16, torch.bfloat16) else None
        )
    dtype = getattr(value, "dtype", None)
    if getattr(value, "ndim", None) == 0 and getattr(dtype, "kind", None) == "f":
        return {4: torch.float32, 2: torch.float16}.get(getattr(dtype, "itemsize", 0))
    return None


def real_text(value: object) -> str:
    """The shortest decimal that gives back the real ``value`` in the precision it was given in.

    A Python ``float``/``int`` or a float64 value: ``repr(float(value))``. A float32/float16/bfloat16 value (numpy
    scalar or 0-dim array, 0-dim tensor): the shortest decimal that rounds back to it in that dtype, so
    ``np.float32(0.1)`` gives ``"0.1"`` (what the user wrote) while ``float(np.float32(0.1))`` is
    ``0.10000000149011612``. Call it on a value :func:`real` accepted.
    """
    as_float = float(_unwrap(value))  # type: ignore[arg-type]
    dtype = _narrow_float_dtype(value)
    if dtype is None or not math.isfinite(as_float):
        return repr(as_float)
    for digits in range(1, 18):
        text = repr(float(f"{as_float:.{digits}g}"))
        if torch.tensor(float(text), dtype=dtype).item() == as_float:
            return text
    return repr(as_float)  # pragma: no cover - 9 digits always round-trip a float32


def not_meta(name: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor on PyTorch's ``meta`` device (shapes without values): every check that reads a value would
    otherwise fail with torch's ``Tensor.item() cannot be called on meta tensors``.

    Raises:
        ValueError: ``"<name> is on the meta device (a shape without values): accepted a tensor with values"``.
    """
    if tensor.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device (a shape without values): accepted a tensor with values (cpu, cuda, ...)"
        )


def float_tensor(name: str, value: object, accepted: str = "a float dtype") -> None:
    """Refuse anything but a float tensor with values (an integer one would be compared or subtracted as rounded
    values without a word).

    Raises:
        TypeError: ``"<name> must be a torch.Tensor, got <type>"`` or ``"<name>.dtype=<dtype> is not accepted: accepted
            <accepted>"``.
        ValueError: a meta-device tensor (:func:`not_meta`).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name}.dtype={value.dtype} is not accepted: accepted {accepted}")
    not_meta(name, value)


def raise_on_nan_or_inf_rows(name: str, z: torch.Tensor, z_max: torch.Tensor) -> None:
    """One-line ``ValueError`` naming the first row of logits ``z`` ``[..., V]`` holding a NaN or ``+inf``, read off
    the row maxima ``z_max`` ``[..., 1]`` (``amax`` propagates NaN): the common case costs one small check."""
    bad = torch.isnan(z_max) | (z_max == math.inf)
    if not bool(bad.any()):
        return
    index = tuple(int(i) for i in bad.nonzero()[0][:-1])
    where = index[0] if len(index) == 1 else index
    what = "a NaN" if bool(torch.isnan(z[index]).any()) else "+inf"
    raise ValueError(f"{name} has {what} at row {where}: accepted finite logits or -inf")
