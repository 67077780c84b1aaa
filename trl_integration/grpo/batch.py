"""One trl generation batch, one object: :class:`GenerationBatch`.

trl builds a generation batch in ``_generate_and_score_completions`` (the rollout, then its scoring passes: old policy,
reference) and runs the loss per micro-batch in ``_compute_loss``. The trainer (:mod:`trl_integration.grpo.trainer`)
makes one :class:`GenerationBatch` per trl generation batch and forwards trl's hooks to it; the batch holds everything
the safe-vocabulary step needs between those hooks:

- the scoring passes trl runs while it builds the batch (to find the safe sets of trl's old-policy pass), and the
  rollout log-probabilities recorded on a single-turn ``generate`` rollout (they become ``sampling_per_token_logps``);
- the replayed supports (``safe_vocab_support="replay"``): one per completion;
- the **scoring regime**, decided once per batch (:data:`REGIMES`): trl's own (rule ``"none"``, nothing to measure), the
  old-policy pass trl ran, one extra no-grad pass, or the loss's own forward (on-policy batches,
  ``safe_vocab_scoring``);
- in the last regime, the micro-batches not yet seen (:class:`PendingGeneration`) and the loss forward run ahead of
  trl's loss code, handed back to trl's scoring call once (:class:`LossReplay`);
- trl's importance-ratio switch while trl builds the batch (:func:`~trl_integration.grpo.vllm_engine.
  ratio_left_to_the_trainer`) and the ``num_items_in_batch`` recount after the out-of-set masking.

trl's batch dict carries one key of ours, :data:`HANDLE_KEY`: a list with one :class:`BatchRow` per completion, which
trl shuffles and splits into micro-batches with the rest of the batch (so a micro-batch knows its batch and its rows).
The batch's step writes trl's own keys (``tool_mask``, ``importance_sampling_ratio``, ``num_items_in_batch``,
``sampling_per_token_logps``), as :func:`~trl_integration.grpo.step.safe_vocabulary_step` defines them.

The batch never sees the trainer: it is handed a scoring callable (:data:`Scoring`), the settings built once from the
config (:class:`BatchSettings`), accelerate's ``gather`` and where to publish its metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from safevocab.mismatch.row import MetricRow
from trl_integration.grpo.replay import SupportReplay
from trl_integration.grpo.step import (
    ROLLOUT_LOGPROBS_FRAC,
    SafeTokenStats,
    StepMetricInputs,
    StepResult,
    StepSettings,
    concat_records,
    old_policy_stats,
    rollout_logprobs_coverage,
    safe_vocabulary_step,
    score_in_loss,
)
from trl_integration.grpo.vllm_engine import ratio_left_to_the_trainer

__all__ = [
    "HANDLE_KEY", "REGIMES", "Scoring", "BatchSettings", "BatchRow", "GenerationBatch", "LossReplay",
    "PendingGeneration",
]  # fmt: skip

#: The one key of a trl batch dict that is ours: one :class:`BatchRow` per completion.
HANDLE_KEY = "safevocab_batch"

#: Where a batch's log-probabilities and safe sets come from (:attr:`GenerationBatch.regime`): trl's own head with
#: nothing to mask or measure; trl's old-policy pass; one extra no-grad pass; the loss's own forward.
REGIMES = ("stock", "old_policy", "extra_pass", "loss_forward")

#: ``score(inputs, model, for_loss) -> ((logps, entropies, aux_loss), stats)``: the safe log-probabilities of the
#: completion tokens of ``inputs`` (trl's batch dict) and their safe-set statistics. ``for_loss``: the loss's forward
#: (with grad, entropies, ``model`` as trl's loss passes it); else a no-grad pass of the trainer's model.
Scoring = Callable[[Mapping[str, Any], Any, bool], tuple[tuple, SafeTokenStats]]

#: ``publish(mode, rows, record)``: queue a generation batch's metric rows (reduced across processes) and, when not
#: ``None``, make ``record`` the trainer's ``last_generation``.
Publish = Callable[[str, list, "dict | None"], None]


@dataclass(frozen=True)
class BatchSettings:
    """What every generation batch of a trainer does, built once from the config and the trainer's setup.

    Attributes:
        out_of_set, scoring, loss_type, steps_per_generation: ``safe_vocab_out_of_set``, ``safe_vocab_scoring``, trl's
            ``loss_type`` and ``steps_per_generation``.
        is_mode, is_clip_min, is_clip_max: trl's ``vllm_importance_sampling_*``.
        mismatch_buckets, mismatch_metrics, zero_mismatch: ``mismatch_buckets``, ``log_mismatch_metrics``,
            ``zero_mismatch``.
        importance_sampling: the importance ratio is on (vLLM: trl's correction; ``generate``:
            ``generate_path_importance_sampling``).
        rollout_logprobs: rollout log-probabilities are used (always with vLLM; else ``rollout_logprobs``).
        use_vllm: trl's vLLM path (trl multiplies the loss by the ratio; on ``generate`` the advantages are scaled).
        stock_head: rule ``"none"`` without replay: trl's own head.
        replay: ``safe_vocab_support="replay"``.
    """

    out_of_set: str = "mask_token"
    scoring: str = "auto"
    loss_type: str = "dapo"
    steps_per_generation: int = 1
    is_mode: str = "sequence_mask"
    is_clip_min: float | None = None
    is_clip_max: float | None = 3.0
    mismatch_buckets: tuple[float, ...] = ()
    mismatch_metrics: bool = False
    zero_mismatch: bool = False
    importance_sampling: bool = False
    rollout_logprobs: bool = False
    use_vllm: bool = False
    stock_head: bool = False
    replay: bool = False

    @classmethod
    def from_config(cls, args, *, use_vllm: bool, importance_sampling: bool, stock_head: bool) -> BatchSettings:
        """The settings of ``args`` (a ``SafeVocabGRPOConfig``) on a trainer with trl's vLLM path or not, its
        importance ratio on or not (trl's switch, read once the trainer is built) and trl's head or the safe one."""
        return cls(
            out_of_set=args.safe_vocab_out_of_set,
            scoring=args.safe_vocab_scoring,
            loss_type=args.loss_type,
            steps_per_generation=args.steps_per_generation,
            is_mode=args.vllm_importance_sampling_mode,
            is_clip_min=args.vllm_importance_sampling_clip_min,
            is_clip_max=args.vllm_importance_sampling_clip_max,
            mismatch_buckets=tuple(args.mismatch_buckets),
            mismatch_metrics=bool(args.log_mismatch_metrics),
            zero_mismatch=bool(getattr(args, "zero_mismatch", False)),
            importance_sampling=bool(importance_sampling),
            rollout_logprobs=bool(use_vllm or args.rollout_logprobs),
            use_vllm=bool(use_vllm),
            stock_head=bool(stock_head),
            replay=args.safe_vocab_support == "replay",
        )

    def step(self, batch: Mapping) -> StepSettings:
        """The :class:`~trl_integration.grpo.step.StepSettings` of a batch: the importance ratio and the mismatch
        metrics need rollout log-probabilities, or the zero-mismatch setting that makes them."""
        recorded = batch.get("sampling_per_token_logps") is not None and self.rollout_logprobs
        has_rollout = recorded or self.zero_mismatch
        return StepSettings(
            out_of_set=self.out_of_set,
            importance_sampling=self.importance_sampling and has_rollout,
            mismatch_metrics=self.mismatch_metrics and has_rollout,
            zero_mismatch=self.zero_mismatch,
            is_mode=self.is_mode,
            is_clip_min=self.is_clip_min,
            is_clip_max=self.is_clip_max,
            mismatch_buckets=self.mismatch_buckets,
            sampling_metrics=True,  # trl's sampling/* metrics, of the ratio the loss uses (trl's own is off)
            replay=self.replay,
        )

    def micro_batches(self, mode: str) -> int:
        """How many micro-batches trl splits a (per-process) generation batch into."""
        return self.steps_per_generation if mode == "train" else 1


@dataclass(frozen=True)
class BatchRow:
    """One completion of a generation batch, as trl's batch dict carries it under :data:`HANDLE_KEY`."""

    batch: GenerationBatch
    index: int


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


class GenerationBatch:
    """One trl generation batch, from trl's rollout to the loss of its last micro-batch (see the module docstring).

    Args:
        settings: the trainer's :class:`BatchSettings`.
        score: the :data:`Scoring` callable (the trainer's scoring through its head).
        mode: ``"train"`` or ``"eval"``.
        gather: accelerate's ``gather`` (the recount and the coverage decision span all processes).
        publish: where the batch's metrics and record go (:data:`Publish`).
        replay: the trainer's :class:`~trl_integration.grpo.replay.SupportReplay` (replay mode), else ``None``.
    """

    def __init__(
        self, settings: BatchSettings, score: Scoring, *, mode: str, gather: Callable, publish: Publish,
        replay: SupportReplay | None = None, on_step: Callable[[StepResult], None] | None = None,
    ):  # fmt: skip
        self.settings, self.mode, self.replay = settings, mode, replay
        self._score, self._gather, self._publish = score, gather, publish
        #: Handed every step result as it is applied (the trainer's out-of-set alert counts its tokens).
        self._on_step = on_step
        #: One of :data:`REGIMES`, decided once trl has built the batch.
        self.regime: str | None = None
        #: The replayed supports, one per completion in rollout order (replay mode; ``None``: the rule's sets).
        self.supports: list | None = None
        self._captured: list[tuple[torch.Tensor, SafeTokenStats]] | None = None
        self._recording: tuple | None = None
        self._pending: PendingGeneration | None = None
        self._loss_forward: LossReplay | None = None
        #: trl's own loss-only mask of the batch (tool responses), before the out-of-set masking; ``None``: none.
        self._trl_tool_mask: torch.Tensor | None = None
        #: The tokens the loss of the micro-batch in hand would use without the out-of-set masking (``[]`` sum).
        self.loss_counted: torch.Tensor | None = None

    @staticmethod
    def of(batch: Mapping) -> GenerationBatch | None:
        """The generation batch of a trl batch dict or micro-batch (``None``: trl's own, nothing of ours)."""
        rows = batch.get(HANDLE_KEY)
        return rows[0].batch if rows else None

    # -- while trl builds the batch ----------------------------------------------------------------------------------
    def generate(self, generate_and_score: Callable[[list], dict], inputs: list, trl_trainer) -> dict:
        """trl's ``_generate_and_score_completions`` (``generate_and_score(inputs)``) with trl's own importance ratio
        left to this batch, then the safe-vocabulary step; returns trl's batch dict."""
        self._captured = []
        if self.replay is not None:
            self.replay.begin_generation()
        try:
            with ratio_left_to_the_trainer(trl_trainer):
                output = generate_and_score(inputs)
            captured = self._captured
        finally:
            self._captured = None
        if self._recording is not None:
            recorder, lengths = self._recording
            self._recording = None
            completion_ids = output["completion_ids"]
            width, device = completion_ids.shape[1], completion_ids.device
            output["sampling_per_token_logps"] = recorder.padded(lengths, width, device)
        if self.replay is not None:
            self.supports = self.replay.kept_sets()
        self._decide(output, captured)
        return output

    def keep_pass(self, logps: torch.Tensor, stats: SafeTokenStats) -> None:
        """A scoring pass trl ran (kept while trl builds the batch: one of them may be the old policy's)."""
        if self._captured is not None:
            self._captured.append((logps, stats))

    def record_rollout(self, recorder, completion_ids: list[list[int]], single_turn: bool) -> list[list[float]] | None:
        """A ``generate`` turn's recorded log-probabilities, as trl is to be handed them. Single-turn: none (trl would
        build one tensor per completion); the recording becomes trl's padded ``sampling_per_token_logps`` once trl
        has built the batch (the same values). Tool turns (and a ``rollout_func``) append to trl's lists.
        (A turn without a recording hands trl NaN, trl's own "not recorded" mark: the batch then drops its rollout
        log-probabilities and logs the recorded share.)"""
        if not single_turn:
            return recorder.per_sequence(completion_ids)
        self._recording = (recorder, [len(ids) for ids in completion_ids])
        return None

    def _decide(self, output: dict, captured: list) -> None:
        """The scoring regime and, unless the loss's forward scores the batch, the step of the whole batch."""
        coverage = self._check_rollout_logprobs(output)  # logged with the batch's metrics: one gather per batch
        if self.settings.stock_head and not self.settings.step(output).measures:
            self.regime = "stock"  # nothing to mask or measure: stay exactly trl (no key of ours)
            return self._publish(self.mode, coverage, None)
        output[HANDLE_KEY] = [BatchRow(self, i) for i in range(len(output["completion_ids"]))]
        self._trl_tool_mask = output.get("tool_mask")  # trl's, before any step of ours replaces it
        old = output.get("old_per_token_logps")  # trl ran an old-policy pass when the batch carries it
        stats = None if old is None else old_policy_stats(captured, old)
        if stats is not None:
            self.regime, train_logps = "old_policy", old
        elif score_in_loss(self.settings.scoring, self.settings.micro_batches(self.mode), self.settings.loss_type):
            self.regime = "loss_forward"
            self._pending = PendingGeneration(self.settings.micro_batches(self.mode), list(coverage))
            return
        else:
            self.regime = "extra_pass"
            (train_logps, _, _), stats = self._score(output, None, False)
        result = self._apply_step(output, train_logps, stats, whole_batch=True)
        self._publish(self.mode, [*coverage, result.metric_inputs], result.record)

    def _check_rollout_logprobs(self, output: dict) -> list[MetricRow]:
        """The metric row of the share of loss tokens with a recorded rollout log-probability (none without them); on
        the ``generate`` path a batch with unrecorded tokens (NaN) drops them and trains without generate-path IS."""
        rollout = output.get("sampling_per_token_logps")
        if rollout is None or not self.settings.rollout_logprobs:
            return []
        frac, n, gap = rollout_logprobs_coverage(rollout, output["completion_mask"], output.get("tool_mask"))
        row = MetricRow((ROLLOUT_LOGPROBS_FRAC,), frac.float().reshape(1), n.double().reshape(1))
        # vLLM keeps trl's convention (a NaN token gets ratio 1); a partial generate-path recording is not used.
        # Decided over all processes: every rank must then log the same metrics (they are gathered together).
        if not self.settings.use_vllm:
            if bool(self._gather(gap.reshape(1).to(torch.float32)).max() > 0):
                del output["sampling_per_token_logps"]
        return [row]

    def _apply_step(
        self, batch: dict, train_logps: torch.Tensor, stats: SafeTokenStats, whole_batch: bool, measure: bool = True
    ) -> StepResult:
        """:func:`~trl_integration.grpo.step.safe_vocabulary_step` on the batch or one of its micro-batches, its
        entries applied; with ``whole_batch`` (the whole per-process generation batch) also recount
        ``num_items_in_batch``, which spans the generation batch, after the out-of-set masking."""
        result = safe_vocabulary_step(batch, train_logps.detach(), stats, self.settings.step(batch), measure=measure)
        batch.update(result.entries)
        if self._on_step is not None:
            self._on_step(result)
        if whole_batch:
            batch["num_items_in_batch"] = self._gather(result.loss_mask.sum()).sum()
        return result

    # -- the loss of one micro-batch ---------------------------------------------------------------------------------
    def loss_inputs(self, model, inputs: Mapping) -> dict:
        """trl's micro-batch as trl's loss code is to see it: the replayed supports of its rows in hand, the loss
        forward run first where the loss scores the batch, and on the ``generate`` path the importance ratio folded
        into the advantages."""
        rows = inputs[HANDLE_KEY]
        if self.replay is not None:
            self.replay.use(None if self.supports is None else [self.supports[row.index] for row in rows])
        inputs = {key: value for key, value in inputs.items() if key != HANDLE_KEY}
        counted = inputs["completion_mask"]
        if self._trl_tool_mask is not None:  # trl's tool responses never count (rows in trl's shuffled order)
            index = torch.tensor([row.index for row in rows], device=self._trl_tool_mask.device)
            counted = counted * self._trl_tool_mask.index_select(0, index).to(counted.device)
        self.loss_counted = counted.sum()
        if self.regime == "loss_forward":
            self._forward_first(model, inputs)
        # trl applies the importance ratio only when use_vllm. On the generate path, fold it into the
        # advantages instead: every loss type but VESPO is linear in the advantage per token, and the ratio
        # is >= 0, so A * r gives exactly trl's `per_token_loss * r` (the KL and entropy terms stay unweighted,
        # as in trl). VESPO reads inputs["importance_sampling_ratio"] itself.
        if not self.settings.use_vllm and self.settings.loss_type != "vespo" and "importance_sampling_ratio" in inputs:
            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            inputs["advantages"] = advantages * inputs["importance_sampling_ratio"]
        return inputs

    def _forward_first(self, model, inputs: dict) -> None:
        """On-policy micro-batch: run the loss's forward pass now (with grad, as trl's ``_compute_loss`` calls
        it), apply the safe-vocabulary step to the micro-batch from its safe sets, and keep the forward's result
        for trl's loss code (:meth:`replayed_forward`), so the batch is scored once.

        The old policy of an on-policy batch is the policy of this pass (trl itself then takes
        ``old_per_token_logps = per_token_logps.detach()``), so these are the safe sets and log-probabilities
        an old-policy pass would give."""
        result, stats = self._score(inputs, model, True)
        rows, width = inputs["prompt_ids"].shape[0], inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
        self._loss_forward = LossReplay((rows, width), inputs["completion_ids"].size(1), result)
        pending = self._pending
        # Every pass over the batch (num_iterations > 1 repeats them) applies the same masks and count; it is logged
        # once, over all its micro-batches: later iterations over the same batch only apply the masks.
        whole_batch = self.settings.micro_batches(self.mode) == 1
        step = self._apply_step(inputs, result[0], stats, whole_batch, measure=pending is not None)
        if pending is not None and pending.add(step):
            self._pending = None
            self._publish(self.mode, pending.rows, concat_records(pending.records))

    def replayed_forward(self, input_shape: tuple[int, ...], logits_to_keep: int) -> tuple | None:
        """trl's scoring call in the loss: the forward :meth:`loss_inputs` ran ahead of it (once), else ``None``."""
        if self._loss_forward is None:
            return None
        kept, self._loss_forward = self._loss_forward, None
        return kept.take(input_shape, logits_to_keep)

    def end_loss(self) -> None:
        """trl's loss of the micro-batch is done: nothing run ahead stays."""
        self._loss_forward = None
