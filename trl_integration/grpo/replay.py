"""Exact support replay in the trainer (``safe_vocab_support="replay"``): the engine's kept token sets, per sequence.

An inference engine that returns the ids surviving its top-k/top-p/min-p for every sampled token (vLLM
``CompletionOutput.sampling_mask``; a ``rollout_func`` returning ``"sampling_mask"``) lets the trainer renormalise
over exactly those sets instead of recomputing them with its rule (:class:`safevocab.SafeSupport`,
``fused_safe_logprobs(..., support=...)``). This module holds the trl-free pieces:

- :func:`per_sequence_supports` turns the engine's masks into one :class:`~safevocab.SafeSupport` per completion (one
  row per completion token). The generation batch (:class:`~trl_integration.grpo.batch.GenerationBatch`) keeps that
  list; each micro-batch trl shuffles and splits from it takes the supports of its own rows.
- :func:`select_support` builds the support of one LM-head call: the rows of the positions the head scores, in
  flattened order. The head scores exactly the completion tokens its attention mask keeps (prompt and padding
  positions carry label ``-100`` and get no row, so they need none); a completion whose tokens are all unscored
  (trl's ``mask_truncated_completions``) contributes no row.
- trl's own vLLM path (no ``rollout_func``; wired by :func:`trl_integration.grpo.vllm_engine.replay_from_engine`):
  :func:`vllm_sampling_masks` reads the masks off vLLM request outputs where the engine returns them (vLLM with
  ``return_sampling_mask=True``, Model Runner V2: GPU); elsewhere (the CPU build's V1 runner returns none)
  :func:`kept_sets_from_logprobs` rebuilds each kept set from the engine's processed log-probabilities of its top-``k``
  tokens (``logprobs=k``, ``logprobs_mode="processed_logprobs"``): a token the sampler cut has processed log-probability
  ``-inf``, so the ids with a finite one are exactly the kept set whenever the rule bounds it by ``top_k=k`` or the
  vocabulary has ``k`` ids (:func:`logprob_bound`) and ``k`` is at most the engine's ``max_logprobs``.

Metrics (:func:`replay_metrics`, called by :meth:`trl_integration.grpo.step.StepMetricInputs.row`): ``safevocab/replay_frac`` and
``safevocab/support_disagreement`` (docs/metrics.md).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from safevocab.rules import SafeVocabRule, TopK
from safevocab.support import SafeSupport

__all__ = [
    "SAMPLING_MASK_KEY",
    "per_sequence_supports",
    "select_support",
    "replay_metrics",
    "REPLAY_FRAC",
    "SUPPORT_DISAGREEMENT",
    "vllm_sampling_masks",
    "logprob_bound",
    "kept_sets_from_logprobs",
    "SupportReplay",
]

#: Key of a ``rollout_func``'s output holding, per completion, one list of kept token ids per completion token.
SAMPLING_MASK_KEY = "sampling_mask"

#: Metrics of ``safe_vocab_support="replay"`` (:func:`replay_metrics`).
REPLAY_FRAC = "safevocab/replay_frac"
SUPPORT_DISAGREEMENT = "safevocab/support_disagreement"


def per_sequence_supports(sampling_mask: Sequence, completion_ids: Sequence[Sequence[int]]) -> list[SafeSupport]:
    """One :class:`~safevocab.SafeSupport` per completion from the engine's masks.

    Args:
        sampling_mask: per completion, either a list with one list of kept ids per completion token (the shape of
            vLLM's ``SamplingMask.token_ids``) or a ``vllm.outputs.SamplingMask`` itself.
        completion_ids: the completions' token ids (the masks must have one row per token).
    """
    if isinstance(sampling_mask, (str, bytes)) or not isinstance(sampling_mask, Sequence):
        raise TypeError(
            f"sampling_mask must be a list with one entry per completion, got {type(sampling_mask).__name__}"
        )
    if len(sampling_mask) != len(completion_ids):
        raise ValueError(
            f"sampling_mask has {len(sampling_mask)} entries for {len(completion_ids)} completions: accepted one per completion"
        )
    supports = []
    for i, (mask, ids) in enumerate(zip(sampling_mask, completion_ids)):
        support = SafeSupport.from_vllm(mask) if hasattr(mask, "token_ids") else SafeSupport.from_lists(mask)
        if support.num_rows != len(ids):
            raise ValueError(
                f"sampling_mask[{i}] has {support.num_rows} rows for a completion of {len(ids)} tokens: accepted one "
                "row of kept token ids per completion token"
            )
        supports.append(support)
    return supports


def select_support(supports: Sequence[SafeSupport], scored: torch.Tensor) -> SafeSupport:
    """The support of one LM-head call over ``len(supports)`` sequences.

    Args:
        supports: one per sequence of the call (row ``r`` = completion token ``r``).
        scored: ``[b, L]`` bool, the positions the head scores (label ``!= -100``), row-major = the targets' order.

    Returns:
        A :class:`~safevocab.SafeSupport` with one row per scored position: sequence ``i`` contributes all its rows
        when it has ``num_rows`` scored positions (its completion tokens), none when it has none.
    """
    if scored.shape[0] != len(supports):
        raise ValueError(
            f"the head scores {scored.shape[0]} sequences but {len(supports)} replayed supports were given"
        )
    counts = scored.sum(dim=1).tolist()
    token_ids, sizes = [], []
    for i, (support, n) in enumerate(zip(supports, counts)):
        if n == 0:
            continue
        if n != support.num_rows:
            raise ValueError(
                f"sequence {i} has {n} scored completion tokens but its replayed support has {support.num_rows} rows: "
                "accepted one row per completion token"
            )
        token_ids.append(support.token_ids)
        sizes.append(support.sizes)
    device = scored.device
    if not sizes:
        return SafeSupport(
            torch.zeros(0, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)
        )
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat(sizes).cpu().cumsum(0)])
    return SafeSupport(torch.cat(token_ids).to(device), offsets.to(device))


def replay_metrics(stats, counted: torch.Tensor) -> tuple[dict, dict]:
    """``safevocab/replay_frac`` (share of the counted tokens trained on a replayed set ``R``) and
    ``safevocab/support_disagreement`` (share of the replayed counted tokens whose rule set ``S_rule`` differs from
    ``R``), with their counts. ``S_rule = R`` iff ``|S_rule| = |R| = |S_rule & R|`` (``stats.safe_size`` is
    ``|S_rule & R|``, minus the tokens of probability 0). ``stats`` is a
    :class:`~trl_integration.grpo.step.SafeTokenStats` (not imported: that module imports this one)."""
    replayed = counted & (stats.replay_size > 0) if stats.replay_size is not None else torch.zeros_like(counted)
    nan = torch.full((), float("nan"), device=counted.device)
    metrics = {REPLAY_FRAC: _frac(replayed, counted), SUPPORT_DISAGREEMENT: nan}
    if stats.replay_size is not None:
        same = (stats.rule_safe_size == stats.replay_size) & (stats.safe_size == stats.replay_size)
        metrics[SUPPORT_DISAGREEMENT] = _frac(replayed & ~same, replayed)
    return metrics, {REPLAY_FRAC: counted.sum(), SUPPORT_DISAGREEMENT: replayed.sum()}


def vllm_sampling_masks(request_outputs: Sequence) -> list:
    """The ``sampling_mask`` of every completion of vLLM ``RequestOutput`` objects, completions in order, or ``None``
    when any completion has none (the engine was not started with ``return_sampling_mask=True``).

    The vLLM path of the trainer: trl 1.16's vLLM generation (``VLLMGeneration.generate``) returns token ids and
    log-probabilities only and drops the ``CompletionOutput`` objects, so the trainer cannot reach their masks
    without patching trl's private generation code. Until trl passes them through, a ``rollout_func`` that calls
    vLLM itself returns ``{"sampling_mask": vllm_sampling_masks(outputs), ...}`` (each entry a ``SamplingMask``,
    which :func:`per_sequence_supports` reads with :meth:`safevocab.SafeSupport.from_vllm`).
    """
    masks = [getattr(c, "sampling_mask", None) for request in request_outputs for c in request.outputs]
    return None if any(m is None for m in masks) else masks


def logprob_bound(rule: SafeVocabRule, vocab_size: int | None = None) -> int | None:
    """A ``k`` such that the engine's top-``k`` processed log-probabilities hold every kept set: ``k`` of the rule's
    ``top_k`` part (every kept set has at most ``k`` tokens; ties aside, which an engine's ``top_k`` splits by its
    sort), else the vocabulary size when given (every id); ``None`` without either. The smaller of the two when both."""
    k = next((part.value for part in rule.parts if isinstance(part, TopK)), None)
    if vocab_size is None:
        return k
    return vocab_size if k is None else min(k, vocab_size)


def kept_sets_from_logprobs(
    completion_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[Sequence[float | None]]],
    logprob_token_ids: Sequence[Sequence[Sequence[int]]],
) -> tuple[list[list[list[int]]], list, list] | None:
    """The engine's kept set of every completion token, from its processed log-probabilities of its top tokens.

    Args:
        completion_ids: per completion, its token ids.
        logprobs: per completion and token, the processed log-probabilities trl's ``VLLMGeneration.generate``
            returns for ``logprobs=k`` (the sampled token's and the top ``k``, by rank; ``None`` for a NaN).
        logprob_token_ids: their token ids, in the same order.

    Returns:
        ``(kept, logprobs, logprob_token_ids)``: per completion, one list of kept ids per token (those with a finite
        processed log-probability), and the two lists reordered so that each position's first entry is the sampled
        token's (trl keeps the first entry as the sampled token's log-probability); ``None`` when a position does not
        list its sampled token.
    """
    kept, new_logprobs, new_ids = [], [], []
    for ids, seq_logprobs, seq_ids in zip(completion_ids, logprobs, logprob_token_ids):
        rows, row_logprobs, row_ids = [], [], []
        for token, position_logprobs, position_ids in zip(ids, seq_logprobs, seq_ids):
            position_ids = list(position_ids)
            if token not in position_ids:
                return None
            rows.append([i for i, lp in zip(position_ids, position_logprobs) if lp is not None and math.isfinite(lp)])
            first = position_ids.index(token)
            order = [first, *(j for j in range(len(position_ids)) if j != first)]
            row_logprobs.append([position_logprobs[j] for j in order])
            row_ids.append([position_ids[j] for j in order])
        kept.append(rows)
        new_logprobs.append(row_logprobs)
        new_ids.append(row_ids)
    return kept, new_logprobs, new_ids


class SupportReplay:
    """The trainer's replay state (one per trainer with ``safe_vocab_support="replay"``).

    ``current`` is the list of per-sequence supports the next scoring call uses (rows = that call's sequences): set
    by the wrapped ``rollout_func`` during a rollout (trl's old-policy and reference passes score the generation batch
    in rollout order), then by :meth:`use` with the supports of the micro-batch in hand (shuffled by trl: its
    :class:`~trl_integration.grpo.batch.GenerationBatch` picks its rows' supports)."""

    def __init__(self) -> None:
        self.current: list[SafeSupport] | None = None
        self.warned = False
        #: Why batches cannot be replayed (set when the trainer's engine returns no kept sets), for the warning.
        self.fallback_reason: str | None = None

    def wrap(self, rollout_func: Callable) -> Callable:
        """``rollout_func`` whose ``"sampling_mask"`` (when returned) becomes :attr:`current`."""

        @functools.wraps(rollout_func)
        def capturing_rollout_func(prompts, trainer):
            output = rollout_func(prompts, trainer)
            if isinstance(output, Mapping) and output.get(SAMPLING_MASK_KEY) is not None:
                self.current = per_sequence_supports(output[SAMPLING_MASK_KEY], output["completion_ids"])
            return output

        return capturing_rollout_func

    @staticmethod
    def supports(sampling_mask: Sequence, completion_ids: Sequence[Sequence[int]]) -> list[SafeSupport]:
        """:func:`per_sequence_supports` (the engine's kept sets of one rollout, one support per completion)."""
        return per_sequence_supports(sampling_mask, completion_ids)

    def begin_generation(self) -> None:
        self.current = None

    def kept_sets(self) -> list[SafeSupport] | None:
        """The supports of the generation batch just built (:attr:`current`); without them, warn once per run (the
        batch trains on the rule's sets)."""
        if self.current is not None:
            return self.current
        if not self.warned:
            self.warned = True
            reason = self.fallback_reason or (
                f"the rollout returned no sampling masks (a rollout_func returning '{SAMPLING_MASK_KEY}')"
            )
            warnings.warn(
                f"safe_vocab_support='replay' but {reason}: such batches train on the rule's sets, and {REPLAY_FRAC} "
                "logs the replayed share", UserWarning, stacklevel=4,
            )  # fmt: skip
        return None

    def use(self, supports: list[SafeSupport] | None) -> None:
        """Take the supports of the batch (or micro-batch) about to be scored, one per sequence (``None``: none)."""
        self.current = supports


def _frac(selected: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
    return (selected.sum().double() / among.sum()).float()  # 0/0 = NaN when nothing counts, on the batch's device
