"""The tail diagnostic: where, and in which direction, the rollout policy ``mu`` departs from the training policy
``pi`` on the tokens an RL rollout actually samples.

For each prompt source (the task's prompts, free text), the rollout side samples continuations from ``mu`` — the
model in the rollout dtype, with its weights rounded to ``mantissa_bits`` and the injected perturbation (noise,
``lift`` or ``tail``) applied inside ``generate``, exactly as the trainer's rollouts do — and records ``log mu(y)`` of every
sampled token as it samples (:class:`~trl_integration.rollout.recorder.RolloutLogprobRecorder`: the draw that produced the
token, not a fresh one). The training side scores the same tokens by a full forward, ``log pi(y)``. Per bucket of
training probability ``p = pi(y)``:

    signed_mean = mean over sampled tokens in the bucket of  log mu(y) - log pi(y)

with its standard error, the token count ``n`` and the share ``frac`` of the sampled tokens. A positive value in the
low-``p`` buckets means the rollout over-samples the tail: those tokens enter the batch more often than ``pi`` would
draw them, and their importance ratios ``pi / mu`` fall below 1. Over all sampled tokens the mean is an estimate of
``KL(mu || pi) >= 0`` (tokens sampled from ``mu``), so even zero-mean noise shows a positive mean; a *biased*
mismatch shows up as a bucket pattern (the ``lift``: positive in the tail, negative near ``p = 1``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from safevocab.mismatch import DEFAULT_BUCKETS, bucket_mismatch
from safevocab.rules import NoPruning, SafeVocabRule
from trl_integration.lab.sides import check_mantissa_bits, model_in, rollout_side
from trl_integration.options import NOISE_KINDS
from trl_integration.rollout.perturbations import LogitNoiseProcessor, tail_rule
from trl_integration.rollout.recorder import RolloutLogprobRecorder, recording_generate

__all__ = ["SampledTokens", "sample_tokens", "tail_buckets", "tail_mismatch"]


@dataclass
class SampledTokens:
    """Continuations sampled on the rollout side and scored on both (`sample_tokens`).

    Attributes:
        sequences: ``[B * num_samples, prompt_len + steps]`` token ids (prompts left-padded).
        prompt_length: padded prompt length (the sampled tokens are ``sequences[:, prompt_length:]``).
        mask: ``[B * num_samples, steps]`` bool, the sampled tokens up to and including each first EOS.
        train_logp: ``[B * num_samples, steps]`` float64 ``log pi(y)`` (training side, full forward).
        rollout_logp: ``[B * num_samples, steps]`` float64 ``log mu(y)``, recorded while sampling.
    """

    sequences: torch.Tensor
    prompt_length: int
    mask: torch.Tensor
    train_logp: torch.Tensor
    rollout_logp: torch.Tensor


def tail_buckets(train_logp: torch.Tensor, rollout_logp: torch.Tensor, buckets: Sequence[float]) -> dict[str, Any]:
    """Per bucket of ``p = exp(train_logp)``: ``n``, ``frac``, ``signed_mean`` and ``signed_se`` of
    ``rollout_logp - train_logp`` (1-D tensors of the sampled tokens), plus the overall ``signed_mean``."""
    train_logp, rollout_logp = train_logp.double(), rollout_logp.double()
    mask = torch.ones(1, train_logp.numel(), dtype=torch.bool)
    b = bucket_mismatch(train_logp.unsqueeze(0), rollout_logp.unsqueeze(0), mask, buckets)
    signed = rollout_logp - train_logp
    which = torch.bucketize(train_logp.exp(), b.hi[:-1].to(torch.float64), right=True)  # bucket_mismatch's bins
    rows = []
    for j, name in enumerate(b.names):
        values = signed[which == j]
        n = int(b.count[j])
        rows.append({
            "name": name, "lo": float(b.lo[j]), "hi": float(b.hi[j]), "n": n,
            "frac": float(b.frac[j]) if n else 0.0,
            "signed_mean": 0.0 - float(b.diff_mean[j]) if n else None,  # bucket_mismatch's sign is log pi - log mu
            "signed_se": float(values.std() / math.sqrt(n)) if n > 1 else None,
            "abs_mean": float(b.abs_diff_mean[j]) if n else None,
        })  # fmt: skip
    return {
        "n_tokens": int(signed.numel()),
        "signed_mean": float(signed.mean()) if signed.numel() else None,
        "buckets": rows,
    }


def sample_tokens(
    train_model: torch.nn.Module,
    rollout_model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 16,
    num_samples: int = 4,
    temperature: float = 1.0,
    noise: float = 0.0,
    noise_kind: str = "uniform",
    seed: int = 0,
    max_length: int = 512,
    noise_rule: SafeVocabRule | str | None = None,
) -> SampledTokens:
    """Sample continuations of ``prompts`` from ``rollout_model`` (full distribution at ``temperature``, with the
    injected perturbation inside ``generate``), recording ``log mu`` of each sampled token as it is drawn, and score
    the same tokens with ``train_model`` (one teacher-forced forward). The global RNG is left as it was.
    ``noise_rule``: the rule whose cut tokens ``noise_kind="tail"`` lifts."""
    device = next(train_model.parameters()).device
    enc = tokenizer(
        list(prompts), return_tensors="pt", padding=True, padding_side="left", truncation=True, max_length=max_length
    ).to(device)
    recorder = RolloutLogprobRecorder(NoPruning(), temperature)
    processors = [LogitNoiseProcessor(noise, noise_kind, seed=seed, temperature=temperature, rule=noise_rule)
                  ] if noise > 0 else []  # fmt: skip
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]), torch.no_grad():
        torch.manual_seed(seed)
        with recording_generate(rollout_model, recorder, None, processors):
            out = rollout_model.generate(
                **enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_p=None,
                max_new_tokens=max_new_tokens, num_return_sequences=num_samples,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
    if recorder.failure is not None:
        raise RuntimeError(f"the rollout log-probabilities could not be recorded: {recorder.failure}")
    prompt_len = enc["input_ids"].shape[1]
    new = out[:, prompt_len:]
    keep = torch.ones_like(new, dtype=torch.bool)
    if tokenizer.eos_token_id is not None:  # up to and including the first EOS
        is_eos = (new == tokenizer.eos_token_id).long()
        keep = (is_eos.cumsum(-1) - is_eos) == 0
    attn = torch.cat([enc["attention_mask"].repeat_interleave(num_samples, dim=0).bool(), keep], dim=1).long()
    with torch.no_grad():
        logits = train_model(input_ids=out, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    z = logits[:, prompt_len - 1 : -1].double() / temperature
    train = z.log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    return SampledTokens(out, prompt_len, keep, train, recorder.logprobs.double())


def tail_mismatch(
    model: torch.nn.Module,
    tokenizer: Any,
    sources: Mapping[str, Sequence[str]],
    *,
    compare: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
    mantissa_bits: int | None = None,
    noise: float = 0.0,
    noise_kind: str = "uniform",
    seed: int = 0,
    temperature: float = 1.0,
    buckets: Sequence[float] = DEFAULT_BUCKETS,
    max_new_tokens: int = 16,
    num_samples: int = 4,
    batch_size: int = 16,
    max_length: int = 512,
    progress: bool = True,
    noise_rule: SafeVocabRule | str | None = None,
) -> dict[str, Any]:
    """The tail diagnostic (see the module docstring) of each prompt source.

    Args:
        model: a transformers causal LM (not modified: each side is a copy where it differs).
        tokenizer: its tokenizer.
        sources: ``{source name: prompts}``, e.g. ``{"task": [...], "free_text": [...]}``; empty sources are skipped.
        compare: ``(training dtype, rollout dtype)``.
        mantissa_bits: the rollout side's weights rounded to this many mantissa bits (``None``: not rounded).
        noise: bound ε of the injected perturbation on the rollout side (0: none).
        noise_kind: ``"uniform"``, ``"clipped_gaussian"``, ``"lift"`` or ``"tail"``.
        seed: seeds the sampling and the noise (batch ``i`` of a source uses ``seed + i``).
        temperature: the sampler's temperature (both sides divide the logits by it).
        buckets: inner edges of the probability buckets.
        max_new_tokens: sampled tokens per continuation.
        num_samples: continuations per prompt.
        batch_size: prompts per ``generate`` call.
        max_length: prompts are truncated to this many tokens.
        progress: a progress bar over the batches.
        noise_rule: the rule whose cut tokens ``noise_kind="tail"`` lifts (required by that kind; e.g.
            ``"min_p=0.01"``).

    Returns:
        ``{"max_new_tokens", "num_samples", "temperature", "sources": {name: {"n_prompts", "n_tokens",
        "signed_mean", "buckets": [...]}}}`` (bucket rows as `tail_buckets`).
    """
    from tqdm.auto import tqdm

    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise={noise!r} is out of range: accepted a finite float >= 0")
    if noise_kind not in NOISE_KINDS:
        raise ValueError(f"noise_kind={noise_kind!r} is not accepted: accepted one of {NOISE_KINDS}")
    if max_new_tokens < 1 or num_samples < 1 or batch_size < 1:
        raise ValueError("max_new_tokens, num_samples and batch_size must be >= 1")
    check_mantissa_bits(mantissa_bits, compare[1])
    if noise > 0 and noise_kind == "tail":
        noise_rule = tail_rule(noise_rule)  # refuses None and 'none' before any sampling
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    cache: dict = {}
    train_model = model_in(model, compare[0], cache)
    rollout_model = rollout_side(model, compare[1], mantissa_bits, cache)
    result: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "num_samples": num_samples,
        "temperature": float(temperature),
        "sources": {},
    }
    batches = [(name, start) for name, prompts in sources.items() for start in range(0, len(prompts), batch_size)]
    bar = tqdm(total=len(batches), desc="tail diagnostic", unit="batch", disable=not progress or len(batches) < 2)
    scored: dict[str, tuple[list, list]] = {name: ([], []) for name, prompts in sources.items() if prompts}
    for i, (name, start) in enumerate(batches):
        sampled = sample_tokens(
            train_model, rollout_model, tokenizer, sources[name][start : start + batch_size],
            max_new_tokens=max_new_tokens, num_samples=num_samples, temperature=temperature, noise=noise,
            noise_kind=noise_kind, seed=seed + i, max_length=max_length, noise_rule=noise_rule,
        )  # fmt: skip
        scored[name][0].append(sampled.train_logp[sampled.mask].cpu())
        scored[name][1].append(sampled.rollout_logp[sampled.mask].cpu())
        bar.update(1)
    bar.close()
    for name, (train, rollout) in scored.items():
        rows = tail_buckets(torch.cat(train), torch.cat(rollout), buckets)
        result["sources"][name] = {"n_prompts": len(sources[name]), **rows}
    return result
