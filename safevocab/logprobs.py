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

Arithmetic is max-shifted everywhere: with ``m = max_a z_a``,
``log pi_S(y) = (z_y - m) - log sum_{a in S} exp(z_a - m)``, so tied logits at ``temperature=1e-7``
still give ``-log 3`` (forming ``m + log sum`` first would round the ``log 3`` away).

Non-finite input: ``-inf`` logits (and ``-inf`` bias entries) are allowed: such a token has
probability 0 and is never in ``S``, with or without softcap. A NaN or ``+inf`` logit, a row whose
every logit is ``-inf``, NaN/inf in ``hidden`` or ``weight``, NaN/``+inf`` in ``bias``, and a
temperature or GEMM that overflows raise a one-line ``ValueError`` naming the argument. Cheap checks
(``bias``, the scalars) run before any work; the others are read off the row statistics the op
computes anyway (a non-finite row maximum or ``log sum_V exp(z - m)``), so they cost no extra pass. The fused op
reads the checks of device values (``bias`` values, the target ids' range) with those statistics, in its forward's one
host read (:class:`~safevocab.fused.row_stats.CallReads`), and raises the same errors in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from safevocab.backends.registry import get_backend, replay_backend, resolve_backend
from safevocab.fused.checks import raise_on_empty_support
from safevocab.fused.op import FusedSafeLogProbs
from safevocab.fused.row_stats import CallReads
from safevocab.fused.transform import Transform
from safevocab.rules import SafeVocabRule, parse_rule, stat_float
from safevocab.support import SafeSupport
from safevocab.validation import boolean, integer, not_meta, real

__all__ = [
    "SafeLogProbs",
    "safe_log_softmax",
    "fused_safe_logprobs",
    "transform_logits",
    "DEFAULT_MAX_CHUNK_BYTES",
]

#: Default memory budget for the fp32 scratch of one chunk of rows in :func:`fused_safe_logprobs`.
DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20


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
# Validation shared by both entry points: every check runs before any work (docs/guide.md, "Non-finite input"), except
# the fused op's checks of device values, read with its own at the end of its forward.


def _check_transform(temperature: object, softcap: object, logit_scale: object) -> tuple[float, float | None, float]:
    """The transform's scalars as Python floats (any real scalar type accepted); raises on bad ones."""
    positive = "a finite {} > 0"
    return (
        real("temperature", temperature, lambda x: x > 0, positive.format("temperature")),
        None if softcap is None else real("softcap", softcap, lambda x: x > 0, "None or " + positive.format("softcap")),
        real("logit_scale", logit_scale, lambda x: x > 0, positive.format("logit_scale")),
    )


def _check_targets(
    targets: torch.Tensor, expected_shape: torch.Size, vocab_size: int, shape_name: str, reads: CallReads | None = None
) -> None:
    """Type and shape now; the ids' range now, or, with ``reads``, queued there (read with the fused op's checks)."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor of token ids, got {type(targets).__name__}")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"targets.dtype={targets.dtype} is not accepted: accepted an integer dtype (token ids)")
    not_meta("targets", targets)
    if targets.shape != expected_shape:
        raise ValueError(f"targets.shape={tuple(targets.shape)} does not match {shape_name}={tuple(expected_shape)}")
    if targets.numel() == 0:
        return
    extremes = torch.stack([targets.min(), targets.max()]).long()
    if reads is not None:
        reads.add("targets", extremes, lambda ids: _check_target_range(*ids, vocab_size))
    else:
        _check_target_range(*extremes.tolist(), vocab_size)  # host sync: the materialised path's own check


def _check_target_range(lo: int, hi: int, vocab_size: int) -> None:
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"targets contain token id {bad}: accepted 0 <= id < vocab_size={vocab_size}")


def _check_float(name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}.dtype={x.dtype} is not accepted: accepted float32, bfloat16, float16 or float64")
    not_meta(name, x)


def _check_bias_values(bias: torch.Tensor, reads: CallReads | None = None) -> None:
    """``-inf`` entries are allowed (tokens of probability 0); NaN and ``+inf`` are not. ``[V]``: cheap. With
    ``reads``, the flag is queued there (read with the fused op's checks) and this runs again, reading, if it is set."""
    bad = torch.isnan(bias) | (bias == math.inf)
    if reads is not None:
        reads.add("bias", bad.any(), lambda flag: flag[0] and _check_bias_values(bias))
        return
    if bool(bad.any()):  # host sync: on the error path only (the fused op reads the flag with its checks)
        index = int(bad.nonzero()[0])
        raise ValueError(
            f"bias has value {bias[index].item()!r} at token {index}: accepted finite values or -inf (a banned token)"
        )


def _raise_on_non_finite_logits(
    logits: torch.Tensor,
    z: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    temperature: float,
    logit_scale: float,
) -> None:
    """One-line ``ValueError`` naming the argument when a row of transformed logits has no finite
    ``log softmax``: read off the row statistics (``[...]``), so the common case costs no extra pass."""
    bad = ~(torch.isfinite(row_max) & torch.isfinite(log_sum))
    if not bool(bad.any()):
        return
    index = tuple(int(i) for i in bad.nonzero()[0])
    raw, row = logits[index], z[index]
    where = f"at row {index if len(index) > 1 else index[0]}"
    if bool(torch.isnan(raw).any()):
        raise ValueError(f"logits has a NaN {where}: accepted finite logits or -inf")
    if bool((raw == math.inf).any()):
        raise ValueError(f"logits has +inf {where}: accepted finite logits or -inf")
    if not bool((raw != -math.inf).any()):
        raise ValueError(f"logits is -inf for every token {where}: no token has a probability > 0")
    raise ValueError(
        f"temperature={temperature!r} with logit_scale={logit_scale!r} makes the logits overflow {row.dtype} {where} "
        f"(max |logit| {float(raw[torch.isfinite(raw)].abs().max()):.4g}); accepted a larger temperature"
    )


def _as_rule(rule: SafeVocabRule | str | None) -> SafeVocabRule:
    return parse_rule(rule)


def _check_support(support: object, n_targets: int, vocab_size: int, device: torch.device) -> None:
    if support is None:
        return
    if not isinstance(support, SafeSupport):
        raise TypeError(f"support must be a safevocab.SafeSupport or None, got {type(support).__name__}")
    # host sync: the ids are checked before any backend indexes a row with them (the torch backend's mask would raise
    # IndexError first)
    support.check(vocab_size, n_targets)


def _on_device(support: SafeSupport, device: torch.device) -> SafeSupport:
    """``support`` on ``device``: itself when it is there (``SafeSupport.to`` builds a new one, validated again: host
    reads of the device)."""
    if support.token_ids.device == device and support.offsets.device == device:
        return support
    return support.to(device)  # host sync: a support moved to the device is validated again there


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
        fp32 transformed logits ``[..., V]`` (fp64 for fp64 input; differentiable). ``-inf`` stays
        ``-inf`` through the softcap.
    """
    _check_float("logits", logits)
    temperature, softcap, logit_scale = _check_transform(temperature, softcap, logit_scale)
    z = stat_float(logits)
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        # c * tanh(-inf / c) = -c would give a banned token a probability: keep it -inf
        z = torch.where(z == -math.inf, z, softcap * torch.tanh(z / softcap))
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
    support: SafeSupport | None = None,
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
        support: a replayed :class:`~safevocab.support.SafeSupport` with one row per target (in the targets'
            flattened order): ``S`` is exactly its ids, intersected with ``rule``'s set when a rule is given
            too, and with the tokens of nonzero probability.

    Returns:
        :class:`SafeLogProbs` with tensors of shape ``[...]``. ``logprobs``, ``log_kept_mass`` and
        ``entropy`` are differentiable with respect to ``logits``.
    """
    _check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: expected [..., V] with a vocabulary size V >= 1")
    _check_targets(targets, logits.shape[:-1], logits.shape[-1], "logits.shape[:-1]")
    temperature, softcap, logit_scale = _check_transform(temperature, softcap, logit_scale)
    compute_entropy = boolean("compute_entropy", compute_entropy)
    rule = _as_rule(rule)
    _check_support(support, targets.numel(), logits.shape[-1], logits.device)

    z = transform_logits(logits, temperature, softcap, logit_scale)
    threshold, row_max = rule.threshold_and_max(z.detach())  # S is a selection: no gradient flows through it
    keep = z >= threshold
    if support is not None:
        keep &= support.to(logits.device).to_dense(logits.shape[-1]).view(logits.shape)
    # Max-shifted: (z - m) keeps full precision where m + log(sum) would round log(sum) away. m is a
    # constant shift (detached), which leaves every log-softmax value and gradient unchanged.
    shifted = z - row_max
    # shifted's maximum is exactly 0, so log sum exp(shifted) is logsumexp's own arithmetic (its max is 0) without
    # its max pass; e is shared with the safe sum below
    e = shifted.exp()
    lse_full = e.sum(-1).log()
    _raise_on_non_finite_logits(logits, z, row_max.squeeze(-1), lse_full, temperature, logit_scale)
    if support is not None:
        raise_on_empty_support(keep.reshape(-1, keep.shape[-1]).sum(-1), rule)
    idx = targets.long().unsqueeze(-1)
    shifted_y = shifted.gather(-1, idx).squeeze(-1)
    in_safe = keep.gather(-1, idx).squeeze(-1)
    if support is None:  # S holds the argmax (e = 1 there): the safe sum is >= 1
        shifted_safe = shifted
        lse_safe = torch.where(keep, e, 0.0).sum(-1).log()
        log_kept_mass = lse_safe - lse_full
    else:
        # A replayed S need not hold the argmax and may sit far below it: pi_S is formed from z - m_S, S's own
        # (detached) maximum, as the fused op does. fl(z - m) would lose S's differences when m_S is far below m
        # (z - m rounds to a multiple of ulp(m - m_S): 2 at 3e7, so [0, 0.3] below 3e7 became a tie and a 0.3 gap).
        set_max = z.detach().masked_fill(~keep, -math.inf).amax(-1, keepdim=True)  # finite: no S is empty here
        shifted_safe = z - set_max
        lse_safe = torch.logsumexp(shifted_safe.masked_fill(~keep, -math.inf), dim=-1)
        log_kept_mass = (set_max - row_max).squeeze(-1) + lse_safe - lse_full
    shifted_safe_y = shifted_safe.gather(-1, idx).squeeze(-1)
    logprobs = torch.where(in_safe, shifted_safe_y - lse_safe, shifted_y - lse_full)
    entropy = None
    if compute_entropy:
        log_p_safe = (shifted_safe - lse_safe.unsqueeze(-1)).masked_fill(~keep, 0.0)  # 0 outside S: no 0 * -inf
        entropy = -(log_p_safe.exp().masked_fill(~keep, 0.0) * log_p_safe).sum(-1)
    return SafeLogProbs(
        logprobs=logprobs,
        in_safe=in_safe,
        log_kept_mass=log_kept_mass,
        safe_size=keep.sum(-1),
        entropy=entropy,
    )


# --------------------------------------------------------------------------------------------------
# Fused version (the autograd function lives in safevocab/fused/op.py, the backends in safevocab/backends/)


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
    support: SafeSupport | None = None,
    keep_logits_bytes: int = 0,
) -> SafeLogProbs:
    """Safe-vocabulary log-probabilities of ``targets`` under ``hidden @ weight.T (+ bias)``, fused.

    Same outputs as :func:`safe_log_softmax` on ``hidden @ weight.T + bias`` (within fp32 tolerance),
    without ever materialising the ``[N, V]`` logits: rows are processed in chunks whose fp32 scratch
    fits ``max_chunk_bytes``, and backward recomputes each chunk (one extra GEMM, like trl's
    ``ChunkedLogProbFunction`` and Liger's fused losses) unless ``keep_logits_bytes`` lets the forward keep it.

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
            is about this plus an fp32 ``[V, H]`` weight-gradient accumulator (plus ``keep_logits_bytes`` at most,
            held from the forward to the backward).
        backend: ``"auto"`` (Triton kernels when the tensors are on CUDA and ``triton`` imports, else
            torch), ``"torch"``, or ``"triton"`` (forces the kernels; CPU tensors only under Triton's
            interpreter, ``TRITON_INTERPRET=1``). See :mod:`safevocab.backends.registry`.
        weight_gather: for a sharded ``weight``/``bias`` that hold their full values only inside a context
            (DeepSpeed ZeRO-3 parameters: ``deepspeed.zero.GatheredParameters``, trl's
            ``maybe_gather_lm_head_ctx``), a zero-argument callable returning that context manager. The caller
            holds the weight gathered around this call, as for any direct use of such a parameter; the backward,
            which runs after that context has exited and re-reads the weight (it recomputes the logits instead of
            storing them), enters ``weight_gather()`` again. ``None`` (the default) enters nothing. An FSDP2
            ``DTensor`` weight needs no hook: pass ``weight.full_tensor()``, whose backward reduce-scatters the
            gradient.
        support: a replayed :class:`~safevocab.support.SafeSupport` (one row per target, flattened order): ``S`` is
            exactly its ids, intersected with ``rule``'s set and the tokens of nonzero probability. Same outputs,
            same memory class (the kept ids become a boolean mask one chunk at a time, never ``[N, V]``), the
            sparse backward whenever the sets are small. Runs on the torch backend (the Triton kernels take
            threshold rules only).
        keep_logits_bytes: memory the forward may spend keeping chunks' logits for the backward, which then folds them
            instead of recomputing them: the same outputs and gradients bit for bit, one LM-head GEMM fewer a kept
            chunk (forward + backward of a call whose chunks are all kept: 3 GEMMs instead of 4). Default 0: recompute
            every chunk. Chunks are kept in forward order while their buffers fit; the rest recompute. A kept chunk
            costs ``rows x V x itemsize`` bytes from the forward to the backward: the GEMM output in the inputs' dtype
            (2 bytes a logit for bf16/fp16: ``N = 8192``, ``V = 151936`` bf16 takes 2.49 GB for the whole call), or on
            the Triton backend's torch-threshold route (rules without a kernel threshold, fp64 inputs) the fp32/fp64
            transformed copy its fold reads. The buffers serve one backward: it drops them when it ends, and a second
            one (``retain_graph=True``) recomputes. Nothing is kept when no input needs a gradient.

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
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight.shape={tuple(weight.shape)}: expected [V, H] with V >= 1 and H >= 1")
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
    # the checks of values on the device (bias values, target ids) are read with the op's own, at the end of its
    # forward: one host read per call (docs/performance.md, "Host synchronisation")
    reads = CallReads()
    if bias is not None:
        _check_float("bias", bias)
        if bias.shape != (vocab,):
            raise ValueError(f"bias.shape={tuple(bias.shape)}: expected [V]=({vocab},)")
        _check_bias_values(bias, reads)
    _check_targets(targets, hidden.shape[:-1], vocab, "hidden.shape[:-1]", reads)
    temperature, softcap, logit_scale = _check_transform(temperature, softcap, logit_scale)
    compute_entropy = boolean("compute_entropy", compute_entropy)
    max_chunk_bytes = integer("max_chunk_bytes", max_chunk_bytes, lambda x: x > 0, "an integer > 0")
    keep_logits_bytes = integer(
        "keep_logits_bytes", keep_logits_bytes, lambda x: x >= 0, "an integer >= 0 (0: recompute)"
    )
    # "auto" -> a backend for the tensors' device; raises on an unknown name or an unusable named backend
    backend_impl = get_backend(resolve_backend(backend, hidden.device))
    rule = _as_rule(rule)
    _check_support(support, targets.numel(), vocab, hidden.device)
    if support is not None:
        backend_impl = replay_backend(backend_impl)

    out_shape = targets.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    # clamped: the ids are checked only at the end of the forward, and no kernel may read past a row before that (the
    # op raises on any id out of range; valid ids are unchanged)
    flat_targets = targets.reshape(-1).long().clamp(0, vocab - 1)
    if bias is not None:
        bias = bias.to(hidden.dtype)
    transform = Transform(temperature, softcap, logit_scale)
    chunk_rows = backend_impl.rows_per_chunk(hidden2d.shape[0], vocab, rule, hidden.element_size(), max_chunk_bytes)
    logprobs, log_kept, entropy, in_safe, safe_size = FusedSafeLogProbs.apply(
        hidden2d,
        weight,
        bias,
        flat_targets,
        rule,
        transform,
        compute_entropy,
        chunk_rows,
        backend_impl,
        weight_gather,
        None if support is None else _on_device(support, hidden.device),
        reads,
        # autograd tells the op which inputs need a gradient, not whether a graph is recorded: no backward can follow a
        # forward under no_grad/inference_mode, so it keeps nothing
        keep_logits_bytes if torch.is_grad_enabled() else 0,
    )
    return SafeLogProbs(
        logprobs=logprobs.reshape(out_shape),
        in_safe=in_safe.reshape(out_shape),
        log_kept_mass=log_kept.reshape(out_shape),
        safe_size=safe_size.reshape(out_shape),
        entropy=entropy.reshape(out_shape) if entropy is not None else None,
    )
