"""Safe-set and training–inference mismatch metrics, re-exported from :mod:`safevocab.mismatch`.

The pure tensor functions live in the core package (torch only); this module keeps the names the trainer and
older code import from here. See :mod:`safevocab.mismatch` for the formulas and docs/metrics.md for the logged
keys.
"""

from __future__ import annotations

from safevocab.mismatch import (
    DEFAULT_BUCKETS,
    LOG_RATIO_BOUND,
    bucket_mismatch,
    bucket_mismatch_metrics,
    bucket_names,
    chi2_sequence,
    chi2_token,
    importance_ratio_metrics,
    k3_kl,
    log_ppl_gap,
    logit_perturbation_eps,
    mismatch_metrics,
    reduce_gathered,
    reduction,
    safe_set_disagreement,
    safe_set_metrics,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "LOG_RATIO_BOUND",
    "bucket_names",
    "reduction",
    "reduce_gathered",
    "safe_set_metrics",
    "mismatch_metrics",
    "bucket_mismatch_metrics",
    "importance_ratio_metrics",
    "bucket_mismatch",
    "log_ppl_gap",
    "k3_kl",
    "chi2_token",
    "chi2_sequence",
    "safe_set_disagreement",
    "logit_perturbation_eps",
]
