"""The backward's per-row coefficients, and the power-of-two shift that keeps an fp16 logits gradient in range.

:class:`Coefficients` holds, per row, what the logits gradient ``grad_z`` of every chunk is formed from (the upstream
gradients folded with ``in_safe``, and the forward statistics it needs); :func:`fp16_grad_shift` chooses the shift
``2^k`` an fp16 logits gradient is stored divided by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from safevocab.fused.row_stats import CallReads

__all__ = ["FP16_GRAD_PEAK", "Coefficients", "fp16_grad_shift"]


@dataclass
class Coefficients:
    """Per-row backward coefficients (each ``[N]``, stats dtype) and the forward statistics they need.

    ``grad_z = g_lp 1[a=y] - pi_S (c_S + g_H (log pi_S + H)) - c_F pi`` with
    ``c_S = g_lp 1[y in S] - g_k`` and ``c_F = g_lp 1[y not in S] + g_k`` (``g_k``: the
    ``log_kept_mass`` gradient); ``g_target_out = g_lp 1[y not in S]`` is the target term of the
    full-softmax part.

    ``grad_shift`` (a power of two, 1 unless the inputs are fp16): the backends write the logits gradient divided
    by it, so that it fits fp16 (:func:`fp16_grad_shift`), and :func:`safevocab.fused.grads.accumulate_chunk_grads`
    multiplies the products back in fp32 or exactly.

    ``reads``: the backward's device values, read together once (the rows whose gradient leaves ``S``, per forward
    chunk; a backend's own, queued by its ``queue_sparse_reads``); ``prepared``: what such a backend computed for
    them and uses again when it runs (the Triton backend's union ranks).
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
    reads: CallReads = field(default_factory=CallReads)
    prepared: dict[str, torch.Tensor] = field(default_factory=dict)

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
