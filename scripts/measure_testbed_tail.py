#!/usr/bin/env python
"""How far into the tail the free-text task keeps the testbed model, and the signed mismatch there.

``python scripts/measure_testbed_tail.py [--prompts 256] [--eps 1.0] [--json out.json]``

On the free-text task's held-out prompts (:mod:`trl_integration.demo.freetext`), completions of at most 32 tokens
are sampled twice with transformers' ``generate`` at temperature 1 from the full distribution:

1. from the model itself (``pi``): the fraction of sampled tokens with ``pi(y) < 0.01`` (the policy's tail);
2. from a noisy sampler ``mu = softmax(z + delta)``, ``delta_i ~ U[-eps, eps]`` independently per vocabulary entry
   and step (safevocab's ``LogitNoiseProcessor``, seeded; ``--kind clipped_gaussian``: ``N(0, (eps/2)^2)`` clipped
   at ``+-eps``): for every sampled token, ``log mu(y) - log pi(y)``, whose mean per bucket of ``pi(y)`` is the
   *signed tail mismatch* (positive: the sampler over-weights the tokens it drew, most in the tail).

Why it is positive and how large it can be: ``log mu(y) - log pi(y) = delta_y - log Z`` with
``Z = sum_j pi_j exp(delta_j)``. A token is drawn with probability ``pi_y exp(delta_y) / Z``, so among the drawn
tokens of one ``pi`` bucket ``delta_y`` has the density ``∝ exp(delta)``: for ``U[-1, 1]`` its mean is
``coth(1) - 1 = 0.313``. ``log Z`` is about ``delta_top`` (mean 0) where one token holds most of the mass and about
``log(sinh(1)) = 0.161`` where the mass is spread, so a bucket's mean lies between about ``+0.15`` and ``+0.31`` in
the tail and tends to 0 as ``pi(y)`` tends to 1 (then ``mu = pi``).

``pi`` comes from ``output_logits`` (the raw logits), ``mu`` from ``output_scores`` (the scores the sampler drew
from, after the noise). Tokens after a completion's EOS are not counted. Seeded: the same command prints the same
figures on the same machine and library builds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

import torch  # noqa: E402

#: Buckets of pi(y): [low, high).
BUCKETS = [(0.0, 1e-4), (1e-4, 1e-3), (1e-3, 1e-2), (1e-2, 1e-1), (1e-1, 0.5), (0.5, 1.0001)]


def sample_logprobs(
    model, tokenizer, prompts, *, eps: float, seed: int, batch_size: int, max_new_tokens: int, kind: str = "uniform"
):
    """``(log pi(y), log mu(y))`` of every sampled token before and including EOS, as two 1-D tensors."""
    from transformers import LogitsProcessorList

    from trl_integration.rollout.perturbations import LogitNoiseProcessor

    log_pi, log_mu = [], []
    torch.manual_seed(seed)
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True, padding_side="left")
        processors = LogitsProcessorList([LogitNoiseProcessor(eps, kind, seed=seed + start)] if eps else [])
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=None,
                top_p=None,
                min_p=None,
                max_new_tokens=max_new_tokens,
                logits_processor=processors,
                output_logits=True,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        tokens = out.sequences[:, enc["input_ids"].shape[1] :]
        raw = torch.stack(out.logits, dim=1).float().log_softmax(-1)
        noisy = torch.stack(out.scores, dim=1).float().log_softmax(-1)
        if torch.isinf(noisy).any():
            raise RuntimeError("the sampler truncated the distribution (a top-k/top-p default is active)")
        is_eos = (tokens == tokenizer.eos_token_id).long()
        alive = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first EOS
        log_pi.append(raw.gather(-1, tokens[..., None])[..., 0][alive])
        log_mu.append(noisy.gather(-1, tokens[..., None])[..., 0][alive])
    return torch.cat(log_pi), torch.cat(log_mu)


def measure(
    model,
    tokenizer,
    prompts,
    *,
    eps: float = 1.0,
    kind: str = "uniform",
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int = 32,
) -> dict:
    """The tail fraction (noise-free sampling) and the signed mismatch per bucket (noisy sampling)."""
    state = torch.random.get_rng_state()
    try:
        log_pi_clean, _ = sample_logprobs(
            model, tokenizer, prompts, eps=0.0, seed=seed, batch_size=batch_size, max_new_tokens=max_new_tokens
        )
        log_pi, log_mu = sample_logprobs(
            model,
            tokenizer,
            prompts,
            eps=eps,
            seed=seed,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            kind=kind,
        )
    finally:
        torch.random.set_rng_state(state)
    p_clean, p = log_pi_clean.exp(), log_pi.exp()
    buckets = []
    for low, high in BUCKETS:
        sel = (p >= low) & (p < high)
        diff = (log_mu - log_pi)[sel]
        buckets.append(
            {
                "low": low,
                "high": min(high, 1.0),
                "tokens": int(sel.sum()),
                "mean_log_mu_minus_log_pi": float(diff.mean()) if diff.numel() else None,
                "share_of_tokens": float(sel.float().mean()),
            }
        )
    return {
        "prompts": len(prompts),
        "eps": eps,
        "kind": kind,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "tokens_sampled_from_pi": int(p_clean.numel()),
        "fraction_below_0.01": float((p_clean < 0.01).float().mean()),
        "fraction_below_0.1": float((p_clean < 0.1).float().mean()),
        "mean_log_pi": float(log_pi_clean.mean()),
        "tokens_sampled_from_mu": int(p.numel()),
        "noisy_fraction_below_0.01": float((p < 0.01).float().mean()),
        "buckets": buckets,
    }


def main(argv=None) -> dict:
    from trl_integration.demo.freetext import MAX_COMPLETION_LENGTH, held_out_dataset
    from trl_integration.demo.testbed import load_testbed_model, load_testbed_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256, help="held-out prompts (at most 433)")
    parser.add_argument("--eps", type=float, default=1.0, help="bound of the logit noise")
    parser.add_argument(
        "--kind",
        default="uniform",
        choices=("uniform", "clipped_gaussian"),
        help="U[-eps, eps], or N(0, (eps/2)^2) clipped at +-eps",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = list(held_out_dataset(args.prompts)["prompt"])
    result = measure(
        load_testbed_model(),
        load_testbed_tokenizer(),
        prompts,
        eps=args.eps,
        kind=args.kind,
        seed=args.seed,
        max_new_tokens=MAX_COMPLETION_LENGTH,
    )
    print(f"{result['prompts']} held-out prompts, temperature 1, <= {result['max_new_tokens']} tokens")
    print(
        f"sampled from pi: {result['tokens_sampled_from_pi']} tokens, {result['fraction_below_0.01']:.1%} with "
        f"pi < 0.01, {result['fraction_below_0.1']:.1%} with pi < 0.1; mean log pi {result['mean_log_pi']:.2f}"
    )
    print(f"sampled from mu ({args.kind} logit noise, eps = {args.eps}): {result['tokens_sampled_from_mu']} tokens")
    print(f"{'pi(y) bucket':>16} {'tokens':>7} {'share':>6}  mean log mu - log pi")
    for b in result["buckets"]:
        mean = "-" if b["mean_log_mu_minus_log_pi"] is None else f"{b['mean_log_mu_minus_log_pi']:+.3f}"
        print(f"{b['low']:>7g}-{b['high']:<8g} {b['tokens']:>7} {b['share_of_tokens']:>6.1%}  {mean}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
