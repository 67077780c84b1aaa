"""Training–inference mismatch metrics (pure tensor functions, torch only).

Two engines score the same sampled tokens ``y_t``: the training engine (``log pi(y_t)``, "train") and the
rollout engine that sampled them (``log mu(y_t)``, "rollout"). Per token the log importance ratio is::

    log r_t = log pi(y_t) - log mu(y_t)

Definitions follow verl's rollout-correction diagnostics (``verl/trainer/ppo/rollout_corr_helper.py``):

| quantity | formula | function |
|---|---|---|
| log-ppl gap of sequence ``b`` | ``mean_t log mu - mean_t log pi`` | `log_ppl_gap` |
| k1 KL | ``mean_M (log mu - log pi)`` | `mismatch_metrics` |
| k3 KL | ``mean_M (r_t - log r_t - 1)`` | `k3_kl` |
| chi^2 (token) | ``mean_M (r_t - 1)^2`` (verl: ``mean_M r_t^2 - 1``, the same expectation) | `chi2_token` |
| chi^2 (sequence) | ``mean_b (prod_t r_t - 1)^2`` (verl: ``mean_b (prod_t r_t)^2 - 1``) | `chi2_sequence` |
| mismatch by probability bucket | ``mean |log r_t|``, ``mean log r_t`` over ``p_t = pi(y_t) in [lo, hi)`` | `bucket_mismatch` |
| safe-set disagreement | Jaccard ``|S^a ∩ S^b| / |S^a ∪ S^b|``, ``1[S^a != S^b]`` | `safe_set_disagreement` |
| logit perturbation size | ``eps_t = (max_i delta_i - min_i delta_i) / 2`` | `logit_perturbation_eps` |

``M`` is the set of counted tokens (a ``[B, T]`` mask); tokens whose log-probability is NaN (not reported by
an engine) are left out of ``M``. Log-ratios are clamped to ``±LOG_RATIO_BOUND`` (20, verl's ``SAFETY_BOUND``)
before exponentiation. Sums and means run in float64.

The ``*_metrics`` functions return ``{name: 0-dim fp32 tensor}`` dictionaries ready to log (NaN when a value is
undefined on the batch, e.g. an empty bucket); names ending in ``_max``/``/max`` (``_min``/``/min``) are meant to
be reduced across processes with max (min), others with the mean (`reduction`).

Across processes (data parallelism), a mean must be weighted by what it averages over, or the combined value is a
mean of means that depends on how the batch was split. With ``return_counts=True`` each ``*_metrics`` function
also returns, per key, the number of items the value is computed over (tokens, sequences, ratio entries);
`reduce_gathered` combines the gathered ``[processes, keys]`` values and counts into exactly the value one process
would compute on the whole batch (up to rounding): count-weighted means, max/min, and the effective sample size
from its sums.
"""

from safevocab.mismatch.common import DEFAULT_BUCKETS, LOG_RATIO_BOUND, bucket_names
from safevocab.mismatch.formulas import (
    BucketMismatch,
    SafeSetDisagreement,
    bucket_mismatch,
    chi2_sequence,
    chi2_token,
    k3_kl,
    log_ppl_gap,
    logit_perturbation_eps,
    safe_set_disagreement,
)
from safevocab.mismatch.metrics import (
    PER_PROCESS_QUANTILES,
    bucket_mismatch_metrics,
    importance_ratio_metrics,
    mismatch_metrics,
    safe_set_metrics,
)
from safevocab.mismatch.reduce import reduce_gathered, reduction
from safevocab.mismatch.row import MetricRow

__all__ = [
    "DEFAULT_BUCKETS",
    "LOG_RATIO_BOUND",
    "reduction",
    "bucket_names",
    "log_ppl_gap",
    "k3_kl",
    "chi2_token",
    "chi2_sequence",
    "BucketMismatch",
    "bucket_mismatch",
    "SafeSetDisagreement",
    "safe_set_disagreement",
    "logit_perturbation_eps",
    "mismatch_metrics",
    "bucket_mismatch_metrics",
    "safe_set_metrics",
    "PER_PROCESS_QUANTILES",
    "importance_ratio_metrics",
    "reduce_gathered",
    "MetricRow",
]
