"""Masked (safe-vocabulary) log-softmax, on materialised logits and fused with the LM head.

Both entry points compute, per position with target ``y`` and safe set ``S`` (see
:mod:`safevocab.rules`):

- ``logprobs``: ``log pi_S(y) = z_y - logsumexp_{a in S} z_a`` when ``y in S``; the full log-softmax
  ``z_y - logsumexp_a z_a`` (value and gradient) when ``y`` is outside ``S``;
- ``in_safe``: whether ``y in S`` (callers mask the other tokens);
- ``log_kept_mass``: ``log(1 - m) <= 0`` with ``m`` the probability mass pruned away;
- ``safe_size``: ``|S|``; and optionally ``entropy`` of ``pi_S``.

``S`` is a selection and is not differentiated: ``d log pi_S(y) / d z_a = 1[a=y] - pi_S(a) 1[a in S]``.
Logits are transformed as the sampler does, in this order: ``logit_scale``, softcap
``c * tanh(z / c)``, division by ``temperature``. Statistics are kept in fp32 for any input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from safevocab._chunked import FusedSafeLogProbs, Transform, chunk_rows_for
from safevocab.rules import SafeVocabRule, parse_rule, stat_float

__all__ = [
    "SafeLogProbs",
    "safe_log_softmax",
    "fused_safe_logprobs",
    "transform_logits",
    "DEFAULT_MAX_CHUNK_BYTES",
]

#: Default memory budget for the fp32 scratch of one chunk of rows in :func:`fused_safe_logprobs`.
DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20

_BACKENDS = ("auto", "torch", "triton")


@dataclass
class SafeLogProbs:
    """Per-position outputs of the safe log-softmax. Every tensor has the targets' shape ``[...]``.

    Attributes:
        logprobs: fp32 ``log pi_S(y)`` for ``y in S``; full log-softmax for ``y`` outside ``S``.
        in_safe: bool, whether the target is in the safe set.
        log_kept_mass: fp32 ``log(1 - m) <= 0``, ``m`` the pruned probability mass.
        safe_size: int64 ``|S|``.
        entropy: fp32 entropy of ``pi_S`` (nats), or ``None`` unless ``compute_entropy=True``.
    """

    logprobs: torch.Tensor
    in_safe: torch.Tensor
    log_kept_mass: torch.Tensor
    safe_size: torch.Tensor
    entropy: torch.Tensor | None = None


# --------------------------------------------------------------------------------------------------
# Validation shared by both entry points: every check runs before any work (DESIGN §6).


def _check_transform(temperature: float, softcap: float | None, logit_scale: float) -> None:
    if not _is_positive_real(temperature):
        raise ValueError(f"temperature={temperature!r} is out of range: accepted a finite temperature > 0")
    if softcap is not None and not _is_positive_real(softcap):
        raise ValueError(f"softcap={softcap!r} is out of range: accepted None or a finite softcap > 0")
    if not _is_positive_real(logit_scale):
        raise ValueError(f"logit_scale={logit_scale!r} is out of range: accepted a finite logit_scale > 0")


def _is_positive_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _check_targets(targets: torch.Tensor, expected_shape: torch.Size, vocab_size: int, shape_name: str) -> None:
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor of token ids, got {type(targets).__name__}")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"targets.dtype={targets.dtype} is not accepted: accepted an integer dtype (token ids)")
    if targets.shape != expected_shape:
        raise ValueError(
            f"targets.shape={tuple(targets.shape)} does not match {shape_name}={tuple(expected_shape)}"
        )
    if targets.numel() > 0:
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"targets contain token id {bad}: accepted 0 <= id < vocab_size={vocab_size}")


def _check_float(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}.dtype={x.dtype} is not accepted: accepted float32, bfloat16, float16 or float64")


def _as_rule(rule: SafeVocabRule | str | None) -> SafeVocabRule:
    return parse_rule(rule)


# --------------------------------------------------------------------------------------------------
# Logit transform (the sampler's order)


def transform_logits(
    logits: torch.Tensor, temperature: float = 1.0, softcap: float | None = None, logit_scale: float = 1.0
) -> torch.Tensor:
    """Apply ``logit_scale``, then softcap ``c * tanh(z / c)``, then ``/ temperature``, as samplers do.

    Args:
        logits: raw logits ``[..., V]``; returned in fp32.
        temperature: sampling temperature (> 0).
        softcap: final-logit softcap ``c`` (> 0) or ``None``.
        logit_scale: multiplier applied first (> 0), e.g. Cohere/Granite ``logit_scale``.

    Returns:
        fp32 transformed logits ``[..., V]`` (fp64 for fp64 input; differentiable).
    """
    _check_transform(temperature, softcap, logit_scale)
    z = stat_float(logits)
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if temperature != 1.0:
        z = z / temperature
    return z


# --------------------------------------------------------------------------------------------------
# Materialised version


def safe_log_softmax(
    logits: torch.Tensor,
    targets: torch.Tensor,
    rule: SafeVocabRule | str | None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    compute_entropy: bool = False,
) -> SafeLogProbs:
    """Safe-vocabulary log-probabilities of ``targets`` on materialised logits.

    Args:
        logits: ``[..., V]`` float logits (any float dtype; computed in fp32).
        targets: ``[...]`` integer token ids in ``[0, V)``.
        rule: a :class:`~safevocab.rules.SafeVocabRule`, a rule string such as ``"min_p=1e-3"``, or
            ``None``/``"none"`` for the full softmax.
        temperature: divides the logits after scale and softcap (> 0).
        softcap: final-logit softcap ``c`` (> 0) or ``None``.
        logit_scale: multiplies the logits first (> 0).
        compute_entropy: also return the entropy of ``pi_S``.

    Returns:
        :class:`SafeLogProbs` with tensors of shape ``[...]``. ``logprobs``, ``log_kept_mass`` and
        ``entropy`` are differentiable with respect to ``logits``.
    """
    _check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension [..., V]")
    _check_targets(targets, logits.shape[:-1], logits.shape[-1], "logits.shape[:-1]")
    _check_transform(temperature, softcap, logit_scale)
    rule = _as_rule(rule)

    z = transform_logits(logits, temperature, softcap, logit_scale)
    keep = z >= rule.threshold(z.detach())  # S is a selection: no gradient flows through it
    idx = targets.long().unsqueeze(-1)
    z_y = z.gather(-1, idx).squeeze(-1)
    in_safe = keep.gather(-1, idx).squeeze(-1)
    lse_full = torch.logsumexp(z, dim=-1)
    z_safe = z.masked_fill(~keep, -math.inf)
    lse_safe = torch.logsumexp(z_safe, dim=-1)
    logprobs = torch.where(in_safe, z_y - lse_safe, z_y - lse_full)
    entropy = None
    if compute_entropy:
        log_p_safe = (z - lse_safe.unsqueeze(-1)).masked_fill(~keep, 0.0)  # 0 outside S: no 0 * -inf
        entropy = -(log_p_safe.exp().masked_fill(~keep, 0.0) * log_p_safe).sum(-1)
    return SafeLogProbs(
        logprobs=logprobs,
        in_safe=in_safe,
        log_kept_mass=lse_safe - lse_full,
        safe_size=keep.sum(-1),
        entropy=entropy,
    )


# --------------------------------------------------------------------------------------------------
# Fused version (the autograd function lives in safevocab/_chunked.py)


def fused_safe_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rule: SafeVocabRule | str | None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    compute_entropy: bool = False,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    backend: str = "auto",
    weight_gather: Callable[[], AbstractContextManager] | None = None,
) -> SafeLogProbs:
    """Safe-vocabulary log-probabilities of ``targets`` under ``hidden @ weight.T (+ bias)``, fused.

    Same outputs as :func:`safe_log_softmax` on ``hidden @ weight.T + bias`` (within fp32 tolerance),
    without ever materialising the ``[N, V]`` logits: rows are processed in chunks whose fp32 scratch
    fits ``max_chunk_bytes``, and backward recomputes each chunk (one extra GEMM, like trl's
    ``ChunkedLogProbFunction`` and Liger's fused losses).

    Args:
        hidden: ``[N, H]`` (or ``[..., H]``) final hidden states, float32/bfloat16/float16/float64.
        weight: ``[V, H]`` LM-head weight, same dtype as ``hidden``.
        targets: ``[N]`` (or ``[...]``) token ids in ``[0, V)``.
        rule: a :class:`~safevocab.rules.SafeVocabRule`, a rule string (``"min_p=1e-3"``) or
            ``None``/``"none"``.
        bias: optional ``[V]`` LM-head bias (``-inf`` entries allowed: such tokens are never kept).
        temperature: divides the logits after scale and softcap (> 0).
        softcap: final-logit softcap ``c`` (> 0) or ``None``.
        logit_scale: multiplies the logits first (> 0).
        compute_entropy: also return the entropy of ``pi_S``.
        max_chunk_bytes: memory budget for one chunk's scratch (default 64 MiB). Peak extra memory
            is about this plus an fp32 ``[V, H]`` weight-gradient accumulator.
        backend: ``"auto"`` (Triton kernels when the tensors are on CUDA and ``triton`` imports, else
            torch), ``"torch"``, or ``"triton"`` (forces the kernels; CPU tensors only under Triton's
            interpreter, ``TRITON_INTERPRET=1``). See :mod:`safevocab.kernels`.
        weight_gather: for a sharded ``weight``/``bias`` that hold their full values only inside a context
            (DeepSpeed ZeRO-3 parameters: ``deepspeed.zero.GatheredParameters``, trl's
            ``maybe_gather_lm_head_ctx``), a zero-argument callable returning that context manager. The caller
            holds the weight gathered around this call, as for any direct use of such a parameter; the backward,
            which runs after that context has exited and re-reads the weight (it recomputes the logits instead of
            storing them), enters ``weight_gather()`` again. ``None`` (the default) enters nothing. An FSDP2
            ``DTensor`` weight needs no hook: pass ``weight.full_tensor()``, whose backward reduce-scatters the
            gradient.

    Returns:
        :class:`SafeLogProbs` of shape ``[...]`` (the targets' shape). ``logprobs``, ``log_kept_mass``
        and ``entropy`` are differentiable with respect to ``hidden``, ``weight`` and ``bias``.
    """
    if weight_gather is not None and not callable(weight_gather):
        raise TypeError(
            f"weight_gather={weight_gather!r} is not accepted: accepted None or a zero-argument callable returning "
            "a context manager"
        )
    _check_float("hidden", hidden)
    _check_float("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight.shape={tuple(weight.shape)}: expected [V, H]")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden.shape={tuple(hidden.shape)} does not match weight.shape={tuple(weight.shape)}: "
            "expected hidden [..., H] with weight [V, H]"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden.dtype={hidden.dtype} and weight.dtype={weight.dtype} must be equal")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    vocab = weight.shape[0]
    if bias is not None:
        _check_float("bias", bias)
        if bias.shape != (vocab,):
            raise ValueError(f"bias.shape={tuple(bias.shape)}: expected [V]=({vocab},)")
    _check_targets(targets, hidden.shape[:-1], vocab, "hidden.shape[:-1]")
    _check_transform(temperature, softcap, logit_scale)
    if not isinstance(max_chunk_bytes, int) or isinstance(max_chunk_bytes, bool) or max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes={max_chunk_bytes!r} is out of range: accepted an integer > 0")
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not accepted: accepted one of {_BACKENDS}")
    # backend hook: "auto"/"triton" -> "torch" or "triton"; raises on an unusable "triton"
    from safevocab.kernels import resolve_backend, triton_chunk_rows

    backend = resolve_backend(backend, hidden.device)
    rule = _as_rule(rule)

    out_shape = targets.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    if bias is not None:
        bias = bias.to(hidden.dtype)
    transform = Transform(float(temperature), None if softcap is None else float(softcap), float(logit_scale))
    rows_for = triton_chunk_rows if backend == "triton" else chunk_rows_for  # the kernels need less scratch
    chunk_rows = rows_for(hidden2d.shape[0], vocab, rule, hidden.element_size(), max_chunk_bytes)
    logprobs, log_kept, entropy, in_safe, safe_size = FusedSafeLogProbs.apply(
        hidden2d, weight, bias, flat_targets, rule, transform, compute_entropy, chunk_rows, backend, weight_gather
    )
    return SafeLogProbs(
        logprobs=logprobs.reshape(out_shape),
        in_safe=in_safe.reshape(out_shape),
        log_kept_mass=log_kept.reshape(out_shape),
        safe_size=safe_size.reshape(out_shape),
        entropy=entropy.reshape(out_shape) if entropy is not None else None,
    )
