"""A safe-vocabulary fused LM head for transformers causal LMs, the counterpart of trl's ``add_fused_lm_head``.

trl's ``GRPOTrainer`` scores completions with ``model(..., labels=labels, fused_lm_head=True)``: a patched forward
that runs the backbone and projects only the scored positions through the LM head in tiles
(``trl.trainer.utils.add_fused_lm_head``). :func:`add_safe_lm_head` patches the same entry point so that the
log-probabilities come from :func:`safevocab.fused_safe_logprobs` under a rule instead: ``log pi_S(y)``,
renormalised over the rule's safe set, with the logits transformed exactly as the sampler transforms them
(``logit_scale``, softcap, temperature). Going through ``model(...)`` (not through the backbone directly) keeps
DDP/FSDP forward hooks armed, as trl's head does.

The patched forward also returns, per position, ``in_safe``, ``log_kept_mass`` and ``safe_size``; trl reads
only ``log_probs``/``entropy``/``aux_loss``, so :class:`SafeHeadState` lets the trainer collect the rest
without re-implementing trl's batching loop.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field

import torch
from transformers.utils import ModelOutput

from safevocab import NoPruning, SafeVocabRule, fused_safe_logprobs
from safevocab.logprobs import DEFAULT_MAX_CHUNK_BYTES
from trl_integration.grpo.replay import select_support

__all__ = ["SafeCausalLMOutput", "SafeHeadState", "add_safe_lm_head", "lm_head_transform"]


@dataclass
class SafeCausalLMOutput(ModelOutput):
    """Output of a model patched by :func:`add_safe_lm_head` and called with ``fused_lm_head=True``.

    Per-token fields have shape ``[batch, seq_len - 1]`` (``[batch, seq_len]`` with ``shift_labels``) and are
    zero (``in_safe``: True, ``safe_size``: 0) where the label is ``-100``.

    Attributes:
        loss: mean negative safe log-likelihood over the scored tokens (or divided by ``num_items_in_batch``).
        log_probs: fp32 ``log pi_S(y)`` (full log-softmax where ``y`` is outside ``S``).
        entropy: fp32 entropy of ``pi_S``, or ``None`` when not requested.
        in_safe: bool, whether the label is in the safe set.
        log_kept_mass: fp32 ``log(1 - m)``, ``m`` the pruned mass.
        safe_size: int64 ``|S|``.
        label_mask: bool, whether the label was scored.
        aux_loss: MoE load-balancing loss, when router logits were requested.
        replay_size: int64 ``|R|`` of the replayed set (``None`` without replay).
        rule_safe_size: int64 ``|S|`` the rule alone picks on the same logits (``None`` without replay).
        entropy_full: fp32 entropy of the full softmax (no pruning), when :attr:`SafeHeadState.full_entropy` asks for
            it together with the entropy (``None`` otherwise).
    """

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    in_safe: torch.Tensor | None = None
    log_kept_mass: torch.Tensor | None = None
    safe_size: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    replay_size: torch.Tensor | None = None
    rule_safe_size: torch.Tensor | None = None
    entropy_full: torch.Tensor | None = None


@dataclass
class SafeHeadState:
    """Shared, mutable switches of the patched heads (one instance per trainer, shared by policy and reference).

    ``compute_entropy`` tells the head whether to compute the entropy of ``pi_S`` (trl only needs it for the
    policy's loss pass). While ``records`` is a list, each safe forward appends its ``SafeCausalLMOutput``.
    ``full_entropy`` (``log_entropy_metrics``) also asks, whenever the entropy is computed, for the entropy of the
    full softmax (one more no-grad head pass when the set prunes).

    Replay (``safe_vocab_support="replay"``): ``supports`` holds one replayed
    :class:`~safevocab.SafeSupport` per sequence of the scoring call; each forward (one chunk of trl's batching
    loop, chunks in order) takes the next ``batch`` of them (:meth:`take_supports`). ``support_only``: a replayed set
    is the whole safe set, not intersected with the rule's set on the same logits; for an engine that sampled a
    distribution the trainer's logits do not show (a grammar, ``vllm_structured_outputs_regex``; a penalty, bias or
    ban of vLLM's, :mod:`~trl_integration.grpo.generation_settings`), whose kept set the rule's set on the unshaped
    logits need not even meet.
    """

    compute_entropy: bool = True
    full_entropy: bool = False
    support_only: bool = False
    records: list | None = field(default=None)
    supports: list | None = field(default=None)
    _cursor: int = 0

    def begin(self, compute_entropy: bool, supports: list | None = None) -> None:
        self.compute_entropy = compute_entropy
        self.records = []
        self.supports, self._cursor = supports, 0

    def end(self) -> list:
        records, self.records = self.records or [], None
        self.compute_entropy = True
        self.supports, self._cursor = None, 0
        return records

    def take_supports(self, batch: int) -> list | None:
        """The replayed supports of the next ``batch`` sequences, or ``None`` without replay."""
        if self.supports is None:
            return None
        taken = self.supports[self._cursor : self._cursor + batch]
        if len(taken) != batch:
            raise RuntimeError(
                f"the head scores {batch} more sequences than the {len(self.supports)} replayed supports"
            )
        self._cursor += batch
        return taken


def lm_head_transform(config) -> tuple[float | None, float]:
    """``(softcap, logit_scale)`` the model's own forward applies to its logits, read as trl's head reads them.

    Softcap: ``final_logit_softcapping`` (Gemma 2/3). Scale: ``logit_scale`` (Cohere), ``output_multiplier``,
    ``lm_head_multiplier`` (Falcon-H1), ``1 / logits_scaling`` (Granite, MiniCPM3; HyperCLOVA X multiplies).
    The sampler sees these already applied (they are part of the model's forward), so the trainer must apply
    them before the temperature to score the same distribution.
    """
    text_config = config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if getattr(text_config, "model_type", None) == "hyperclovax" else 1.0 / scaling
    return (None if not softcap else float(softcap)), (1.0 if scale is None else float(scale))


def add_safe_lm_head(
    model: torch.nn.Module,
    rule: SafeVocabRule,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    state: SafeHeadState | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    keep_logits_bytes: int = 0,
) -> SafeHeadState:
    """Patch ``model`` so that ``model(..., labels=labels, fused_lm_head=True)`` returns safe log-probabilities.

    Works on top of trl's ``add_fused_lm_head`` (or on an unpatched model): calls without ``fused_lm_head``
    (generation, plain forwards) go to the previous forward unchanged.

    Args:
        model: a transformers causal LM (unwrapped; for PEFT, the base model).
        rule: the safe-vocabulary rule (the sampler's rule).
        temperature: the sampling temperature (> 0).
        cast_lm_head_to_fp32: run the head projection in fp32, as trl's ``cast_lm_head_to_fp32``.
        state: shared :class:`SafeHeadState`; a new one is created when ``None``.
        max_chunk_bytes: scratch budget of one chunk in :func:`safevocab.fused_safe_logprobs`.
        keep_logits_bytes: the scoring call's cap on the chunk logits its forward keeps for the backward
            (:func:`safevocab.fused_safe_logprobs`; 0: recompute). The no-grad metric passes keep nothing.

    Returns:
        The :class:`SafeHeadState` the patched forward reads.
    """
    from torch.distributed.tensor import DTensor

    from trl_integration._private import maybe_gather_lm_head_ctx

    state = state if state is not None else SafeHeadState()
    previous_forward = model.forward
    text_config = model.config.get_text_config()
    softcap, logit_scale = lm_head_transform(model.config)

    @functools.wraps(type(model).forward)
    def _safe_forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        if not fused_lm_head:
            if labels is not None:
                kwargs["labels"] = labels
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return previous_forward(*args, **kwargs)

        # Looked up on every call: FSDP and PEFT replace the backbone and head after patching.
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone_outputs = self.base_model(*args, **kwargs)
        if shift_labels is None:
            hidden_states = backbone_outputs.last_hidden_state[:, :-1]
            labels = labels[:, 1:]
        else:
            hidden_states = backbone_outputs.last_hidden_state
            labels = shift_labels
        lm_head = self.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        if isinstance(weight, DTensor):  # FSDP2: gather the sharded head once, with a reduced gradient
            weight = _gather_data_parallel(weight)
            if bias is not None:
                bias = _gather_data_parallel(bias)
        hidden_states = hidden_states.to(weight.device)
        labels = labels.to(weight.device)
        mask = labels != -100

        # fused_safe_logprobs wants one dtype: the head's GEMM runs in the autocast dtype when autocast is on
        # (as nn.Linear would), in fp32 with cast_lm_head_to_fp32, else in the weight's dtype.
        device_type = hidden_states.device.type
        if cast_lm_head_to_fp32:
            dtype = torch.float32
        elif torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = weight.dtype
        replayed = state.take_supports(labels.shape[0])
        support = None if replayed is None else select_support(replayed, mask)
        with maybe_gather_lm_head_ctx(lm_head.weight, lm_head.bias), torch.autocast(device_type, enabled=False):
            head_weight = weight.to(dtype)
            head_bias = None if bias is None else bias.to(dtype)
            scored_hidden = hidden_states[mask].to(dtype)
            transform = dict(bias=head_bias, temperature=temperature, softcap=softcap, logit_scale=logit_scale)
            out = fused_safe_logprobs(
                scored_hidden,
                head_weight,
                labels[mask],
                NoPruning() if support is not None and state.support_only else rule,
                **transform,
                compute_entropy=state.compute_entropy,
                max_chunk_bytes=max_chunk_bytes,
                keep_logits_bytes=keep_logits_bytes,
                weight_gather=_backward_gather(lm_head, head_weight, head_bias),
                support=support,
            )
            entropy_full = out.entropy
            if (
                state.full_entropy
                and out.entropy is not None
                and (support is not None or not isinstance(rule, NoPruning))
            ):
                with torch.no_grad():  # the policy's full-softmax entropy, a metric: no gradient, no replayed set
                    entropy_full = fused_safe_logprobs(
                        scored_hidden.detach(), head_weight.detach(), labels[mask], NoPruning(),
                        **{k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in transform.items()},
                        compute_entropy=True, max_chunk_bytes=max_chunk_bytes,
                    ).entropy  # fmt: skip
            rule_size = None
            if support is not None:
                # The rule's own |S| on the same logits (one no-grad head pass): with |R| and |S & R| (out.safe_size)
                # it tells whether the replayed set equals the rule's (safevocab/support_disagreement).
                with torch.no_grad():
                    rule_size = fused_safe_logprobs(
                        scored_hidden.detach(), head_weight.detach(), labels[mask], rule,
                        **{k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in transform.items()},
                        max_chunk_bytes=max_chunk_bytes,
                    ).safe_size  # fmt: skip

        def scatter(x, fill):
            if x is None:
                return None
            # masked_scatter keeps the output connected to the graph even when no label is scored
            return torch.full(mask.shape, fill, dtype=x.dtype, device=x.device).masked_scatter(mask, x)

        log_probs = scatter(out.logprobs, 0.0)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            aux_loss = load_balancing_loss_func(
                backbone_outputs.router_logits,
                text_config.num_experts,
                text_config.num_experts_per_tok,
                kwargs.get("attention_mask"),
            )
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        result = SafeCausalLMOutput(
            loss=loss,
            log_probs=log_probs,
            entropy=scatter(out.entropy, 0.0),
            in_safe=scatter(out.in_safe, True),
            log_kept_mass=scatter(out.log_kept_mass.detach(), 0.0),
            safe_size=scatter(out.safe_size, 0),
            label_mask=mask,
            aux_loss=aux_loss,
            replay_size=None if support is None else scatter(support.sizes, 0),
            rule_safe_size=scatter(rule_size, 0),
            entropy_full=scatter(entropy_full.detach(), 0.0)
            if state.full_entropy and entropy_full is not None
            else None,
        )
        if state.records is not None:
            state.records.append(result)
        return result

    model.forward = types.MethodType(_safe_forward, model)
    model._safevocab_head = (rule, float(temperature), softcap, logit_scale)
    return state


def _gather_data_parallel(param: torch.Tensor) -> torch.Tensor:
    """The full value of a sharded FSDP2 ``DTensor`` parameter, whose gradient is averaged over the mesh.

    The head's parameters are a ``DTensor`` here only when the LM head is its own ``fully_shard`` group: the
    patched forward never calls the head module, so FSDP's hooks for that group never run, and nothing reduces its
    gradient across the data-parallel ranks. ``full_tensor()`` alone (trl's fused head) declares the gathered
    copy's gradient *replicated*, so its backward merely slices this rank's shard out of this rank's own
    gradient: each rank would update its shard from its own data only. Declaring the gradient ``Partial("avg")``
    makes the backward reduce-scatter it with the average, FSDP2's default gradient reduction. (A head in the
    root's group — accelerate's transformer-layer wrap policy — arrives here unsharded, as a plain tensor, and
    FSDP reduces its gradient itself.)
    """
    from torch.distributed.tensor import Partial, Replicate

    ndim = param.device_mesh.ndim
    return param.redistribute(placements=[Replicate()] * ndim).to_local(grad_placements=[Partial("avg")] * ndim)


def _backward_gather(lm_head: torch.nn.Module, head_weight: torch.Tensor, head_bias: torch.Tensor | None):
    """The ``weight_gather`` hook of :func:`safevocab.fused_safe_logprobs` for ``lm_head``, or ``None``.

    Under DeepSpeed ZeRO-3 the head's parameters hold their values only while gathered: trl's
    ``maybe_gather_lm_head_ctx`` gathers them around the forward, and the fused backward, which recomputes the
    logits from the weight after that context has exited, must gather them again (as trl's own chunked head
    does). Only needed when the kernel was handed the parameters themselves: a dtype cast (``.to(dtype)``) made
    inside the forward's gather is a full copy that autograd keeps alive for the backward. FSDP2 needs no hook
    (a sharded head is gathered into a full copy by :func:`_gather_data_parallel`, a root-group head is
    unsharded by FSDP's own hooks around the model's forward and backward).
    """
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return None
    pairs = ((lm_head.weight, head_weight), (lm_head.bias, head_bias))
    params = [param for param, used in pairs if param is not None and param is used]
    if not params:
        return None
    from trl_integration._private import maybe_gather_lm_head_ctx

    return functools.partial(maybe_gather_lm_head_ctx, *params)
