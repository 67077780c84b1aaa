"""Transformed logits with what several rules and the fused op's statistics share, computed at most once.

For logits ``z`` ``[..., V]`` with row maxima ``m``: ``e = exp(z - m)`` (the same arithmetic as ``torch.logsumexp``)
and ``sum_V e``; ``min_prob`` and ``top_p`` need them, and the fused op needs them for its statistics anyway.
"""

from __future__ import annotations

import torch

__all__ = ["ShiftedLogits"]


class ShiftedLogits:
    """Transformed logits ``z`` ``[..., V]`` with their row maxima ``m`` and, computed on first use, ``e = exp(z - m)``
    and ``sum_V e``: what several rules and the fused op's statistics share, computed once.

    ``out``: a preallocated buffer of ``z``'s shape and dtype for ``e`` (the fused op reuses one per chunk).
    ``sync_free``: the rules must not read the device (fixed shapes only: ``top_p`` sorts its rows instead of its
    radix select, leaves :attr:`cover` ``None`` and sets :attr:`near`); the same thresholds, except maybe on the rows
    :attr:`near` marks.
    """

    def __init__(self, z: torch.Tensor, z_max: torch.Tensor, out: torch.Tensor | None = None, sync_free: bool = False):
        self.z, self.z_max = z, z_max
        self.sync_free = sync_free
        self._out, self._exp, self._total = out, None, None
        #: ``(row, col, t)`` of ``z`` viewed as ``[rows, V]``, set by a rule that found its threshold ``t`` ``[rows]``
        #: from candidate entries: every entry with ``z >= t`` is among them (``top_p``), so any set ``{z >= t'}``
        #: with ``t' >= t`` can be read off them.
        self.cover: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        #: ``[rows]`` bool (``sync_free`` only), set by ``top_p``: rows whose sorted crossing lies within float64
        #: summation-order rounding of ``q T``, where the radix select's order of the same sums may decide otherwise.
        self.near: torch.Tensor | None = None

    @property
    def exp(self) -> torch.Tensor:
        """``exp(z - m)``, the same arithmetic as ``torch.logsumexp`` (``fl(z - m)``, then ``exp``)."""
        if self._exp is None:
            self._exp = (
                torch.sub(self.z, self.z_max, out=self._out).exp_()
                if self._out is not None
                else (self.z - self.z_max).exp_()
            )
        return self._exp

    @property
    def computed(self) -> bool:
        """Whether :attr:`exp` has been computed (by a rule)."""
        return self._exp is not None

    @property
    def total(self) -> torch.Tensor:
        """``sum_V exp(z - m)`` ``[..., 1]``."""
        if self._total is None:
            self._total = self.exp.sum(-1, keepdim=True)
        return self._total

    def kept_total(self, kept_from: torch.Tensor | None) -> torch.Tensor:
        """``sum exp(z - m)`` over ``{z >= kept_from}`` ``[..., 1]`` (all tokens for ``None``)."""
        if kept_from is None:
            return self.total
        return torch.where(self.z >= kept_from, self.exp, 0.0).sum(-1, keepdim=True)
