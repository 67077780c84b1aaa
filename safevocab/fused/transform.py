"""The sampler's logit transform on a chunk of logits, and its chain rule back to the raw logits.

:class:`Transform` applies ``logit_scale``, then the softcap ``c * tanh(z / c)``, then ``/ temperature``, in place on a
scratch chunk (the torch backend's copy; the Triton kernels apply the same transform themselves,
:mod:`safevocab.kernels.common`), and turns a gradient with respect to the transformed logits into one with respect to
the raw ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Transform"]


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
