"""The policy's entropy over the full softmax and over the safe set (``log_entropy_metrics``).

trl logs ``entropy``, the mean entropy of the distribution the trainer scores, so under a pruning rule it is the
entropy of ``pi_S`` and under rule ``"none"`` that of the full softmax: the two cannot be compared across arms. With
``log_entropy_metrics`` the trainer logs both, per optimisation micro-batch from the loss's own forward (the policy
being trained), with ``M`` trl's loss mask (``completion_mask · tool_mask``) and ``z_t`` the transformed logits:

- ``safevocab/entropy_full`` = ``mean_M H(softmax(z_t))``, the full distribution's entropy (stock trl's ``entropy``);
- ``safevocab/entropy_kept`` = ``mean_M H(pi_S,t)``, the entropy renormalised over the safe set ``S_t`` (this
  trainer's ``entropy``; equal to ``entropy_full`` under rule ``"none"``).

Each is averaged over the tokens of all processes, as trl averages ``entropy``. The full one costs one more no-grad
LM-head pass when the rule prunes (:class:`~trl_integration.grpo.head.SafeHeadState`, ``full_entropy``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ENTROPY_FULL", "ENTROPY_KEPT", "EntropyCapture"]

ENTROPY_FULL = "safevocab/entropy_full"
ENTROPY_KEPT = "safevocab/entropy_kept"


class EntropyCapture:
    """The per-token entropies of the latest loss forward, logged once trl's loss of the micro-batch is done."""

    def __init__(self) -> None:
        self._entropies: tuple[torch.Tensor, torch.Tensor] | None = None

    def keep(self, kept: torch.Tensor | None, full: torch.Tensor | None) -> None:
        """The loss forward's ``[B, T]`` entropies of ``pi_S`` and of the full softmax (ignored when either is
        missing: a pass without entropies)."""
        if kept is not None and full is not None:
            self._entropies = (kept.detach(), full.detach())

    def log(self, metrics: dict, mask: torch.Tensor, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Append the masked means to ``metrics`` (trl's metric store of the mode), then forget the pass.

        ``reduce_sum`` sums a tensor over the processes (accelerate's ``reduce(..., "sum")``)."""
        entropies, self._entropies = self._entropies, None
        if entropies is None:
            return
        kept, full = entropies
        weight = mask.to(kept.dtype)
        local = torch.stack([(kept * weight).sum(), (full * weight).sum(), weight.sum()])
        kept_sum, full_sum, count = reduce_sum(local).tolist()
        if count > 0:
            metrics[ENTROPY_KEPT].append(kept_sum / count)
            metrics[ENTROPY_FULL].append(full_sum / count)
