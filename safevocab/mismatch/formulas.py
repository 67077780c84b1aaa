"""Per-token and per-sequence mismatch formulas (see :mod:`safevocab.mismatch` for the table)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from safevocab.mismatch.common import (
    DEFAULT_BUCKETS,
    LOG_RATIO_BOUND,
    NAN,
    as_scalar,
    bucket_names,
    check_edges,
    masked_extreme,
    masked_mean,
    paired_log_ratio,
)
from safevocab.rules import SafeVocabRule, parse_rule
from safevocab.validation import float_tensor, real


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
    train, rollout, _, mask = paired_log_ratio(train_logps, rollout_logps, mask)
    m = mask.double()
    counts = m.sum(-1)
    gap = ((rollout - train) * m).sum(-1) / counts
    return torch.where(counts > 0, gap, torch.full_like(gap, NAN))


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
    _, _, log_r, mask = paired_log_ratio(train_logps, rollout_logps, mask)
    return masked_mean(k3_terms(log_r), mask.double())


def k3_terms(log_r: torch.Tensor) -> torch.Tensor:
    """Per-token ``r - log r - 1`` with ``log r`` clamped to ``±LOG_RATIO_BOUND`` (`k3_kl`)."""
    lr = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(lr) - lr - 1.0


def chi2_token(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level chi-square divergence estimate ``mean_M (r_t - 1)^2`` (``E_mu[(r - 1)^2] = chi^2(pi || mu)``).

    verl writes it ``mean_M r_t^2 - 1 = mean_M (r_t - 1)^2 + 2 mean_M (r_t - 1)``: the same expectation when the tokens
    are sampled from ``mu`` (``E_mu[r] = 1``), plus a zero-mean term that is first order in the mismatch. For a small
    mismatch that term dominates: verl's form is noise of either sign (negative on a batch whose ratios are mostly
    below 1) where ``(r - 1)^2``, formed as ``expm1(log r)^2``, is never negative and second order.

    Args:
        train_logps: ``[B, T]`` training log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` rollout log-probabilities (NaN where the engine reported none).
        mask: ``[B, T]`` bool or 0/1, the counted tokens.

    Returns:
        A 0-dim fp32 tensor (NaN when no token counts); ``log r_t`` is clamped to ``±LOG_RATIO_BOUND``.
    """
    _, _, log_r, mask = paired_log_ratio(train_logps, rollout_logps, mask)
    return masked_mean(chi2_terms(log_r), mask.double())


def chi2_terms(log_r: torch.Tensor) -> torch.Tensor:
    """Per-token ``(r - 1)^2 = expm1(log r)^2`` with ``log r`` clamped to ``±LOG_RATIO_BOUND`` (`chi2_token`)."""
    return torch.expm1(log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).square()


def chi2_sequence(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence-level chi-square estimate ``mean_b (prod_{t in M_b} r_t - 1)^2`` (verl: ``mean_b (prod r_t)^2 - 1``,
    the same expectation; never negative, as `chi2_token`).

    The product is taken as ``exp(sum_t log r_t)`` with the sum clamped to ``±LOG_RATIO_BOUND``; sequences
    without a counted token are left out.

    Args:
        train_logps: ``[B, T]`` training log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` rollout log-probabilities (NaN where the engine reported none).
        mask: ``[B, T]`` bool or 0/1, the counted tokens.

    Returns:
        A 0-dim fp32 tensor (NaN when no sequence counts).
    """
    _, _, log_r, mask = paired_log_ratio(train_logps, rollout_logps, mask)
    return as_scalar(sequence_chi2(log_r, mask.double()))


def sequence_chi2(log_r: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`chi2_sequence` from zero-filled ``log r`` and 0/1 weights, branch-free (NaN = 0/0 when no row counts)."""
    rows = m.sum(-1) > 0
    seq = (log_r * m).sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(rows, torch.expm1(seq).square(), 0.0).sum(-1) / rows.sum(-1)


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
            return torch.full(self.count.shape, NAN, dtype=torch.float64)
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
    edges = check_edges(edges)
    train, _, log_r, mask = paired_log_ratio(train_logps, rollout_logps, mask)
    count, sums = bucket_counts_and_sums(train, log_r, mask, edges)
    means = (sums / count).cpu()  # 0/0 = NaN for an empty bucket
    return BucketMismatch(
        names=bucket_names(edges),
        lo=torch.tensor([0.0, *edges], dtype=torch.float64),
        hi=torch.tensor([*edges, 1.0], dtype=torch.float64),
        count=count.cpu(),
        abs_diff_mean=means[0],
        diff_mean=means[1],
    )


def bucket_counts_and_sums(
    train: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, edges: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(count, sums)``: the ``[..., K]`` int64 number of counted tokens per bucket of ``p_t = exp(train_t)`` and the
    ``[2, ..., K]`` float64 sums of ``|log r_t|`` and ``log r_t`` over them (`bucket_mismatch`'s buckets), from the
    zero-filled float64 ``[..., B, T]`` inputs and bool mask of `~safevocab.mismatch.common.paired_log_ratio` and
    checked ``edges``; leading dimensions (a stack of batches) are kept."""
    p = train.exp()
    k = len(edges) + 1
    lead = tuple(train.shape[:-2])
    n_lead = math.prod(lead)
    # bucket j holds edges[j-1] <= p < edges[j]: bucketize with right=True; masked tokens go to an extra bin k.
    inner = torch.tensor(edges, dtype=torch.float64, device=p.device)
    bucket = torch.where(mask, torch.bucketize(p, inner, right=True), k)
    if lead:  # each batch of the stack counts into its own k + 1 bins
        bucket = bucket + torch.arange(0, n_lead * (k + 1), k + 1, device=p.device).view(*lead, 1, 1)
    bins = n_lead * (k + 1)
    flat = bucket.flatten()
    count = torch.bincount(flat, minlength=bins).view(*lead, k + 1)[..., :k]
    sums = torch.stack([torch.bincount(flat, weights=w.flatten(), minlength=bins) for w in (log_r.abs(), log_r)])
    return count, sums.view(2, *lead, k + 1)[..., :k]


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
            f"{prefix}jaccard_mean": masked_mean(self.jaccard, m.double()),
            f"{prefix}jaccard_min": masked_extreme(self.jaccard, m, largest=False),
            f"{prefix}differ_frac": masked_mean(self.differs.double(), m.double()),
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
        ValueError: on mismatched shapes or a temperature that is not finite and > 0.
        TypeError: on a temperature that is not a real number.
    """
    float_tensor("logits_a", logits_a)
    float_tensor("logits_b", logits_b)
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"logits_a {tuple(logits_a.shape)} and logits_b {tuple(logits_b.shape)} must match")
    temperature = real("temperature", temperature, lambda x: x > 0, "a finite temperature > 0")
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
    float_tensor("logits_a", logits_a)
    float_tensor("logits_b", logits_b)
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
