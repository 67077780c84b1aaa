"""What a backend's forward writes: the max-shifted per-row statistics of every chunk, and a chunk's safe sets as CSR.

:class:`RowStats` holds the ``[N]`` outputs the fused op turns into log-probabilities (and saves for its backward);
:class:`SparseChunk` holds the safe sets of one chunk of rows whose ``S`` the forward stored for the sparse backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RowStats", "SparseChunk"]


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
