"""The fence around trl's, transformers', accelerate's and vLLM's private API: the only module that names it.

`SafeVocabGRPOTrainer` changes four private methods of ``trl.GRPOTrainer`` and leans on a few more private or
internal names. trl's GRPO file changes every release, so every such name is accessed here, and only here; at import
this module checks that the installed trl is in the tested range and that each name it relies on is there with the
parameters it relies on. Outside the range, or when a name moved, the import fails with one line naming the
supported range, instead of a step failing half way through a run.

Touchpoints (each has a contract test in ``tests/trl_integration/test_private.py``):

==========================================================  ============================================================
private name                                                what the trainer relies on
==========================================================  ============================================================
``GRPOTrainer._get_per_token_logps_and_entropies``          scores completions with ``model(..., labels=...,
                                                            fused_lm_head=True)`` and reads ``log_probs``/``entropy``
``GRPOTrainer._generate_single_turn``                       one rollout turn: ``(completion_ids, logprobs)``; the plain
                                                            ``generate`` path calls the unwrapped model's ``generate``
``GRPOTrainer._generate_and_score_completions``             one generation batch, a dict with ``old_per_token_logps``
                                                            when trl scored the old policy
``GRPOTrainer._compute_loss``                               the loss of one micro-batch
``GRPOTrainer._metrics``                                    ``{mode: {name: list}}`` of logged values
``trl.models.utils.disable_gradient_checkpointing``         context manager ``(model, gradient_checkpointing_kwargs)``
``trl.trainer.utils.maybe_gather_lm_head_ctx``              context manager gathering ZeRO-3 head parameters
accelerate's ``model._original_forward``                    the forward before mixed-precision autocast wrapping
transformers' ``Trainer._created_lr_scheduler``             set, as ``create_scheduler`` sets it, so that a later
                                                            ``train()`` rebuilds a scheduler the trainer built (only
                                                            set: harmless should transformers drop it)
``VLLMGeneration._iter_named_params``                       ``(name, tensor)`` of the trainer's weights under vLLM's
                                                            names (gathered/merged as trl does), read by the CPU sync
``VLLMGeneration.sync_weights``                             replaced, on the instance, for a colocated engine on CPU
                                                            (:mod:`trl_integration.grpo.vllm_engine`: trl's sync fails there)
``trl.generation.vllm_generation.LLM``                      the ``vllm.LLM`` trl builds the colocated engine with;
                                                            wrapped while the trainer is built, to pass the
                                                            checkpoint's dtype (:func:`wrapped_engine_builder`)
vLLM's ``llm.llm_engine.model_executor.driver_worker``      the in-process worker's model runner of a colocated engine
``.model_runner`` and its ``reload_weights``/``get_model``  (trl walks the same path); its layerwise in-place reload
                                                            (:func:`engine_model_runner`, :func:`reload_runner_weights`)
vLLM's ``quant_method.process_weights_after_loading``       rerun on a layer whose weights are tied to another's (a
                                                            tied LM head): its CPU GEMM keeps a packed copy that the
                                                            layerwise reload never refreshes (:func:`repack_tied_layers`)
vLLM's ``llm.llm_engine.engine_core.shutdown``              shuts an in-process engine down (:func:`shut_down_engine`)
vLLM's ``llm.llm_engine.model_config``                      the engine's ``max_logprobs`` and ``return_sampling_mask``
                                                            (:func:`engine_model_config`), read for exact replay
``Trainer._save_checkpoint`` (trl's override included)      writes ``checkpoint-<global_step>`` (model, optimizer,
                                                            scheduler, RNG, ``trainer_state.json``) into
                                                            ``_get_output_dir(trial)``, then rotates old checkpoints
                                                            there (``save_total_limit``)
``transformers.trainer_pt_utils.safe_globals``              the numpy allowlist the Trainer loads ``rng_state.pth``
                                                            with (``weights_only=True``): the harness loads the state
                                                            files the same way first (:func:`trainer_safe_globals`)
``Trainer._get_output_dir``                                 the run directory of a trial; read by ``_save_checkpoint``
                                                            (transformers' and trl's) for where to write, so that
                                                            :meth:`CheckpointBridge.stock_save_checkpoint` can stage
                                                            a checkpoint in another folder
==========================================================  ============================================================

The trainer subclasses :class:`GRPOTrainerBridge` and overrides its public hooks (``score_completion_tokens``,
``generate_turn``, ``generate_and_score``, ``grpo_loss``); the run harness's checkpoints mix in :class:`CheckpointBridge`
(``save_checkpoint``). trl's own implementations are reached through the ``stock_*`` methods.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import trl  # lazy: only its version is read before the range check, then the trainer stack loads (below)

from trl_integration.notices import quiet_trl_vllm_range_notice
from trl_integration.trl_version import SUPPORTED_TRL, TRL_MAX, TRL_MIN, check_trl_version
from trl_integration.trl_version import unsupported_trl as _unsupported

__all__ = [
    "SUPPORTED_TRL",
    "TRL_MIN",
    "TRL_MAX",
    "REQUIRED_PARAMETERS",
    "check_trl",
    "check_trl_version",
    "GRPOTrainerBridge",
    "CheckpointBridge",
    "disable_gradient_checkpointing",
    "maybe_gather_lm_head_ctx",
    "mixed_precision_forward",
    "metric_store",
    "trainer_safe_globals",
    "mark_scheduler_created",
    "check_vllm_generation",
    "iter_named_params",
    "wrapped_engine_builder",
    "engine_model_runner",
    "reload_runner_weights",
    "repack_tied_layers",
    "runner_model",
    "shut_down_engine",
    "engine_model_config",
]

#: Parameters each overridden trl method must take, in this order, as the first ones after ``self``.
REQUIRED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
    ),
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "_generate_and_score_completions": ("inputs",),
    "_compute_loss": ("model", "inputs"),
    # transformers' Trainer (inherited by GRPOTrainer; trl overrides the first)
    "_save_checkpoint": ("model", "trial"),
    "_get_output_dir": ("trial",),
}

#: Keyword parameters trl's scoring method forwards to the model (multimodal and MoE inputs); the bridge passes them on.
SCORING_KEYWORDS = (
    "compute_aux_loss",
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


check_trl_version(trl.__version__)

with quiet_trl_vllm_range_notice():  # trl's import-time "supports vLLM 0.22-0.31" notice, wrong for the pinned 0.32
    from trl import GRPOTrainer  # noqa: E402


def check_trl(version: str, trainer_cls: type = GRPOTrainer, modules: dict[str, object] | None = None) -> None:
    """Check that ``version`` is in the tested range and that ``trainer_cls`` and ``modules`` have every private name
    this module relies on, with the parameters it relies on.

    Args:
        version: the trl version string (``trl.__version__``).
        trainer_cls: the class whose private methods are overridden (trl's ``GRPOTrainer``).
        modules: ``{"dotted.module": module}`` holding the private helper functions; defaults to trl's own.

    Raises:
        ImportError: one line naming what is missing and the supported range :data:`SUPPORTED_TRL`.
    """
    check_trl_version(version)
    for name, params in REQUIRED_PARAMETERS.items():
        method = getattr(trainer_cls, name, None)
        if not callable(method):
            raise _unsupported(version, f"GRPOTrainer.{name} is missing")
        found = tuple(p for p in inspect.signature(method).parameters if p != "self")
        if found[: len(params)] != params:
            raise _unsupported(version, f"GRPOTrainer.{name}{tuple(found)} does not start with the parameters {params}")
    scoring = tuple(inspect.signature(trainer_cls._get_per_token_logps_and_entropies).parameters)
    missing = [k for k in SCORING_KEYWORDS if k not in scoring]
    if missing:
        raise _unsupported(version, f"GRPOTrainer._get_per_token_logps_and_entropies has no parameter {missing[0]!r}")
    if modules is None:
        import trl.models.utils as model_utils
        import trl.trainer.utils as trainer_utils

        modules = {"trl.models.utils": model_utils, "trl.trainer.utils": trainer_utils}
    for dotted, attr, params in (
        ("trl.models.utils", "disable_gradient_checkpointing", ("model", "gradient_checkpointing_kwargs")),
        ("trl.trainer.utils", "maybe_gather_lm_head_ctx", ("params",)),
    ):
        func = getattr(modules.get(dotted), attr, None)
        if not callable(func):
            raise _unsupported(version, f"{dotted}.{attr} is missing")
        found = tuple(inspect.signature(func).parameters)
        if found[: len(params)] != params:
            raise _unsupported(version, f"{dotted}.{attr}{found} does not start with the parameters {params}")


def check_vllm_generation(version: str, generation_cls: type | None = None) -> None:
    """Check that trl's ``VLLMGeneration`` (``generation_cls``) has the two names the CPU weight sync relies on:
    ``sync_weights()`` and ``_iter_named_params()``, both without parameters.

    Raises:
        ImportError: one line naming what is missing and the supported range :data:`SUPPORTED_TRL`.
    """
    if generation_cls is None:
        from trl.generation.vllm_generation import VLLMGeneration as generation_cls
    for name in ("sync_weights", "_iter_named_params"):
        method = getattr(generation_cls, name, None)
        if not callable(method):
            raise _unsupported(version, f"VLLMGeneration.{name} is missing")
        found = tuple(p for p in inspect.signature(method).parameters if p != "self")
        if found:
            raise _unsupported(version, f"VLLMGeneration.{name}{found} takes parameters, expected none")


check_trl(trl.__version__)
check_vllm_generation(trl.__version__)

# Checked above: import them only now.
from trl.models.utils import disable_gradient_checkpointing as _disable_gradient_checkpointing  # noqa: E402
from trl.trainer.utils import maybe_gather_lm_head_ctx as _maybe_gather_lm_head_ctx  # noqa: E402


def disable_gradient_checkpointing(model, gradient_checkpointing_kwargs: dict | None) -> AbstractContextManager:
    """trl's context manager that switches gradient checkpointing off for a no-grad pass."""
    return _disable_gradient_checkpointing(model, gradient_checkpointing_kwargs)


def maybe_gather_lm_head_ctx(*params: torch.nn.Parameter) -> AbstractContextManager:
    """trl's context manager that gathers DeepSpeed ZeRO-3 partitioned LM-head parameters (a no-op otherwise)."""
    return _maybe_gather_lm_head_ctx(*params)


def mixed_precision_forward(model: torch.nn.Module) -> Callable | None:
    """The forward accelerate kept when it wrapped ``model.forward`` in mixed-precision autocast, else ``None``.

    accelerate's ``prepare_model`` stores the unwrapped forward in the instance attribute ``_original_forward`` and
    sets the wrapped one as the instance's ``forward``; both must be instance attributes for this to apply."""
    original = vars(model).get("_original_forward")
    return original if original is not None and "forward" in vars(model) else None


def trainer_safe_globals() -> AbstractContextManager:
    """transformers' allowlist for ``torch.load(weights_only=True)`` of the state files the Trainer itself loads that
    way (numpy's RNG state in ``rng_state.pth``): ``transformers.trainer_pt_utils.safe_globals``."""
    from transformers.trainer_pt_utils import safe_globals

    return safe_globals()


def metric_store(trainer: GRPOTrainer) -> dict:
    """trl's ``{mode: {name: [values]}}`` store of logged metrics (averaged and cleared by ``GRPOTrainer.log``)."""
    return trainer._metrics


def mark_scheduler_created(trainer) -> None:
    """Tell transformers' ``Trainer`` that ``create_scheduler`` built ``trainer.lr_scheduler`` (its own
    ``create_scheduler`` sets the same flag), so that a later ``train()`` call rebuilds it instead of reusing it."""
    trainer._created_lr_scheduler = True


def iter_named_params(vllm_generation) -> Iterator[tuple[str, torch.Tensor]]:
    """trl's ``(name, tensor)`` of the trainer's weights under vLLM's names (gathered and merged as trl's own sync
    does), for a weight sync of trl's ``VLLMGeneration``."""
    return vllm_generation._iter_named_params()


@contextmanager
def wrapped_engine_builder(wrap: Callable[[Callable], Callable]) -> Iterator[bool]:
    """While the block runs, trl's colocated mode builds its engine with ``wrap(vllm.LLM)`` instead of ``vllm.LLM``
    (the name ``LLM`` in ``trl.generation.vllm_generation``). Yields whether there was one to wrap (``False``
    without vLLM installed: trl then raises its own ImportError)."""
    import trl.generation.vllm_generation as vllm_generation

    build = getattr(vllm_generation, "LLM", None)
    if build is None:
        yield False
        return
    vllm_generation.LLM = wrap(build)
    try:
        yield True
    finally:
        vllm_generation.LLM = build


def engine_model_runner(llm) -> object | None:
    """The model runner of an in-process ``vllm.LLM`` with a ``reload_weights`` method, else ``None``: trl's
    colocate mode (``external_launcher``, one worker), the path trl's own ``sync_weights`` walks."""
    try:
        runner = llm.llm_engine.model_executor.driver_worker.model_runner
    except AttributeError:
        return None
    return runner if runner is not None and callable(getattr(runner, "reload_weights", None)) else None


def reload_runner_weights(runner, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """vLLM's layerwise in-place reload of checkpoint-format ``(name, tensor)`` pairs into a model runner's model
    (restores each layer's checkpoint-format parameters, loads, reruns its ``process_weights_after_loading``)."""
    runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)


def repack_tied_layers(model: torch.nn.Module) -> list[str]:
    """Rerun ``quant_method.process_weights_after_loading`` of every layer of a vLLM model that owns no weight of its
    own: each of its parameters belongs to a layer before it (the LM head of a model with tied word embeddings, whose
    ``tie_weights`` makes ``lm_head.weight`` the ``embed_tokens.weight`` Parameter). Returns their names.

    Why: on CPU that processing (``dispatch_cpu_unquantized_gemm``) builds the layer's GEMM from a packed copy of the
    weight (sgl-kernel ``convert_weight_packed`` or a oneDNN handle). vLLM's layerwise reload loads the shared
    Parameter through the embedding only (the checkpoint has no ``lm_head.weight``; the model's loader skips it), so
    the head gets no weights, is put back as it was and keeps the checkpoint's packed copy: the engine would sample
    with the synced embeddings and the old head. Untied layers are left alone."""
    seen: set[int] = set()  # parameters of the layers before (vLLM defines embed_tokens before lm_head)
    repacked = []
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        tied = bool(params) and all(id(p) in seen for p in params)
        seen.update(id(p) for p in params)
        method = getattr(module, "quant_method", None)
        if tied and callable(getattr(method, "process_weights_after_loading", None)):
            method.process_weights_after_loading(module)
            repacked.append(name)
    return repacked


def runner_model(runner) -> torch.nn.Module:
    """The ``torch.nn.Module`` a vLLM model runner computes with."""
    return runner.get_model()


def engine_model_config(llm) -> object | None:
    """The ``ModelConfig`` of an in-process ``vllm.LLM`` (``max_logprobs``, ``return_sampling_mask``), or ``None``."""
    return getattr(getattr(llm, "llm_engine", None), "model_config", None)


def shut_down_engine(llm) -> bool:
    """Shut an in-process ``vllm.LLM``'s engine down now, while ``torch.distributed`` is still up (its client's
    ``shutdown`` detaches the finalizer that would otherwise do it at exit). Returns whether it had one."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is None or not hasattr(engine_core, "shutdown"):
        return False
    engine_core.shutdown()
    return True


class GRPOTrainerBridge(GRPOTrainer):
    """``trl.GRPOTrainer`` whose four overridden private methods forward to public hooks.

    Subclasses override the hooks; ``stock_*`` runs trl's own implementation. Each hook takes the arguments of the
    trl method it stands for (see :data:`REQUIRED_PARAMETERS`)."""

    # --- trl -> hooks -------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        return self.score_completion_tokens(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            **kwargs,
        )

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return self.generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _generate_and_score_completions(self, inputs):
        return self.generate_and_score(inputs)

    def _compute_loss(self, model, inputs):
        return self.grpo_loss(model, inputs)

    # --- hooks (default: trl's behaviour) -------------------------------------------------------------------------
    def score_completion_tokens(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(logps [B, T], entropies [B, T] | None, aux_loss | None)`` of the last ``logits_to_keep`` tokens."""
        return self.stock_score_completion_tokens(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            **kwargs,
        )

    def generate_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """``(completion_ids: list[list[int]], logprobs: list[list[float]] | None)`` of one rollout turn."""
        return self.stock_generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def generate_and_score(self, inputs: list[dict]) -> dict:
        """One generation batch (trl's dict of padded tensors)."""
        return self.stock_generate_and_score(inputs)

    def grpo_loss(self, model, inputs: dict) -> torch.Tensor:
        """The loss of one micro-batch."""
        return self.stock_grpo_loss(model, inputs)

    # --- trl's implementations ----------------------------------------------------------------------------------
    def stock_score_completion_tokens(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        return GRPOTrainer._get_per_token_logps_and_entropies(
            self,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            **kwargs,
        )

    def stock_generate_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return GRPOTrainer._generate_single_turn(
            self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
        )

    def stock_generate_and_score(self, inputs: list[dict]) -> dict:
        return GRPOTrainer._generate_and_score_completions(self, inputs)

    def stock_grpo_loss(self, model, inputs: dict) -> torch.Tensor:
        return GRPOTrainer._compute_loss(self, model, inputs)

    @property
    def metric_store(self) -> dict:
        """trl's ``{mode: {name: [values]}}`` store of logged metrics."""
        return metric_store(self)


class CheckpointBridge:
    """A mixin over a ``transformers.Trainer`` (the run harness's checkpoints): ``Trainer._save_checkpoint`` forwards to
    the public hook :meth:`save_checkpoint`, and :meth:`stock_save_checkpoint` runs trl's (and transformers') own save,
    optionally into another folder. Only the harness uses it: the plain trainer leaves ``_save_checkpoint`` as trl's."""

    #: Where transformers' ``_save_checkpoint`` writes ``checkpoint-N`` while :meth:`stock_save_checkpoint` stages a
    #: checkpoint (``None``: the run directory, as in transformers).
    _checkpoint_parent: str | None = None

    def _save_checkpoint(self, model, trial):
        return self.save_checkpoint(model, trial)

    def _get_output_dir(self, trial):
        if self._checkpoint_parent is not None:
            return self._checkpoint_parent
        return GRPOTrainer._get_output_dir(self, trial)

    def save_checkpoint(self, model, trial) -> None:
        """Write ``checkpoint-<global_step>`` into :meth:`checkpoint_run_dir` and rotate older ones."""
        self.stock_save_checkpoint(model, trial)

    def stock_save_checkpoint(self, model, trial, parent: str | None = None) -> None:
        """trl's (and transformers') checkpoint save. With ``parent``, ``checkpoint-<global_step>`` is written into
        that folder instead of the run directory, and transformers' rotation of old checkpoints (``save_total_limit``)
        runs in that folder, where it finds nothing else to delete."""
        self._checkpoint_parent = None if parent is None else str(parent)
        try:
            GRPOTrainer._save_checkpoint(self, model, trial)
        finally:
            self._checkpoint_parent = None

    def checkpoint_run_dir(self, trial) -> str:
        """The folder transformers keeps checkpoints in: ``args.output_dir``, or a hyperparameter-search trial's."""
        return GRPOTrainer._get_output_dir(self, trial)
