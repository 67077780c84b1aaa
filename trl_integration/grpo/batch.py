"""The state of one generation batch between the trainer's hooks (trl calls them in turn for each batch).

trl builds a generation batch in ``_generate_and_score_completions`` (scoring passes: old policy, reference), then
runs the loss per micro-batch in ``_compute_loss``; the trainer's hooks (:mod:`trl_integration.grpo.trainer`) hand
each other what one hook learns and a later one needs through one :class:`BatchState`:

- the scoring passes trl runs while it builds the batch (``captured``), and the safe-set statistics of the latest
  pass (``last_stats``);
- on-policy batches whose safe-vocabulary step runs in the loss's own forward: per mode, the
  :class:`PendingGeneration` that collects its micro-batches' results until all are seen;
- the loss forward run ahead of trl's loss code (:class:`LossReplay`), handed back to trl's scoring call once;
- during a single-turn ``generate`` rollout, the recorder whose log-probabilities become trl's
  ``sampling_per_token_logps`` once trl has built the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from safevocab.mismatch.row import MetricRow
from trl_integration.grpo.step import SafeTokenStats, StepMetricInputs, StepResult

__all__ = ["LossReplay", "PendingGeneration", "BatchState"]




@dataclass
class LossReplay:
    """The loss forward run ahead of trl's loss code (on-policy micro-batches), handed back to it once."""

    input_shape: tuple[int, ...]
    logits_to_keep: int
    result: tuple

    def take(self, input_shape: tuple[int, ...], logits_to_keep: int) -> tuple:
        """The kept result, after checking that trl asks for the same batch."""
        if tuple(input_shape) != self.input_shape or logits_to_keep != self.logits_to_keep:
            raise RuntimeError(
                f"trl's loss pass asked for log-probabilities of a {tuple(input_shape)} batch (keep "
                f"{logits_to_keep}) but the pass run ahead of it scored {self.input_shape} (keep {self.logits_to_keep})"
            )
        return self.result


@dataclass
class PendingGeneration:
    """Metric rows and records of the micro-batches of one on-policy generation batch whose step runs in the loss
    (``safe_vocab_scoring``); complete once all ``expected`` micro-batches have been seen."""

    expected: int
    rows: list[MetricRow | StepMetricInputs] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)

    def add(self, result: StepResult) -> bool:
        """Add one micro-batch's result; whether the generation batch is now complete."""
        if result.metric_inputs is not None:
            self.rows.append(result.metric_inputs)
        self.records.append(result.record)
        return len(self.records) == self.expected  # rows may start with the batch's own (rollout coverage)


@dataclass
class BatchState:
    """What the trainer's overrides hand each other within a generation batch (the trainer keeps one).

    Attributes:
        captured: while trl builds a generation batch, every scoring pass's ``(logps, stats)``, in call order
            (``None`` outside it).
        last_stats: the safe-set statistics of the latest scoring pass.
        replay: the loss forward run ahead of trl's loss code, until trl asks for it.
        pending: per mode (``"train"``/``"eval"``), the generation batch whose step runs in the loss.
        recorded_rollout: during a single-turn ``generate`` rollout, ``(recorder, completion lengths)``: the recorded
            log-probabilities that become trl's ``sampling_per_token_logps`` tensor once trl has built the batch.
    """

    captured: list[tuple[torch.Tensor, SafeTokenStats]] | None = None
    last_stats: SafeTokenStats | None = None
    replay: LossReplay | None = None
    pending: dict[str, PendingGeneration] = field(default_factory=dict)
    recorded_rollout: tuple | None = None

    def keep(self, logps: torch.Tensor, stats: SafeTokenStats) -> None:
        """Record a scoring pass."""
        self.last_stats = stats
        if self.captured is not None:
            self.captured.append((logps, stats))
