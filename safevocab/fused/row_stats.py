"""What a backend's forward writes: the max-shifted per-row statistics of every chunk, a chunk's safe sets as CSR, and
the values the call reads on the host.

:class:`RowStats` holds the ``[N]`` outputs the fused op turns into log-probabilities (and saves for its backward);
:class:`SparseChunk` holds the safe sets of one chunk of rows whose ``S`` the forward stored for the sparse backward;
:class:`CallReads` gathers the device values a forward call decides on (its input checks, the chunks a backend stores)
and reads them with one host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["CallReads", "RowStats", "SparseChunk"]


class CallReads:
    """The device values one forward (or backward) call reads on the host, read together: one synchronisation a call.

    Each entry is a name, integer or bool values on the device (or a zero-argument function giving them, called at
    the read, after the kernels that write what it reads) and an optional check. :meth:`read` forms the pending
    entries and copies them to the host at once (``values``: name -> list of ints); a second :meth:`read` with nothing
    new queued reads nothing. :meth:`check` then runs the checks in the order they were added, each with its values
    (they raise on bad input). The fused op queues its input checks and the non-finite checks of the row statistics; a
    backend that must read the device in its forward (which chunks it stores) adds its own values and calls
    :meth:`read`, so its read is the op's too.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[str, torch.Tensor | Callable[[], torch.Tensor]]] = []
        self._checks: list[tuple[str, Callable[[list[int]], None]]] = []
        self._formed_by: dict[str, Callable[[], torch.Tensor]] = {}  # the entries given as functions, by name
        self.values: dict[str, list[int]] = {}

    def add(
        self,
        name: str,
        value: torch.Tensor | Callable[[], torch.Tensor],
        check: Callable[[list[int]], None] | None = None,
    ) -> None:
        """Queue ``value`` (integers or bools, any shape; or a function giving them at the read) under ``name``, with
        ``check`` to run on its values (:meth:`check`)."""
        self._pending.append((name, value))
        if callable(value):
            self._formed_by[name] = value
        if check is not None:
            self._checks.append((name, check))

    def again(self, *names: str) -> None:
        """Queue the entries ``names`` given as functions once more (the others are ignored): formed and read again at
        the next :meth:`read`, their checks then run on the new values. For a backend that changed what they read after
        the call's read (a chunk folded again)."""
        self._pending += [(name, self._formed_by[name]) for name in names if name in self._formed_by]

    def __contains__(self, name: str) -> bool:
        """Whether ``name`` is queued or read already."""
        return name in self.values or any(queued == name for queued, _ in self._pending)

    def read(self) -> dict[str, list[int]]:
        """Read every pending value with one copy to the host; returns ``values``."""
        if not self._pending:
            return self.values
        names, parts = [], []
        for name, value in self._pending:
            flat = (value() if callable(value) else value).reshape(-1).to(torch.int64)
            names.append((name, flat.numel()))
            parts.append(flat)
        self._pending.clear()
        parts = [part.to(parts[0].device) for part in parts]  # a caller's tensors on another device (CPU targets)
        flat = torch.cat(parts).tolist()  # host sync: the call's one read (its checks, the chunks a backend stores)
        at = 0
        for name, size in names:
            self.values[name] = flat[at : at + size]
            at += size
        return self.values

    def check(self) -> None:
        """Read (if anything is pending), then run the checks in the order they were added."""
        self.read()
        for name, check in self._checks:
            check(self.values[name])


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
    reads: CallReads = field(default_factory=CallReads)  # the call's one host read (the op's, a backend's values)

    @staticmethod
    def empty(
        n_rows: int,
        device: torch.device,
        dtype: torch.dtype,
        compute_entropy: bool,
        replay: bool = False,
        reads: CallReads | None = None,
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
            reads=CallReads() if reads is None else reads,
        )

    def rows(self, rows: slice) -> dict[str, torch.Tensor | None]:
        """Views of the rule fields on a row slice (keyword arguments of the forward kernel)."""
        skip = ("set_max", "target_shift_safe", "reads")
        return {name: (None if t is None else t[rows]) for name, t in vars(self).items() if name not in skip}
