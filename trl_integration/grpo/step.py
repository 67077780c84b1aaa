"""The safe-vocabulary step of a generation batch, on plain tensors: out-of-set masks, importance ratio, metric rows.

No trl and no trainer here: a :class:`~trl_integration.grpo.batch.GenerationBatch` (one per trl generation batch)
collects the inputs (trl's batch dict, the scoring pass's log-probabilities and safe-set statistics), calls
:func:`safe_vocabulary_step` and applies its result.

For a batch with completion mask ``c``, loss-only mask ``u`` (trl's ``tool_mask``, 1 when absent) and ``in_safe``
``s`` (the sampled token is in the trainer's safe set ``S``):

- **out-of-set masks**: the counted tokens are ``n = c * u``; ``keep = s | ~n`` (token-wise, ``mask_token``) or
  ``keep_b = all_t keep_bt`` (``mask_sequence``); the new loss-only mask is ``u' = u * keep`` and the loss mask
  ``m = c * u'`` (the attention mask is untouched);
- **importance ratio** ``r = pi_S,train / pi_S,rollout`` over ``m`` (:func:`safevocab.correction.importance_sampling_ratio`
  with trl's ``vllm_importance_sampling_*`` mode and clips), so out-of-set tokens never enter it;
- **metrics**, each with the number of items it averages over, so that the reduction over processes and micro-batches
  (:func:`safevocab.mismatch.reduce_gathered`) is the value of the whole batch, not a mean of means: the safe-set
  statistics over ``n``, ``safevocab/masked_token_frac = |n & ~keep| / |n|``, the ratio's statistics and the
  mismatch metrics over ``m``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from safevocab.correction import ImportanceRatio, importance_sampling_ratio
from safevocab.mismatch import DEFAULT_BUCKETS
from safevocab.mismatch.common import zero_filled_pair
from safevocab.mismatch.metrics import bucket_row, importance_ratio_row, mismatch_row, safe_set_row
from safevocab.mismatch.row import MetricRow
from trl_integration.grpo.metric_rows import MASKED_TOKEN_FRAC, masked_token_row, metric_rows, trl_sampling_row
from trl_integration.grpo.replay import replay_metrics
from trl_integration.options import OUT_OF_SET_MODES, SCORING_MODES

__all__ = [
    "ROLLOUT_LOGPROBS_FRAC",
    "MASKED_TOKEN_FRAC",
    "COUNT_NORMALISED_LOSSES",
    "SafeTokenStats",
    "StepSettings",
    "OutOfSetMasks",
    "StepMetricInputs",
    "StepResult",
    "out_of_set_masks",
    "safe_vocabulary_step",
    "old_policy_stats",
    "rollout_logprobs_coverage",
    "score_in_loss",
    "metric_rows",
    "concat_records",
]

#: Metric: share of the loss tokens of a generation batch whose rollout log-probability was recorded.
ROLLOUT_LOGPROBS_FRAC = "safevocab/rollout_logprobs_frac"

#: Keys of :func:`~safevocab.mismatch.mismatch_metrics` re-logged under ``mismatch/removed/`` (zero-mismatch setting).
_REMOVED_KEYS = ("abs_logp_diff_mean", "abs_logp_diff_max", "k3_kl", "log_ppl_abs_diff", "chi2_token")

#: trl loss types normalised by ``num_items_in_batch`` (the loss tokens of the whole generation batch).
COUNT_NORMALISED_LOSSES = ("dapo", "cispo", "vespo")


@dataclass
class SafeTokenStats:
    """Per-token safe-set statistics of one scoring pass, each ``[B, T]`` (completion positions).

    Attributes:
        in_safe: bool, the sampled token is in the trainer's safe set.
        log_kept_mass: fp32 ``log(1 - m)``, ``m`` the pruned probability mass.
        safe_size: int64 ``|S|``.
        replay_size: int64 ``|R|`` of the replayed set, 0 where none (``None``: the pass replayed nothing).
        rule_safe_size: int64 ``|S|`` of the rule alone on the same logits (``None`` without replay).
    """

    in_safe: torch.Tensor
    log_kept_mass: torch.Tensor
    safe_size: torch.Tensor
    replay_size: torch.Tensor | None = None
    rule_safe_size: torch.Tensor | None = None

    @classmethod
    def whole_vocabulary(cls, logps: torch.Tensor, vocab_size: int) -> SafeTokenStats:
        """The statistics of rule ``"none"``: every token kept, no mass pruned, ``|S| = V``."""
        return cls(
            in_safe=torch.ones_like(logps, dtype=torch.bool),
            log_kept_mass=torch.zeros_like(logps, dtype=torch.float32),
            safe_size=torch.full(logps.shape, vocab_size, dtype=torch.int64, device=logps.device),
        )

    @classmethod
    def from_head_outputs(cls, outputs: list, logits_to_keep: int) -> SafeTokenStats:
        """The completion positions (last ``logits_to_keep``) of the safe head's outputs of one scoring call, one per
        chunk of rows (``SafeCausalLMOutput``-like objects with ``in_safe``, ``log_kept_mass``, ``safe_size``)."""

        def cat(name: str) -> torch.Tensor | None:
            parts = [getattr(o, name, None) for o in outputs]
            return None if any(p is None for p in parts) else torch.cat([p[:, -logits_to_keep:] for p in parts])

        return cls(*(cat(name) for name in ("in_safe", "log_kept_mass", "safe_size", "replay_size", "rule_safe_size")))


@dataclass(frozen=True)
class StepSettings:
    """What :func:`safe_vocabulary_step` does to one batch (from the config and what the batch carries).

    Attributes:
        out_of_set: ``safe_vocab_out_of_set``, one of :data:`~trl_integration.options.OUT_OF_SET_MODES`.
        importance_sampling: compute the importance ratio (needs rollout log-probabilities or ``zero_mismatch``).
        mismatch_metrics: log the ``mismatch/*`` metrics (same requirement).
        zero_mismatch: replace the rollout log-probabilities by the training ones (mismatch lab).
        is_mode: trl's ``vllm_importance_sampling_mode``, one of :data:`~safevocab.correction.IS_MODES`.
        is_clip_min: trl's ``vllm_importance_sampling_clip_min`` (``None``: unbounded below).
        is_clip_max: trl's ``vllm_importance_sampling_clip_max`` (``None``: unbounded above).
        mismatch_buckets: edges of the ``mismatch/*/p=lo-hi`` buckets.
        sampling_metrics: also log trl's ``sampling/*`` ratio metrics of this ratio (trl's own computation is off on
            the vLLM path, see :func:`trl_integration.grpo.vllm_engine.ratio_left_to_the_trainer`).
        replay: log the replay metrics (``safe_vocab_support="replay"``,
            :func:`~trl_integration.grpo.replay.replay_metrics`).
    """

    out_of_set: str = "mask_token"
    importance_sampling: bool = False
    mismatch_metrics: bool = False
    zero_mismatch: bool = False
    is_mode: str = "sequence_mask"
    is_clip_min: float | None = None
    is_clip_max: float | None = 3.0
    mismatch_buckets: tuple[float, ...] = tuple(DEFAULT_BUCKETS)
    sampling_metrics: bool = True
    replay: bool = False

    def __post_init__(self):
        if self.out_of_set not in OUT_OF_SET_MODES:
            raise ValueError(f"out_of_set={self.out_of_set!r} is not accepted: accepted one of {OUT_OF_SET_MODES}")

    @property
    def measures(self) -> bool:
        """Whether the batch has anything to measure or correct besides the safe set."""
        return self.importance_sampling or self.mismatch_metrics or self.zero_mismatch


@dataclass(frozen=True)
class OutOfSetMasks:
    """The masks of :func:`out_of_set_masks`, each ``[B, T]``.

    Attributes:
        base: ``completion_mask * tool_mask`` before the out-of-set masking (the counted tokens, as numbers).
        keep: bool, the token stays in the loss (every uncounted position is ``True``).
        tool_mask: the new loss-only mask ``tool_mask * keep``, in the completion mask's dtype.
        loss_mask: ``completion_mask * tool_mask`` after the masking.
    """

    base: torch.Tensor
    keep: torch.Tensor
    tool_mask: torch.Tensor
    loss_mask: torch.Tensor

    @property
    def counted(self) -> torch.Tensor:
        """bool: the tokens in the loss before the out-of-set masking."""
        return self.base.bool()


def out_of_set_masks(
    completion_mask: torch.Tensor, tool_mask: torch.Tensor | None, in_safe: torch.Tensor, mode: str
) -> OutOfSetMasks:
    """Remove the sampled tokens outside the trainer's safe set from the loss, token- or sequence-wise.

    Args:
        completion_mask: ``[B, T]`` 0/1, the completion tokens.
        tool_mask: ``[B, T]`` 0/1 trl's loss-only mask, or ``None`` (every token counts).
        in_safe: ``[B, T]`` bool, the sampled token is in the trainer's safe set.
        mode: ``"mask_token"`` (drop the token) or ``"mask_sequence"`` (drop its whole sequence).

    Returns:
        :class:`OutOfSetMasks`.
    """
    if mode not in OUT_OF_SET_MODES:
        raise ValueError(f"mode={mode!r} is not accepted: accepted one of {OUT_OF_SET_MODES}")
    base = completion_mask if tool_mask is None else completion_mask * tool_mask
    keep = in_safe.bool() | ~base.bool()
    if mode == "mask_sequence":
        keep = keep.all(dim=-1, keepdim=True).expand_as(keep)
    previous = tool_mask if tool_mask is not None else torch.ones_like(completion_mask)
    new_tool_mask = previous * keep.to(completion_mask.dtype)
    return OutOfSetMasks(base=base, keep=keep, tool_mask=new_tool_mask, loss_mask=completion_mask * new_tool_mask)


@dataclass
class StepMetricInputs:
    """What the metric row of one batch is computed from, kept until the trainer's metrics are read
    (:mod:`trl_integration.grpo.metric_queue` stacks the inputs of several batches).

    Attributes:
        stats: the safe-set statistics of the scoring pass.
        masks: the batch's :func:`out_of_set_masks`.
        train_logps: ``[B, T]`` the training log-probabilities of the sampled tokens.
        rollout_logps: ``[B, T]`` the rollout log-probabilities, or ``None`` (none recorded).
        ratio: the batch's importance ratio, or ``None``.
        settings: which groups of metrics to compute.
        measured_rollout_logps: zero-mismatch setting: the rollout log-probabilities before the replacement, whose
            gap to the training ones is logged under ``mismatch/removed/*``.
    """

    stats: SafeTokenStats
    masks: OutOfSetMasks
    train_logps: torch.Tensor
    rollout_logps: torch.Tensor | None
    ratio: ImportanceRatio | None
    settings: StepSettings
    measured_rollout_logps: torch.Tensor | None = None

    def row(self) -> MetricRow:
        """The metric row of the batch (see the module docstring for what it holds). Inputs with a leading dimension
        (a stack of batches, ``[S, B, T]``) give one row per batch, ``[S, K]``."""
        stats, masks, ratio, settings = self.stats, self.masks, self.ratio, self.settings
        train_logps, rollout_logps, measured = self.train_logps, self.rollout_logps, self.measured_rollout_logps
        # Inference mode: the values are only logged, and dozens of small ops per step run about twice as fast.
        with torch.inference_mode():
            counted = masks.counted
            groups = [
                safe_set_row(stats.in_safe, stats.log_kept_mass, stats.safe_size, masks.base),
                masked_token_row(counted, masks.keep),
            ]
            if settings.replay:
                groups.append(MetricRow.from_dicts(*replay_metrics(stats, counted)))
            loss_mask = masks.loss_mask.bool()
            if ratio is not None:
                groups.append(importance_ratio_row(ratio.log_raw, ratio.ratio, ratio.clipped, loss_mask))
                if settings.sampling_metrics:
                    groups.append(trl_sampling_row(train_logps, rollout_logps, ratio, loss_mask))
            if settings.mismatch_metrics:
                paired = zero_filled_pair(train_logps, rollout_logps, loss_mask)  # shared by the two groups
                groups.append(mismatch_row(*paired))
                groups.append(bucket_row(*paired, settings.mismatch_buckets))
            if measured is not None:
                removed = mismatch_row(*zero_filled_pair(train_logps, measured, loss_mask))
                keys = [f"mismatch/{k}" for k in _REMOVED_KEYS]
                groups.append(removed.select(keys, [f"mismatch/removed/{k}" for k in _REMOVED_KEYS]))
            return MetricRow.cat(groups)


@dataclass
class StepResult:
    """What :func:`safe_vocabulary_step` computed for one batch.

    Attributes:
        entries: the batch entries to set (``tool_mask``; ``importance_sampling_ratio`` with importance sampling;
            ``sampling_per_token_logps`` in the zero-mismatch setting).
        loss_mask: ``[B, T]`` the loss tokens after the out-of-set masking (``num_items_in_batch`` counts them).
        metric_inputs: what the batch's metric row is computed from (``None`` when not measured): the trainer
            computes the rows of several batches at once when trl reads its metrics
            (:mod:`~trl_integration.grpo.metric_queue`).
        record: the tensors of ``trainer.last_generation``.
    """

    entries: dict[str, torch.Tensor]
    loss_mask: torch.Tensor
    metric_inputs: StepMetricInputs | None = None
    record: dict = field(default_factory=dict)

    @functools.cached_property
    def row(self) -> MetricRow | None:
        """The local metric row (:meth:`StepMetricInputs.row`), ``None`` when not measured."""
        return None if self.metric_inputs is None else self.metric_inputs.row()

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        """The local metric values, ``{name: 0-dim tensor}`` (empty when not measured)."""
        return {} if self.row is None else self.row.dicts()[0]

    @property
    def counts(self) -> dict[str, torch.Tensor]:
        """The number of items each value of :attr:`metrics` averages over."""
        return {} if self.row is None else self.row.dicts()[1]


@torch.no_grad()
def safe_vocabulary_step(
    batch: Mapping[str, torch.Tensor],
    train_logps: torch.Tensor,
    stats: SafeTokenStats,
    settings: StepSettings,
    measure: bool = True,
) -> StepResult:
    """Out-of-set masks, importance ratio and metrics of a generation batch or one of its micro-batches.

    Args:
        batch: trl's batch dict (``completion_mask``, optional ``tool_mask`` and ``sampling_per_token_logps``);
            not modified: the caller applies :attr:`StepResult.entries`.
        train_logps: ``[B, T]`` the trainer's safe log-probabilities of the sampled tokens.
        stats: the safe-set statistics of the same pass.
        settings: :class:`StepSettings`.
        measure: compute the metrics (``False``: masks and ratio only, an empty metric row).

    Returns:
        :class:`StepResult`.
    """
    completion_mask = batch["completion_mask"]
    rollout_logps = batch.get("sampling_per_token_logps")
    entries: dict[str, torch.Tensor] = {}

    # 0. Zero-mismatch lab setting: the rollout log-probabilities become the training engine's own scoring of the
    # sampled tokens (bit-identical); the gap measured by the recorder is kept to log what was removed.
    measured_rollout_logps = None
    if settings.zero_mismatch:
        measured_rollout_logps = rollout_logps
        rollout_logps = entries["sampling_per_token_logps"] = train_logps.detach().clone()

    # 1. Tokens outside S leave the loss (through the loss-only tool_mask; attention is unchanged).
    masks = out_of_set_masks(completion_mask, batch.get("tool_mask"), stats.in_safe, settings.out_of_set)
    entries["tool_mask"] = masks.tool_mask

    # 2. Importance ratio over the final mask.
    ratio = None
    if settings.importance_sampling:
        ratio = importance_sampling_ratio(
            train_logps, rollout_logps, masks.loss_mask,
            mode=settings.is_mode, clip_min=settings.is_clip_min, clip_max=settings.is_clip_max,
        )  # fmt: skip
        entries["importance_sampling_ratio"] = ratio.ratio

    # 3. Metrics.
    metric_inputs = None
    if measure:
        metric_inputs = StepMetricInputs(
            stats, masks, train_logps, rollout_logps, ratio, settings, measured_rollout_logps
        )

    record = {
        "train_logps": train_logps.detach(),
        "rollout_logps": None if rollout_logps is None else rollout_logps.detach(),
        "completion_mask": completion_mask,
        "loss_mask": masks.loss_mask,
        "in_safe": stats.in_safe,
        "log_kept_mass": stats.log_kept_mass,
        "safe_size": stats.safe_size,
        "importance_sampling_ratio": None if ratio is None else ratio.ratio,
        "log_raw_ratio": None if ratio is None else ratio.log_raw,
        # zero_mismatch: the recorder's rollout log-probabilities before the replacement (else None).
        "measured_rollout_logps": None if measured_rollout_logps is None else measured_rollout_logps.detach(),
    }
    return StepResult(entries=entries, loss_mask=masks.loss_mask, metric_inputs=metric_inputs, record=record)


def old_policy_stats(
    captured: list[tuple[torch.Tensor, SafeTokenStats]], old_logps: torch.Tensor
) -> SafeTokenStats | None:
    """The safe-set statistics of trl's old-policy pass: those of the first captured pass whose log-probabilities
    equal ``old_per_token_logps`` (trl scores the old policy before the reference, so the first match is it; a
    reference pass with the very same values is the same model, with the same sets). ``None`` when none matches."""
    for logps, stats in captured:
        if logps.shape == old_logps.shape and torch.equal(logps, old_logps):
            return stats
    return None


def rollout_logprobs_coverage(
    rollout_logps: torch.Tensor, completion_mask: torch.Tensor, tool_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(frac, n, gap)``: the share of the ``n`` loss tokens whose rollout log-probability was recorded (not NaN,
    the "not recorded" mark), and whether any loss token lacks one (bool, 0-dim)."""
    mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    counted = mask.bool()
    recorded = counted & ~torch.isnan(rollout_logps)
    n = counted.sum()
    frac = (recorded.sum().double() / n).float()  # 0/0 = NaN when nothing counts, on the batch's device
    return frac, n, (recorded != counted).any()


def score_in_loss(choice: str, micro_batches: int, loss_type: str) -> bool:
    """Whether an on-policy generation batch takes its safe sets from the loss's forward (``safe_vocab_scoring``):
    ``"auto"`` does where it is exact, i.e. unless a count-normalised loss spans several micro-batches."""
    if choice not in SCORING_MODES:
        raise ValueError(f"choice={choice!r} is not accepted: accepted one of {SCORING_MODES}")
    if choice != "auto":
        return choice == "loss_forward"
    return micro_batches == 1 or loss_type not in COUNT_NORMALISED_LOSSES


def concat_records(records: list[dict]) -> dict:
    """The ``last_generation`` tensors of a generation batch from those of its micro-batches."""
    if len(records) == 1:
        return records[0]
    return {
        key: None if records[0][key] is None else torch.cat([record[key] for record in records]) for key in records[0]
    }
