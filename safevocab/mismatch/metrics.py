"""The metric dictionaries the trainer logs (``{name: 0-dim fp32 tensor}``, optionally with item counts)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from safevocab.mismatch.common import (
    DEFAULT_BUCKETS,
    LOG_RATIO_BOUND,
    NAN,
    bucket_names,
    check_edges,
    check_mask,
    masked_max,
    masked_max_min,
    paired_log_ratio,
)
from safevocab.mismatch.formulas import bucket_counts_and_sums, chi2_terms, k3_terms, sequence_chi2
from safevocab.mismatch.row import MetricRow, counts_vector

_SEQ_KEYS = (
    "mismatch/training_ppl",
    "mismatch/rollout_ppl",
    "mismatch/log_ppl_diff",
    "mismatch/log_ppl_abs_diff",
    "mismatch/log_ppl_diff_max",
    "mismatch/log_ppl_diff_min",
    "mismatch/ppl_ratio",
    "mismatch/chi2_seq",
)

#: The keys of `mismatch_metrics`, in the order its values are computed.
_MISMATCH_KEYS = tuple(
    f"mismatch/{key}"
    for key in (
        "kl", "k3_kl", "chi2_token", "abs_logp_diff_mean", "abs_logp_diff_max", "training_ppl", "rollout_ppl",
        "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_seq",
    )
)  # fmt: skip


@torch.no_grad()  # diagnostics: logged, never differentiated
def mismatch_metrics(
    train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, return_counts: bool = False
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Training–inference mismatch on the sampled tokens (verl's definitions, prefix ``mismatch/``).

    With ``log r_t = log pi(y_t) - log mu(y_t)`` and ``gap_b`` of `log_ppl_gap`:

    - ``kl`` = ``mean_M (log mu - log pi)`` (k1 estimate of ``KL(mu || pi)``);
      ``k3_kl`` (`k3_kl`); ``chi2_token`` (`chi2_token`); ``chi2_seq`` (`chi2_sequence`);
    - ``training_ppl`` = ``mean_b exp(-mean_t log pi)``, ``rollout_ppl`` = ``mean_b exp(-mean_t log mu)``;
    - ``log_ppl_diff`` = ``mean_b gap_b``, ``log_ppl_abs_diff`` = ``mean_b |gap_b|``, ``log_ppl_diff_max`` /
      ``_min`` = ``max_b`` / ``min_b gap_b``, ``ppl_ratio`` = ``mean_b exp(gap_b)``;
    - ``abs_logp_diff_mean`` / ``_max`` = mean / max of ``|log r_t|`` over ``M``.

    Tokens whose rollout (or training) log-probability is NaN are left out.

    Args:
        train_logps: ``[B, T]`` training log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` rollout log-probabilities.
        mask: ``[B, T]`` bool or 0/1, the counted tokens.
        return_counts: also return the counts for `reduce_gathered`.

    Returns:
        ``{"mismatch/<key>": 0-dim fp32 tensor}`` for the keys above; with ``return_counts``, the pair
        ``(metrics, counts)`` where ``counts[key]`` is the number of tokens (token keys) or sequences (sequence
        keys) the value is computed over.
    """
    row = mismatch_row(*paired_log_ratio(train_logps, rollout_logps, mask))
    return row.dicts() if return_counts else row.dicts()[0]


#: For each key of `mismatch_metrics`: 1 if a sequence key (counted in sequences), else 0 (in tokens).
_MISMATCH_COUNT_PATTERN = tuple(int(key in _SEQ_KEYS) for key in _MISMATCH_KEYS)


def mismatch_row(train: torch.Tensor, rollout: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor) -> MetricRow:
    """`mismatch_metrics` as a :class:`~safevocab.mismatch.row.MetricRow`, from the ``[..., B, T]`` output of
    `~safevocab.mismatch.common.paired_log_ratio` (which `bucket_row` shares); leading dimensions (a stack of
    batches) give rows of ``[..., K]`` values, one per batch."""
    m = mask.double()
    # Token statistics (kl, k3_kl, chi2_token, mean |log r|), summed in one call.
    abs_log_r = log_r.abs()
    token_terms = torch.stack([rollout - train, k3_terms(log_r), chi2_terms(log_r), abs_log_r])
    token_means = (token_terms * m).sum(dim=(-2, -1)) / m.sum(dim=(-2, -1))
    # Sequence statistics over the rows with a counted token; gap_b as in log_ppl_gap.
    mean_train, mean_rollout, gap = (torch.stack([train, rollout, rollout - train]) * m).sum(-1) / m.sum(-1)
    rows = mask.any(-1)
    n_seq = rows.sum(-1)
    per_row = torch.stack([torch.exp(-mean_train), torch.exp(-mean_rollout), gap, gap.abs(), torch.exp(gap)])
    seq_means = torch.where(rows, per_row, 0.0).sum(-1) / n_seq
    abs_max = masked_max(abs_log_r, mask, dims=2)
    (gap_max,), (gap_min,) = masked_max_min([gap], rows, dims=1)
    values = torch.stack([
        token_means[0], token_means[1], token_means[2], token_means[3], abs_max,
        seq_means[0], seq_means[1], seq_means[2], seq_means[3], gap_max, gap_min, seq_means[4],
        sequence_chi2(log_r, m),
    ], dim=-1).float()  # fmt: skip
    counts = counts_vector(_MISMATCH_COUNT_PATTERN, mask.sum(dim=(-2, -1)), n_seq)
    return MetricRow(_MISMATCH_KEYS, values, counts)


@torch.no_grad()  # diagnostics: logged, never differentiated
def bucket_mismatch_metrics(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    edges: Sequence[float] = DEFAULT_BUCKETS,
    return_counts: bool = False,
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`bucket_mismatch` as a metric dictionary.

    For each bucket ``p=lo-hi``: ``mismatch/abs_diff/p=lo-hi`` (mean ``|log r|``), ``mismatch/diff/p=lo-hi``
    (mean signed ``log r``: its sign shows the direction of the bias) and ``mismatch/token_frac/p=lo-hi``
    (share of the counted tokens in the bucket). Empty buckets give NaN for the first two.

    Args:
        train_logps: ``[B, T]`` training log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` rollout log-probabilities (NaN where the engine reported none).
        mask: ``[B, T]`` bool or 0/1, the counted tokens.
        edges: inner bucket edges, strictly increasing in ``(0, 1)``.
        return_counts: also return the counts for `reduce_gathered`.

    Returns:
        ``{key: 0-dim fp32 tensor}``; with ``return_counts``, the pair ``(metrics, counts)``: the bucket's token
        count for ``abs_diff``/``diff``, all counted tokens for ``token_frac``.
    """
    row = bucket_row(*paired_log_ratio(train_logps, rollout_logps, mask), edges)
    return row.dicts() if return_counts else row.dicts()[0]


def bucket_row(
    train: torch.Tensor, rollout: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, edges: Sequence[float]
) -> MetricRow:
    """`bucket_mismatch_metrics` as a :class:`~safevocab.mismatch.row.MetricRow`, from the ``[..., B, T]`` output
    of `~safevocab.mismatch.common.paired_log_ratio` (``rollout`` is not used: ``log_r`` holds it); leading
    dimensions give rows of ``[..., K]`` values."""
    names, edges = _bucket_keys(tuple(edges))
    count, sums = bucket_counts_and_sums(train, log_r, mask, edges)
    count = count.double()
    total = count.sum(-1, keepdim=True)
    # Per bucket: abs_diff and diff (means over the bucket; 0/0 = NaN when empty) and token_frac (share of all).
    lead = count.shape[:-1]
    values = torch.stack([sums[0] / count, sums[1] / count, count / total], dim=-1).reshape(*lead, -1).float()
    counts = torch.stack([count, count, total.expand_as(count)], dim=-1).reshape(*lead, -1)
    return MetricRow(names, values, counts)


@functools.lru_cache(maxsize=32)
def _bucket_keys(edges: tuple[float, ...]) -> tuple[tuple[str, ...], list[float]]:
    """The keys of `bucket_mismatch_metrics` (per bucket: abs_diff, diff, token_frac) and the checked edges."""
    edges = check_edges(edges)
    kinds = ("abs_diff", "diff", "token_frac")
    keys = tuple(f"mismatch/{kind}/{name}" for name in bucket_names(edges) for kind in kinds)
    return keys, edges


_SAFE_SET_KEYS = tuple(
    f"safevocab/{key}"
    for key in ("out_of_set_frac", "pruned_mass_mean", "pruned_mass_max", "safe_size_mean", "seq_tv_estimate",
                "seq_kl_estimate", "safe_size_median", "safe_size_p99", "singleton_frac")
)  # fmt: skip


@torch.no_grad()  # diagnostics: logged, never differentiated
def safe_set_metrics(
    in_safe: torch.Tensor,
    log_kept_mass: torch.Tensor,
    safe_size: torch.Tensor,
    mask: torch.Tensor,
    return_counts: bool = False,
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Statistics of the trainer's safe set at the sampled positions (prefix ``safevocab/``).

    With ``m_t = 1 - exp(log_kept_mass_t)`` the pruned mass:

    - ``out_of_set_frac`` = ``mean_M 1[y_t not in S_t]``;
    - ``pruned_mass_mean`` / ``_max`` = mean / max of ``m_t`` over ``M``; ``safe_size_mean`` = ``mean_M |S_t|``,
      ``safe_size_median`` / ``safe_size_p99`` its 0.5 / 0.99 quantiles over ``M`` (linear interpolation, as
      ``numpy.quantile``; across processes, the count-weighted mean of each process's quantile:
      :data:`PER_PROCESS_QUANTILES`), ``singleton_frac``
      = ``mean_M 1[|S_t| = 1]`` (positions where the sampler had no choice);
    - ``seq_tv_estimate`` = ``1 - mean_b prod_t (1 - m_t)`` (unbiased for ``TV(P, Q)`` when rows are drawn from
      the pruned sampler ``Q``); ``seq_kl_estimate`` = ``mean_b sum_t -log(1 - m_t)`` (for ``KL(Q || P)``).

    Args:
        in_safe: ``[B, T]`` bool, the sampled token is in the trainer's safe set.
        log_kept_mass: ``[B, T]`` ``log(1 - m_t)``.
        safe_size: ``[B, T]`` ``|S_t|``.
        mask: ``[B, T]`` the completion tokens (before any out-of-set masking).
        return_counts: also return the counts for `reduce_gathered`.

    Returns:
        ``{"safevocab/<key>": 0-dim fp32 tensor}`` for the keys above; with ``return_counts``, the pair
        ``(metrics, counts)``: counted tokens for the token keys, rows ``B`` for the two sequence estimates.
    """
    row = safe_set_row(in_safe, log_kept_mass, safe_size, check_mask(mask, in_safe, log_kept_mass, safe_size))
    return row.dicts() if return_counts else row.dicts()[0]


#: Keys of `safe_set_metrics` that are quantiles of one process's positions: exact on one process; across processes
#: (and over a logging period's batches, as trl averages every metric) the count-weighted mean of those quantiles,
#: not the quantile of all positions together (an exact one would need every position gathered).
PER_PROCESS_QUANTILES: tuple[str, ...] = ("safevocab/safe_size_median", "safevocab/safe_size_p99")

#: For each key of `safe_set_metrics`: 1 if a sequence estimate (counted in rows), else 0 (in tokens).
_SAFE_SET_COUNT_PATTERN = tuple(int(key.startswith("safevocab/seq_")) for key in _SAFE_SET_KEYS)


def safe_set_row(
    in_safe: torch.Tensor, log_kept_mass: torch.Tensor, safe_size: torch.Tensor, mask: torch.Tensor
) -> MetricRow:
    """`safe_set_metrics` as a :class:`~safevocab.mismatch.row.MetricRow`, on ``[..., B, T]`` inputs of one shape
    (leading dimensions give rows of ``[..., K]`` values)."""
    mask = mask.to(torch.bool)
    m = mask.double()
    log_kept = log_kept_mass.double().clamp(max=0.0) * m
    pruned = -torch.expm1(log_kept)  # m_t, exactly 0 at padding
    n_seq = mask.shape[-2]
    if n_seq == 0:
        seq_tv = seq_kl = torch.full(mask.shape[:-2], NAN, dtype=torch.float64, device=mask.device)
    else:
        # Padding counts as kept mass 1 (docs/bounds.md, "Sequence-level bias"): log kept = 0 there. The sequence_tv / sequence_kl
        # formulas (unweighted), on log kept directly: no round trip through exp, no per-step input validation.
        seq_log_kept = log_kept.sum(dim=-1)
        seq_tv = (-torch.expm1(seq_log_kept)).mean(-1)
        seq_kl = (-seq_log_kept).mean(-1)
    pruned_max = masked_max(pruned, mask, dims=2)
    # the four token means in one reduction
    sizes = safe_size.double()
    terms = torch.stack([(~in_safe.bool()).double(), pruned, sizes, (sizes == 1).double()])
    means = (terms * m).sum(dim=(-2, -1)) / m.sum(dim=(-2, -1))
    counted_sizes = torch.where(mask, sizes, NAN).flatten(-2)  # NaN where not counted: nanquantile skips them
    if counted_sizes.shape[-1] == 0:  # no positions at all: undefined (nanquantile refuses an empty dimension)
        quantiles = torch.full((2, *mask.shape[:-2]), NAN, dtype=torch.float64, device=mask.device)
    else:
        q = torch.tensor([0.5, 0.99], dtype=torch.float64, device=mask.device)
        quantiles = torch.nanquantile(counted_sizes, q, dim=-1)
    values = torch.stack(
        [means[0], means[1], pruned_max, means[2], seq_tv, seq_kl, quantiles[0], quantiles[1], means[3]], dim=-1
    ).float()
    counts = counts_vector(_SAFE_SET_COUNT_PATTERN, mask.sum(dim=(-2, -1)), n_seq)
    return MetricRow(_SAFE_SET_KEYS, values, counts)


_IS_KEYS = tuple(
    f"mismatch/{key}"
    for key in ("is_raw_mean", "is_raw_min", "is_raw_max", "is_mean", "is_min", "is_max", "is_clipped_frac", "is_ess")
)


@torch.no_grad()  # diagnostics: logged, never differentiated
def importance_ratio_metrics(
    log_raw: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor, return_counts: bool = False
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Statistics of an importance-sampling correction, before and after truncation/masking.

    With raw ratios ``w_raw = exp(clamp(log_raw, ±LOG_RATIO_BOUND))`` and applied ratios ``w``:
    ``is_raw_mean``/``_min``/``_max`` (of ``w_raw``), ``is_mean``/``_min``/``_max`` (of ``w``),
    ``is_clipped_frac`` (share of entries truncated or masked) and ``is_ess`` = ``(sum w)^2 / (n sum w^2)``,
    the normalised effective sample size, all over the counted entries.

    Args:
        log_raw: raw log-ratio ``[B, T]`` (token level) or ``[B, 1]`` (sequence level).
        ratio: the corrected ratio, same shape.
        clipped: bool, same shape, the entry was truncated or masked.
        mask: ``[B, T]`` the tokens that count (a sequence counts when it has one).
        return_counts: also return the counts for `reduce_gathered` (the number of counted entries, for every key;
            ``is_ess`` is combined from its sums, see `reduce_gathered`).

    Returns:
        ``{"mismatch/<key>": 0-dim fp32 tensor}`` for the keys above; with ``return_counts``, the pair
        ``(metrics, counts)``.
    """
    row = importance_ratio_row(log_raw, ratio, clipped, mask)
    return row.dicts() if return_counts else row.dicts()[0]


def importance_ratio_row(
    log_raw: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor
) -> MetricRow:
    """`importance_ratio_metrics` as a :class:`~safevocab.mismatch.row.MetricRow`, on ``[..., B, T]`` (or
    ``[..., B, 1]``) inputs (leading dimensions give rows of ``[..., K]`` values)."""
    mask = mask.to(torch.bool)
    valid = mask if log_raw.shape == mask.shape else mask.any(dim=-1, keepdim=True)
    if log_raw.shape != valid.shape or ratio.shape != valid.shape or clipped.shape != valid.shape:
        raise ValueError(
            f"log_raw {tuple(log_raw.shape)}, ratio {tuple(ratio.shape)} and clipped {tuple(clipped.shape)} must be "
            f"[B, T] or [B, 1] for mask {tuple(mask.shape)}"
        )
    raw = torch.exp(log_raw.double().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    w = ratio.double()
    v = valid.double()
    n = v.sum(dim=(-2, -1))
    # Four sums in one reduction (raw, w, clipped, w^2), the four extremes in another.
    sum_raw, sum_w, sum_clipped, sum_w2 = (torch.stack([raw, w, clipped.double(), w.square()]) * v).sum(dim=(-2, -1))
    (raw_max, w_max), (raw_min, w_min) = masked_max_min([raw, w], valid, dims=2)
    ess = torch.where((n > 0) & (sum_w2 > 0), sum_w.square() / (n * sum_w2), NAN)
    row = [sum_raw / n, raw_min, raw_max, sum_w / n, w_min, w_max, sum_clipped / n, ess]
    values = torch.stack(row, dim=-1).float()
    return MetricRow(_IS_KEYS, values, counts_vector((0,) * len(_IS_KEYS), n))
