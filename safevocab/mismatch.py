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
| chi^2 (token) | ``mean_M r_t^2 - 1`` | `chi2_token` |
| chi^2 (sequence) | ``mean_b (prod_t r_t)^2 - 1`` | `chi2_sequence` |
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

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from safevocab.bounds import sequence_kl, sequence_tv
from safevocab.rules import SafeVocabRule, parse_rule

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
    "importance_ratio_metrics",
    "reduce_gathered",
]

#: Default edges of the probability buckets of `bucket_mismatch` / `bucket_mismatch_metrics`.
DEFAULT_BUCKETS: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 0.5)

#: Log-ratios are clamped to +-this before exponentiation in chi^2, k3 and raw-ratio statistics (verl's SAFETY_BOUND).
LOG_RATIO_BOUND = 20.0

_NAN = float("nan")


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


def reduction(name: str) -> str:
    """How a metric is combined across processes, read from its name.

    Args:
        name: the metric key.

    Returns:
        ``"max"`` for names ending in ``_max`` or ``/max``, ``"min"`` for ``_min`` or ``/min``, else ``"mean"``.
    """
    if name.endswith(("_max", "/max")):
        return "max"
    if name.endswith(("_min", "/min")):
        return "min"
    return "mean"


def _scalar(x: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32).detach().reshape(())


def _count(n: torch.Tensor | int) -> torch.Tensor:
    """A count as a 0-dim float64 tensor (what `reduce_gathered` weighs a process's value by)."""
    return torch.as_tensor(n, dtype=torch.float64).detach().reshape(())


# The metrics run every training step on small tensors, where each torch call costs more than its arithmetic:
# the helpers below are branch-free (no host sync on a GPU) and compute several statistics per call.


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the 0/1 weights ``mask``; NaN (0/0) when nothing counts."""
    return _scalar((x.double() * mask).sum() / mask.sum())


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (``largest``) or min of ``x`` over ``mask``; NaN when nothing counts."""
    if x.numel() == 0:
        return _scalar(_NAN)
    mask = mask.bool()
    fill = -math.inf if largest else math.inf
    vals = torch.where(mask, x, fill)
    extreme = vals.amax() if largest else vals.amin()
    return _scalar(torch.where(mask.any(), extreme, _NAN))


def _check(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    for t in tensors:
        if t.shape != mask.shape:
            raise ValueError(f"tensor of shape {tuple(t.shape)} does not match mask shape {tuple(mask.shape)}")
    if mask.dim() != 2:
        raise ValueError(f"mask has shape {tuple(mask.shape)}: expected [B, T]")
    return mask.to(torch.bool)


def _pair(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor):
    """Validated float64 ``(train, rollout, log_r, mask)`` with NaN tokens removed from the mask and zeroed."""
    mask = _check(mask, train_logps, rollout_logps)
    mask = mask & ~torch.isnan(rollout_logps) & ~torch.isnan(train_logps)
    train = torch.where(mask, train_logps.double(), 0.0)
    rollout = torch.where(mask, rollout_logps.double(), 0.0)
    return train, rollout, train - rollout, mask


def _check_edges(edges: Sequence[float]) -> list[float]:
    edges = [float(e) for e in edges]
    if any(not (0.0 < e < 1.0) for e in edges) or any(a >= b for a, b in zip(edges[:-1], edges[1:])):
        raise ValueError(f"edges={edges}: accepted strictly increasing values in (0, 1)")
    return edges


def bucket_names(edges: Sequence[float]) -> list[str]:
    """Labels of the probability buckets ``[0, e_1), [e_1, e_2), ..., [e_k, 1]``.

    Args:
        edges: the inner bucket edges, strictly increasing in ``(0, 1)``.

    Returns:
        ``["p=0-e_1", "p=e_1-e_2", ..., "p=e_k-1"]``, the edges printed with ``%g``.
    """
    bounds = [0.0, *edges, 1.0]
    return [f"p={lo:g}-{hi:g}" for lo, hi in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------------------------------
# elementary quantities
# ----------------------------------------------------------------------------------------------------


def log_ppl_gap(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence log-perplexity gap between the rollout and the training engine.

    For sequence ``b`` with counted tokens ``M_b``::

        gap_b = mean_{t in M_b} log mu(y_t) - mean_{t in M_b} log pi(y_t)
              = log PPL_train(b) - log PPL_rollout(b)

    verl's ``log_ppl_diff`` is ``mean_b gap_b`` and ``log_ppl_abs_diff`` is ``mean_b |gap_b|``.

    Args:
        train_logps: ``[B, T]`` training log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` rollout log-probabilities (NaN where the engine reported none).
        mask: ``[B, T]`` bool or 0/1, the counted tokens.

    Returns:
        ``[B]`` float64 gaps in nats; NaN for a sequence without a counted token.
    """
    train, rollout, _, mask = _pair(train_logps, rollout_logps, mask)
    m = mask.double()
    counts = m.sum(-1)
    gap = ((rollout - train) * m).sum(-1) / counts
    return torch.where(counts > 0, gap, torch.full_like(gap, _NAN))


def k3_kl(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimator of ``KL(mu || pi)`` on tokens sampled from ``mu``: ``mean_M (r_t - log r_t - 1)``.

    With ``log r_t = log pi(y_t) - log mu(y_t)`` (clamped to ``±LOG_RATIO_BOUND``). Each term is ``>= 0``
    and ``E_mu[r - log r - 1] = KL(mu || pi)``.

    Args:
        train_logps: ``[B, T]`` training log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` rollout log-probabilities (NaN where the engine reported none).
        mask: ``[B, T]`` bool or 0/1, the counted tokens.

    Returns:
        A 0-dim fp32 tensor (NaN when no token counts).
    """
    _, _, log_r, mask = _pair(train_logps, rollout_logps, mask)
    return _masked_mean(_k3_terms(log_r), mask.double())


def _k3_terms(log_r: torch.Tensor) -> torch.Tensor:
    """Per-token ``r - log r - 1`` with ``log r`` clamped to ``±LOG_RATIO_BOUND`` (`k3_kl`)."""
    lr = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(lr) - lr - 1.0


def chi2_token(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level chi-square divergence estimate ``mean_M r_t^2 - 1`` (``E_mu[r^2] - 1 = chi^2(pi || mu)``).

    Args:
        train_logps: ``[B, T]`` training log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` rollout log-probabilities (NaN where the engine reported none).
        mask: ``[B, T]`` bool or 0/1, the counted tokens.

    Returns:
        A 0-dim fp32 tensor (NaN when no token counts); ``log r_t`` is clamped to ``±LOG_RATIO_BOUND``.
    """
    _, _, log_r, mask = _pair(train_logps, rollout_logps, mask)
    return _masked_mean(_chi2_terms(log_r), mask.double()) - 1.0


def _chi2_terms(log_r: torch.Tensor) -> torch.Tensor:
    """Per-token ``r^2`` with ``log r`` clamped to ``±LOG_RATIO_BOUND`` (`chi2_token`)."""
    return torch.exp(2.0 * log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def chi2_sequence(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence-level chi-square estimate ``mean_b (prod_{t in M_b} r_t)^2 - 1``.

    The product is taken as ``exp(sum_t log r_t)`` with the sum clamped to ``±LOG_RATIO_BOUND``; sequences
    without a counted token are left out.

    Args:
        train_logps: ``[B, T]`` training log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` rollout log-probabilities (NaN where the engine reported none).
        mask: ``[B, T]`` bool or 0/1, the counted tokens.

    Returns:
        A 0-dim fp32 tensor (NaN when no sequence counts).
    """
    _, _, log_r, mask = _pair(train_logps, rollout_logps, mask)
    return _scalar(_sequence_chi2(log_r, mask.double()))


def _sequence_chi2(log_r: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`chi2_sequence` from zero-filled ``log r`` and 0/1 weights, branch-free (NaN = 0/0 when no row counts)."""
    rows = m.sum(-1) > 0
    seq = (log_r * m).sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(rows, torch.exp(2.0 * seq), 0.0).sum() / rows.sum() - 1.0


@dataclass
class BucketMismatch:
    """Mismatch grouped by the training probability of the token (result of `bucket_mismatch`).

    Attributes:
        names: bucket labels ``"p=lo-hi"`` (`bucket_names`).
        lo: ``[K]`` float64 lower edges (inclusive).
        hi: ``[K]`` float64 upper edges (exclusive, the last one inclusive of 1).
        count: ``[K]`` int64 number of counted tokens in each bucket.
        abs_diff_mean: ``[K]`` float64 ``mean |log r_t|`` over the bucket (NaN when empty).
        diff_mean: ``[K]`` float64 ``mean log r_t`` over the bucket (NaN when empty); positive means the
            training engine gives those tokens more probability than the rollout engine.
    """

    names: list[str]
    lo: torch.Tensor
    hi: torch.Tensor
    count: torch.Tensor
    abs_diff_mean: torch.Tensor
    diff_mean: torch.Tensor

    @property
    def frac(self) -> torch.Tensor:
        """``[K]`` share of the counted tokens in each bucket (NaN when no token counts)."""
        total = self.count.sum()
        if total == 0:
            return torch.full(self.count.shape, _NAN, dtype=torch.float64)
        return self.count.double() / total


def bucket_mismatch(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    edges: Sequence[float] = DEFAULT_BUCKETS,
) -> BucketMismatch:
    """Mean ``|log r|`` and signed ``log r`` per bucket of training probability ``p_t = exp(log pi(y_t))``.

    Buckets are ``[0, e_1), [e_1, e_2), ..., [e_k, 1]``. For bucket ``B_j``::

        abs_diff_mean_j = mean_{t in M, p_t in B_j} |log pi(y_t) - log mu(y_t)|
        diff_mean_j     = mean_{t in M, p_t in B_j}  log pi(y_t) - log mu(y_t)

    The mismatch bound ``|log r| <= log(p + (1 - p) e^{2 eps})`` predicts the largest values in the
    lowest buckets.

    Args:
        train_logps: ``[B, T]`` training log-probabilities of the sampled tokens (any float dtype).
        rollout_logps: ``[B, T]`` rollout log-probabilities (NaN where the engine reported none).
        mask: ``[B, T]`` bool or 0/1, the counted tokens.
        edges: inner bucket edges, strictly increasing in ``(0, 1)``.

    Returns:
        A `BucketMismatch`.

    Raises:
        ValueError: on mismatched shapes or bad edges.
    """
    edges = _check_edges(edges)
    train, _, log_r, mask = _pair(train_logps, rollout_logps, mask)
    p = train.exp()
    k = len(edges) + 1
    # bucket j holds edges[j-1] <= p < edges[j]: bucketize with right=True; masked tokens go to an extra bin k
    inner = torch.tensor(edges, dtype=torch.float64, device=p.device)
    bucket = torch.where(mask, torch.bucketize(p, inner, right=True), k).flatten()
    count = torch.bincount(bucket, minlength=k + 1)[:k]
    sums = torch.stack(
        [torch.bincount(bucket, weights=w.flatten(), minlength=k + 1)[:k] for w in (log_r.abs(), log_r)]
    )
    means = (sums / count).cpu()  # 0/0 = NaN for an empty bucket
    return BucketMismatch(
        names=bucket_names(edges),
        lo=torch.tensor([0.0, *edges], dtype=torch.float64),
        hi=torch.tensor([*edges, 1.0], dtype=torch.float64),
        count=count.cpu(),
        abs_diff_mean=means[0],
        diff_mean=means[1],
    )


@dataclass
class SafeSetDisagreement:
    """Per-position comparison of the safe sets two engines pick (result of `safe_set_disagreement`).

    Attributes:
        jaccard: ``[...]`` float64 ``|S^a ∩ S^b| / |S^a ∪ S^b|`` in ``(0, 1]`` (1: identical sets).
        differs: ``[...]`` bool, ``S^a != S^b``.
        size_a: ``[...]`` int64 ``|S^a|``.
        size_b: ``[...]`` int64 ``|S^b|``.
    """

    jaccard: torch.Tensor
    differs: torch.Tensor
    size_a: torch.Tensor
    size_b: torch.Tensor

    def metrics(self, mask: torch.Tensor | None = None, prefix: str = "mismatch/safe_set_") -> dict[str, torch.Tensor]:
        """``{prefix}jaccard_mean``, ``{prefix}jaccard_min`` and ``{prefix}differ_frac`` over the positions of
        ``mask`` (all positions when ``None``), as 0-dim fp32 tensors (NaN when no position counts)."""
        m = torch.ones_like(self.differs) if mask is None else mask.to(torch.bool)
        if m.shape != self.differs.shape:
            raise ValueError(f"mask has shape {tuple(m.shape)}: accepted {tuple(self.differs.shape)}")
        return {
            f"{prefix}jaccard_mean": _masked_mean(self.jaccard, m.double()),
            f"{prefix}jaccard_min": _masked_extreme(self.jaccard, m, largest=False),
            f"{prefix}differ_frac": _masked_mean(self.differs.double(), m.double()),
        }


@torch.no_grad()
def safe_set_disagreement(
    logits_a: torch.Tensor, logits_b: torch.Tensor, rule: SafeVocabRule | str, temperature: float = 1.0
) -> SafeSetDisagreement:
    """How much the safe sets picked by one rule on two engines' logits differ, per position.

    Each engine applies ``rule`` to its own transformed logits (``z / temperature``), as a sampler and a
    trainer each do: ``S^a = rule(z^a)``, ``S^b = rule(z^b)``. Then::

        jaccard_t = |S^a_t ∩ S^b_t| / |S^a_t ∪ S^b_t|,      differs_t = 1[S^a_t != S^b_t]

    A sampled token in ``S^b`` but not in ``S^a`` is the out-of-set token the trainer has to mask.

    Args:
        logits_a: ``[..., V]`` logits of engine a (e.g. training), after any softcap/logit scale.
        logits_b: ``[..., V]`` logits of engine b (e.g. rollout), same shape.
        rule: a `safevocab.rules.SafeVocabRule` or rule string (``"min_p=0.01"``).
        temperature: divides both logits before the rule (> 0).

    Returns:
        A `SafeSetDisagreement` with ``[...]`` tensors.

    Raises:
        ValueError: on mismatched shapes or a non-positive temperature.
    """
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"logits_a {tuple(logits_a.shape)} and logits_b {tuple(logits_b.shape)} must match")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is out of range: accepted > 0")
    rule = parse_rule(rule)
    dtype = torch.float64 if torch.float64 in (logits_a.dtype, logits_b.dtype) else torch.float32
    keep_a = rule.keep_mask(logits_a.to(dtype) / temperature)
    keep_b = rule.keep_mask(logits_b.to(dtype) / temperature)
    inter = (keep_a & keep_b).sum(-1)
    union = (keep_a | keep_b).sum(-1)
    return SafeSetDisagreement(
        jaccard=inter.double() / union.clamp(min=1).double(),
        differs=inter != union,
        size_a=keep_a.sum(-1),
        size_b=keep_b.sum(-1),
    )


@torch.no_grad()
def logit_perturbation_eps(logits_a: torch.Tensor, logits_b: torch.Tensor, centered: bool = True) -> torch.Tensor:
    """Size ``eps_t`` of the logit perturbation ``delta = z^b - z^a`` at each position.

    A softmax does not change when a constant is added to all logits, so the smallest ``eps`` for which some
    shifted perturbation satisfies ``|delta_i - c| <= eps`` for every token ``i`` is::

        eps_t = (max_i delta_i - min_i delta_i) / 2        (centered=True)

    and the tight mismatch bound ``|log pi(a) - log mu(a)| <= log(p + (1 - p) e^{2 eps_t})``
    (`safevocab.bounds.logprob_mismatch_bound`) holds with it. ``centered=False`` gives the raw
    ``max_i |delta_i|`` (never smaller). Only finite logits are compared (``-inf`` on both sides is ignored).

    Args:
        logits_a: ``[..., V]`` logits of engine a, after any transform both engines share.
        logits_b: ``[..., V]`` logits of engine b, same shape.
        centered: use the shift-invariant size (default) or the raw maximum.

    Returns:
        ``[...]`` float64 ``eps_t >= 0``.

    Raises:
        ValueError: on mismatched shapes.
    """
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"logits_a {tuple(logits_a.shape)} and logits_b {tuple(logits_b.shape)} must match")
    a, b = logits_a.double(), logits_b.double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    delta = torch.where(finite, b - a, 0.0)
    if not centered:
        return delta.abs().amax(-1)
    hi = torch.where(finite, delta, -math.inf).amax(-1)
    lo = torch.where(finite, delta, math.inf).amin(-1)
    return torch.where(finite.any(-1), (hi - lo) / 2.0, torch.zeros_like(hi))


# ----------------------------------------------------------------------------------------------------
# metric dictionaries (what the trainer logs)
# ----------------------------------------------------------------------------------------------------

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
    train, rollout, log_r, mask = _pair(train_logps, rollout_logps, mask)
    m = mask.double()
    # Token statistics (kl, k3_kl, chi2_token, mean |log r|), summed in one call.
    token_terms = torch.stack([rollout - train, _k3_terms(log_r), _chi2_terms(log_r), log_r.abs()])
    token_means = ((token_terms * m).sum(dim=(1, 2)) / m.sum()).float()
    # Sequence statistics over the rows with a counted token; gap_b as in log_ppl_gap.
    mean_train, mean_rollout, gap = (torch.stack([train, rollout, rollout - train]) * m).sum(-1) / m.sum(-1)
    rows = mask.any(-1)
    n_seq = rows.sum()
    per_row = torch.stack([torch.exp(-mean_train), torch.exp(-mean_rollout), gap, gap.abs(), torch.exp(gap)])
    seq_means = (torch.where(rows, per_row, 0.0).sum(-1) / n_seq).float()
    out = {
        "mismatch/kl": token_means[0],
        "mismatch/k3_kl": token_means[1],
        "mismatch/chi2_token": token_means[2] - 1.0,
        "mismatch/abs_logp_diff_mean": token_means[3],
        "mismatch/abs_logp_diff_max": _masked_extreme(log_r.abs(), mask, largest=True),
        "mismatch/training_ppl": seq_means[0],
        "mismatch/rollout_ppl": seq_means[1],
        "mismatch/log_ppl_diff": seq_means[2],
        "mismatch/log_ppl_abs_diff": seq_means[3],
        "mismatch/log_ppl_diff_max": _masked_extreme(gap, rows, largest=True),
        "mismatch/log_ppl_diff_min": _masked_extreme(gap, rows, largest=False),
        "mismatch/ppl_ratio": seq_means[4],
        "mismatch/chi2_seq": _scalar(_sequence_chi2(log_r, m)),
    }
    if not return_counts:
        return out
    n_tok, n_seq = _count(mask.sum()), _count(n_seq)
    return out, {k: n_seq if k in _SEQ_KEYS else n_tok for k in out}


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
    b = bucket_mismatch(train_logps, rollout_logps, mask, edges)
    # One conversion of each [K] vector, then views of it (one tensor per key costs more than the statistics).
    abs_diff, diff, frac = torch.stack([b.abs_diff_mean, b.diff_mean, b.frac]).float()
    bucket_counts = b.count.double()
    out: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    total = _count(b.count.sum())
    for j, name in enumerate(b.names):
        out[f"mismatch/abs_diff/{name}"] = abs_diff[j]
        out[f"mismatch/diff/{name}"] = diff[j]
        out[f"mismatch/token_frac/{name}"] = frac[j]
        counts[f"mismatch/abs_diff/{name}"] = counts[f"mismatch/diff/{name}"] = bucket_counts[j]
        counts[f"mismatch/token_frac/{name}"] = total
    return (out, counts) if return_counts else out


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
    - ``pruned_mass_mean`` / ``_max`` = mean / max of ``m_t`` over ``M``; ``safe_size_mean`` = ``mean_M |S_t|``;
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
    mask = _check(mask, in_safe, log_kept_mass, safe_size)
    m = mask.double()
    log_kept = log_kept_mass.double().clamp(max=0.0) * m
    pruned = -torch.expm1(log_kept)  # m_t, exactly 0 at padding
    if mask.shape[0] == 0:
        seq_tv = seq_kl = _scalar(_NAN)
    else:
        # Padding counts as kept mass 1 (DESIGN section 4).
        kept = log_kept.exp()
        seq_tv = _scalar(sequence_tv(kept, mask))
        seq_kl = _scalar(sequence_kl(kept, mask))
    out = {
        "safevocab/out_of_set_frac": _masked_mean((~in_safe.bool()).double(), m),
        "safevocab/pruned_mass_mean": _masked_mean(pruned, m),
        "safevocab/pruned_mass_max": _masked_extreme(pruned, mask, largest=True),
        "safevocab/safe_size_mean": _masked_mean(safe_size.double(), m),
        "safevocab/seq_tv_estimate": seq_tv,
        "safevocab/seq_kl_estimate": seq_kl,
    }
    if not return_counts:
        return out
    n_tok, n_seq = _count(mask.sum()), _count(mask.shape[0])
    return out, {k: n_seq if k.startswith("safevocab/seq_") else n_tok for k in out}


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
    n = v.sum()
    sum_w = (w * v).sum()
    sum_w2 = (w.square() * v).sum()
    ess = _scalar(sum_w.square() / (n * sum_w2)) if n > 0 and sum_w2 > 0 else _scalar(_NAN)
    out = {
        "mismatch/is_raw_mean": _masked_mean(raw, v),
        "mismatch/is_raw_min": _masked_extreme(raw, valid, largest=False),
        "mismatch/is_raw_max": _masked_extreme(raw, valid, largest=True),
        "mismatch/is_mean": _masked_mean(w, v),
        "mismatch/is_min": _masked_extreme(w, valid, largest=False),
        "mismatch/is_max": _masked_extreme(w, valid, largest=True),
        "mismatch/is_clipped_frac": _masked_mean(clipped.double(), v),
        "mismatch/is_ess": ess,
    }
    if not return_counts:
        return out
    return out, dict.fromkeys(out, _count(n))


# ----------------------------------------------------------------------------------------------------
# reduction across processes
# ----------------------------------------------------------------------------------------------------

#: The normalised effective sample size and the mean whose sums it is rebuilt from (`reduce_gathered`).
_ESS_KEY, _ESS_MEAN_KEY = "mismatch/is_ess", "mismatch/is_mean"


def reduce_gathered(
    names: Sequence[str], values: torch.Tensor, counts: torch.Tensor | None = None
) -> dict[str, float]:
    """Combine per-process metric values into the value of the whole (all-process) batch.

    ``values[p, k]`` is metric ``names[k]`` computed by process ``p`` on its share of the batch and
    ``counts[p, k]`` the number of items it is computed over (from the ``*_metrics`` functions with
    ``return_counts=True``). Per metric, by `reduction` of its name:

    - ``"mean"``: ``sum_p c_p v_p / sum_p c_p``, the mean over all items, not the mean of the per-process means
      (which would depend on how the batch was split when the processes hold different numbers of tokens);
    - ``"max"`` / ``"min"``: the max / min over the processes;
    - ``mismatch/is_ess`` = ``(sum w)^2 / (n sum w^2)`` is not a mean: it is rebuilt from each process's sums,
      ``sum w = n * is_mean`` and ``sum w^2 = n * is_mean^2 / is_ess`` (``0`` when ``is_ess`` is undefined on a
      process that counts entries: all its ratios are 0), when ``mismatch/is_mean`` is among ``names``.

    Processes with a NaN value or a zero count are left out of a metric. A metric left out everywhere is
    absent from the result.

    Args:
        names: the ``K`` metric keys.
        values: ``[P, K]`` per-process values (any float dtype; combined in float64).
        counts: ``[P, K]`` per-process counts, or ``None`` for equal weights (a plain mean over processes).

    Returns:
        ``{name: float}`` for the metrics defined on at least one process.

    Raises:
        ValueError: on shapes that do not match ``names``.
    """
    names = list(names)
    values = torch.as_tensor(values).detach().to("cpu", torch.float64)
    if values.dim() != 2 or values.shape[1] != len(names):
        raise ValueError(f"values has shape {tuple(values.shape)}: accepted [P, K] with K = len(names) = {len(names)}")
    counts = torch.ones_like(values) if counts is None else torch.as_tensor(counts).detach().to("cpu", torch.float64)
    if counts.shape != values.shape:
        raise ValueError(f"counts has shape {tuple(counts.shape)}: accepted the shape of values {tuple(values.shape)}")
    # All columns at once (one pass of tensor ops, then one conversion to Python): this runs every step.
    ok = (counts > 0) & ~torch.isnan(values)
    defined = ok.any(dim=0).tolist()
    weights = torch.where(ok, counts, 0.0)
    means = (torch.where(ok, values, 0.0) * weights).sum(dim=0) / weights.sum(dim=0)
    maxima = torch.where(ok, values, -math.inf).amax(dim=0)
    minima = torch.where(ok, values, math.inf).amin(dim=0)
    how = [reduction(name) for name in names]
    reduced = torch.stack([means, maxima, minima]).tolist()
    pick = {"mean": 0, "max": 1, "min": 2}
    out = {name: reduced[pick[h]][j] for j, (name, h) in enumerate(zip(names, how)) if defined[j]}
    if _ESS_KEY in names and _ESS_MEAN_KEY in names:
        out.pop(_ESS_KEY, None)
        j = names.index(_ESS_KEY)
        n, mean, ess = counts[:, j], values[:, names.index(_ESS_MEAN_KEY)], values[:, j]
        keep = (n > 0) & ~torch.isnan(mean)
        n, mean, ess = n[keep], mean[keep], ess[keep]
        sum_w = n * mean
        sum_w2 = torch.where(torch.isnan(ess) | (ess <= 0), 0.0, n * mean.square() / ess)
        if bool(keep.any()) and bool(sum_w2.sum() > 0):
            out[_ESS_KEY] = float(sum_w.sum().square() / (n.sum() * sum_w2.sum()))
    return out
