"""The errors the fused op raises from its forward's row statistics: non-finite input named by argument, and a
replayed support that keeps nothing.

Non-finite input is detected from the row statistics (a non-finite ``m`` or ``log sum_V``, and the weight's extremes),
which the op computes anyway, and raised as a one-line ``ValueError`` naming the argument
(:func:`raise_on_non_finite_rows`): finding *which* argument caused it runs only on that error path. The flags
(:func:`non_finite_flags`, and whether a replayed row keeps nothing) are read with the call's other checks, in its one
read of the device (:class:`~safevocab.fused.row_stats.CallReads`).
"""

from __future__ import annotations

import torch

from safevocab.fused.row_stats import RowStats
from safevocab.fused.transform import Transform
from safevocab.rules import SafeVocabRule

__all__ = ["EMPTY_SUPPORT", "non_finite_flags", "raise_on_empty_support", "raise_on_non_finite_rows"]

#: The name of the fused op's check of a replayed row that keeps nothing among the call's reads
#: (:class:`~safevocab.fused.row_stats.CallReads`; a backend that folds a chunk again forms it again).
EMPTY_SUPPORT = "empty support"


def raise_on_empty_support(safe_size: torch.Tensor, rule: SafeVocabRule, any_empty: bool | None = None) -> None:
    """One-line ``ValueError`` naming the first row whose replayed support keeps nothing (after the rule and
    the tokens of probability 0). ``any_empty``: whether one does, already read (``None``: read here)."""
    empty = safe_size == 0
    if any_empty is None:
        any_empty = bool(empty.any())  # host sync: a caller that has not read it (the materialised path)
    if any_empty:
        raise ValueError(
            f"support row {int(empty.nonzero()[0])} keeps no token of nonzero probability under rule {str(rule)!r}: "
            "accepted a support that meets the rule's set"
        )


def non_finite_flags(stats: RowStats, weight_range: torch.Tensor | None = None) -> torch.Tensor:
    """``[2]`` bool, on the device: some row's ``m`` or ``log sum_V`` is not finite; the weight's extremes
    (``weight_range``, ``None``: not checked) are not."""
    bad = ~(torch.isfinite(stats.row_max) & torch.isfinite(stats.log_sum_full))
    if weight_range is None:
        weight_bad = torch.zeros((), dtype=torch.bool, device=bad.device)
    else:
        weight_bad = ~torch.isfinite(weight_range).all()
    return torch.stack([bad.any(), weight_bad])


def raise_on_non_finite_rows(
    stats: RowStats,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: Transform,
    weight_range: torch.Tensor | None = None,
    flags: list[int] | None = None,
) -> None:
    """Raise a one-line ``ValueError`` naming the argument when a row's statistics are not finite.

    A NaN or ``+inf`` logit, an all ``-inf`` row or an overflowing GEMM or transform make the row maximum
    or ``log sum_V exp(z - m)`` non-finite; checking those ``[N]`` statistics costs nothing next to a pass
    over ``[N, V]``. Finding *which* argument caused it runs only here, on the error path.

    ``weight_range`` (the weight's minimum and maximum, read once per call): a ``-inf`` weight entry times positive
    hidden values gives a ``-inf`` logit, a banned token to the statistics, which stay finite; a non-finite extreme
    shows it (issue 37).

    ``flags``: :func:`non_finite_flags` already read (the fused op reads them with its other checks); ``None``: read
    here.
    """
    if flags is None:
        flags = non_finite_flags(stats, weight_range).tolist()  # host sync: one for both (a caller without flags)
    rows_bad, weight_bad = flags
    if not (rows_bad or weight_bad):
        return
    if not rows_bad:  # finite statistics: a -inf weight entry that made only -inf logits
        _raise_on_non_finite_weight(weight)
    bad = ~(torch.isfinite(stats.row_max) & torch.isfinite(stats.log_sum_full))
    row = int(bad.nonzero()[0])
    h = hidden[row]
    where = f"(row {row} of {hidden.shape[0]})"
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"hidden has a non-finite value (NaN or inf) {where}: accepted finite hidden states")
    _raise_on_non_finite_weight(weight)
    raw = h.double() @ weight.double().t()
    if bias is not None:
        raw = raw + bias.double()
        if not bool((bias != -torch.inf).any()):
            raise ValueError("bias is -inf for every token: no token has a probability > 0")
    limit = torch.finfo(hidden.dtype).max
    peak = float(raw[torch.isfinite(raw)].abs().max()) if bool(torch.isfinite(raw).any()) else 0.0
    if peak > limit:
        raise ValueError(
            f"hidden @ weight.T overflows {hidden.dtype} {where}: |logit| up to {peak:.4g} > {limit:.4g}; "
            "use bfloat16/float32 inputs (an fp32 LM head) for this model"
        )
    raise ValueError(
        f"temperature={transform.temperature!r} with logit_scale={transform.logit_scale!r} makes the logits overflow "
        f"{stats.row_max.dtype} {where}: |logit| up to {peak:.4g} gives |logit| * logit_scale / temperature > "
        f"{torch.finfo(stats.row_max.dtype).max:.4g}; accepted a larger temperature"
    )


def _raise_on_non_finite_weight(weight: torch.Tensor) -> None:
    finite_weight = torch.isfinite(weight).all(dim=-1)
    if not bool(finite_weight.all()):
        token = int((~finite_weight).nonzero()[0])
        raise ValueError(
            f"weight has a non-finite value (NaN or inf) in row {token} (token id): accepted finite weights"
        )
