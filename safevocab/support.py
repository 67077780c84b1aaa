"""Replayed safe supports: the exact token sets an inference engine sampled from, one row per position.

Recomputing ``S`` from a rule in the trainer leaves one source of support mismatch: under a different
precision the rule picks a slightly different set at its boundary. An engine that returns the ids that
survived its top-k/top-p/min-p (vLLM ``LLM(..., return_sampling_mask=True)`` ->
``CompletionOutput.sampling_mask``, a ``vllm.outputs.SamplingMask`` with ``token_ids: list[list[int]]``;
SGLang's ``return_sampling_mask``) removes it: :class:`SafeSupport` holds those sets, and
``safe_log_softmax(..., support=...)`` / ``fused_safe_logprobs(..., support=...)`` renormalise over exactly
them (intersected with a rule, if one is given too, and with the tokens of nonzero probability).

Storage is CSR: ``token_ids`` (flat, int64) and ``offsets`` (``[N + 1]``): row ``r`` keeps
``token_ids[offsets[r]:offsets[r + 1]]``. ``N`` rows align with the flattened targets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from safevocab.validation import integer, not_meta

__all__ = ["SafeSupport"]


def _fits_int64(x: int) -> bool:
    return -(2**63) <= x < 2**63


@dataclass(frozen=True)
class SafeSupport:
    """Kept token ids per position, as CSR.

    Building one validates it and keeps int64 copies of the two tensors (a later in-place write to the caller's
    tensors cannot reach the validated support), with what replaying it needs on the host.

    Attributes:
        token_ids: ``[nnz]`` int64 ids, the rows one after another.
        offsets: ``[N + 1]`` int64, non-decreasing, ``offsets[0] == 0``, ``offsets[-1] == nnz``.
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor
    # What replaying the support needs on the host, read once when it is built (building validates it, so it reads the
    # device anyway): the fused op then finds where a chunk's entries start and checks the ids against V with no read
    _host_offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)  # offsets, as Python ints
    _max_id: int = field(init=False, repr=False, compare=False)  # the largest id; -1 without entries

    def __post_init__(self) -> None:
        for name in ("token_ids", "offsets"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"SafeSupport.{name} must be a 1-D integer torch.Tensor, got {type(value).__name__}")
            if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                # dtype and shape only: printing the tensor wrote every id of a large support into the message
                raise TypeError(
                    f"SafeSupport.{name} must be a 1-D integer torch.Tensor, got a tensor of dtype "
                    f"{value.dtype} and shape {tuple(value.shape)}"
                )
            not_meta(f"SafeSupport.{name}", value)
            # its own copy: the host facts below describe these values, which the caller's tensors could leave
            object.__setattr__(self, name, value.to(torch.long, copy=True))
        host_offsets = self.offsets.to("cpu", torch.long, copy=True)  # host sync (a device support): its one copy
        nnz = self.token_ids.numel()
        if host_offsets.numel() < 1 or int(host_offsets[0]) != 0 or int(host_offsets[-1]) != nnz:
            raise ValueError(
                f"SafeSupport.offsets must start at 0 and end at len(token_ids)={nnz}, "
                f"got {host_offsets.tolist()[:3]}...{host_offsets.tolist()[-1:]}"
            )
        sizes = host_offsets.diff()
        if bool((sizes < 0).any()):
            raise ValueError(
                f"SafeSupport.offsets must be non-decreasing: row {int((sizes < 0).nonzero()[0])} has a negative size"
            )
        empty = sizes == 0
        if bool(empty.any()):
            raise ValueError(
                f"SafeSupport row {int(empty.nonzero()[0])} is empty: accepted at least one kept token id per row"
            )
        object.__setattr__(self, "_host_offsets", tuple(host_offsets.tolist()))
        min_id, max_id = torch.stack(torch.aminmax(self.token_ids)).tolist() if nnz else (0, -1)  # host sync
        if min_id < 0:
            row = int(self.row_of_entries()[(self.token_ids < 0).nonzero()[0]])
            raise ValueError(f"SafeSupport row {row} has a negative token id: accepted 0 <= id < vocab_size")
        object.__setattr__(self, "_max_id", max_id)
        self._check_duplicates()

    def __eq__(self, other: object) -> bool:
        """The same rows of the same ids in the same order, on the same device (the dataclass's own comparison asked
        a tensor of several values for its truth and raised)."""
        if not isinstance(other, SafeSupport):
            return NotImplemented
        return (
            self._host_offsets == other._host_offsets
            and self.token_ids.device == other.token_ids.device
            and torch.equal(self.token_ids, other.token_ids)
        )

    def __hash__(self) -> int:
        # from the host facts: equal supports hash alike, and hashing reads no device
        return hash((self._host_offsets, self._max_id))

    def __setstate__(self, state: dict) -> None:
        """Unpickling: a support pickled before it kept its host facts (2026-11-29) is validated and given them."""
        self.__dict__.update(state)
        if "_host_offsets" not in state or "_max_id" not in state:
            self.__post_init__()

    # ------------------------------------------------------------------------------------------ construction

    @staticmethod
    def from_lists(rows: Sequence[Sequence[int]], device: torch.device | str | None = None) -> SafeSupport:
        """From one list of kept token ids per position (any order, no duplicates, none empty)."""
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
            raise TypeError(f"rows must be a sequence of sequences of token ids, got {type(rows).__name__}")
        flat: list[int] = []
        offsets = [0]
        for r, row in enumerate(rows):
            if isinstance(row, (str, bytes)) or not isinstance(row, Iterable):
                raise TypeError(f"SafeSupport row {r} must be a sequence of token ids, got {type(row).__name__}")
            # int64 bounds here (torch's "Overflow when unpacking long long" named no row); negatives are named below
            flat.extend(
                integer(f"SafeSupport row {r} token id", t, _fits_int64, "0 <= id < vocab_size (an int64)") for t in row
            )
            offsets.append(len(flat))
        return SafeSupport(
            torch.tensor(flat, dtype=torch.long, device=device), torch.tensor(offsets, dtype=torch.long, device=device)
        )

    @staticmethod
    def from_vllm(sampling_masks: object, device: torch.device | str | None = None) -> SafeSupport:
        """From vLLM's ``CompletionOutput.sampling_mask`` (a ``vllm.outputs.SamplingMask`` whose ``token_ids`` hold
        one list of kept ids per generated token), or a list of them (completions one after another), aligned
        with the completion tokens."""
        masks = [sampling_masks] if hasattr(sampling_masks, "token_ids") else sampling_masks
        if isinstance(masks, (str, bytes)) or not isinstance(masks, Iterable):
            raise TypeError(f"sampling_masks must be a vLLM SamplingMask or a list of them, got {type(masks).__name__}")
        rows: list[Sequence[int]] = []
        for i, mask in enumerate(masks):
            token_ids = getattr(mask, "token_ids", None)
            if token_ids is None:
                raise TypeError(
                    f"sampling_masks[{i}] has no token_ids: expected a vllm.outputs.SamplingMask, got {type(mask).__name__}"
                )
            rows.extend(token_ids)
        return SafeSupport.from_lists(rows, device=device)

    # ------------------------------------------------------------------------------------------ views

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    @property
    def sizes(self) -> torch.Tensor:
        """``[N]`` int64 number of kept ids per row."""
        return self.offsets.diff()

    def row_of_entries(self) -> torch.Tensor:
        """``[nnz]`` the row of each entry of ``token_ids``."""
        rows = torch.arange(self.num_rows, device=self.offsets.device)
        # output_size: the entries' count is the ids' length, so the device is not read for it
        return torch.repeat_interleave(rows, self.offsets.diff(), output_size=self.token_ids.numel())

    def to(self, device: torch.device | str) -> SafeSupport:
        return SafeSupport(self.token_ids.to(device), self.offsets.to(device))

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """``[N, V]`` bool mask of the kept ids."""
        self.check(vocab_size)
        mask = torch.zeros(self.num_rows, vocab_size, dtype=torch.bool, device=self.token_ids.device)
        mask[self.row_of_entries(), self.token_ids] = True
        return mask

    def entry_starts(self, rows: Sequence[int]) -> list[int]:
        """``offsets[r]`` for each row index ``r`` in ``rows`` (``0..N``): where the entries of those rows start, from
        the host copy made when the support was built (no device read)."""
        return [self._host_offsets[r] for r in rows]

    def rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row index within the slice, token id)`` of the entries of the rows ``rows`` (a slice of ``0..N``)."""
        lo, hi = self.entry_starts((rows.start, rows.stop))
        local = self.offsets[rows.start : rows.stop + 1] - lo
        row = torch.repeat_interleave(
            torch.arange(rows.stop - rows.start, device=self.offsets.device), local.diff(), output_size=hi - lo
        )
        return row, self.token_ids[lo:hi]

    def dropped_mask_(self, rows: slice, out: torch.Tensor) -> torch.Tensor:
        """Write into the bool buffer ``out`` ``[n, V]`` which tokens of the rows ``rows`` are *not* kept."""
        out.fill_(True)
        row, ids = self.rows(rows)
        out[row, ids] = False
        return out

    # ------------------------------------------------------------------------------------------ checks

    def check(self, vocab_size: int, n_rows: int | None = None) -> None:
        """Raise a one-line ``ValueError`` naming the row when an id is ``>= vocab_size`` or the row count is not
        ``n_rows`` (the flattened targets)."""
        if n_rows is not None and n_rows != self.num_rows:
            raise ValueError(
                f"support has {self.num_rows} rows but the targets have {n_rows} positions: accepted one row per target"
            )
        if self._max_id >= vocab_size:  # the largest id, read when the support was built: no device read here
            too_big = self.token_ids >= vocab_size
            entry = int(too_big.nonzero()[0])
            row = int(self.row_of_entries()[entry])
            raise ValueError(
                f"SafeSupport row {row} has token id {int(self.token_ids[entry])}: accepted 0 <= id < vocab_size={vocab_size}"
            )

    def _check_duplicates(self) -> None:
        if self.token_ids.numel() < 2:
            return
        # Sort by (row, id) with two stable sorts instead of one sort of row * (max id + 1) + id: that key overflows
        # int64 for ids >= 2^62 and made distinct (row, id) pairs equal (a false duplicate).
        row = self.row_of_entries()
        order = torch.sort(self.token_ids, stable=True).indices
        order = order[torch.sort(row[order], stable=True).indices]
        sorted_row, sorted_id = row[order], self.token_ids[order]
        same = (sorted_row[1:] == sorted_row[:-1]) & (sorted_id[1:] == sorted_id[:-1])
        if bool(same.any()):
            entry = int(order[1:][same][0])
            raise ValueError(
                f"SafeSupport row {int(row[entry])} lists token id {int(self.token_ids[entry])} twice: accepted distinct ids"
            )
