"""The benchmark's inputs: hidden states, LM-head weight, targets and upstream gradient, in two logit profiles.

Logits are ``z = h W^T`` (no bias: trl's kernel takes none), drawn on the device that runs the benchmark.

- ``synthetic`` (the default, and every figure before issue 41): ``h ~ N(0, 1)``, ``W ~ N(0, 9 / H)``, so each
  logit is ``N(0, 9)`` across the vocabulary. The distribution is flat: thousands of kept tokens per row at
  ``V = 151936`` for ``min_p=0.001`` and ``top_p=0.9``, far more than a language model keeps.
- ``lm``: a documented Zipf-shaped profile, ``z[n, v] = -s log(1 + rank(v)) + sigma * eps[n, v]`` with a fixed random
  ranking of the vocabulary (a unigram prior, as a language model's head has) and a per-row context term ``eps ~
  N(0, 1)``; ``s = LM_PRIOR_EXPONENT = 1.5``, ``sigma = LM_CONTEXT_STD = 3.0``. The prior rides in the GEMM: the last
  hidden unit is 1 and the weight's last column holds the prior, the other ``H - 1`` units carry the context term.
  At ``V = 151936`` (256 rows, ``H = 64``; ``python -c "from safevocab.bench.inputs import kept_set_table;
  print(kept_set_table())"``) the kept sets are, median / p99: ``min_p=0.01`` 17 / 98, ``top_p=0.9`` 29 / 257,
  ``min_p=0.001`` 82 / 427 (synthetic: 309 / 1765, 6488 / 21706, 2566 / 13920): tens to hundreds of tokens, as a real
  LM's rows (prime-rl measured a mean of about 8 and a p99 of about 82 kept tokens).

Targets are drawn from the pruned policy (Gumbel-max over the kept logits), as RL rollouts sampled with the same rule
are, so ``y`` is in ``S`` for every row.
"""

from __future__ import annotations

import torch

from safevocab.rules import parse_rule
from safevocab.support import SafeSupport

__all__ = [
    "PROFILES",
    "LM_PRIOR_EXPONENT",
    "LM_CONTEXT_STD",
    "draw_logit_factors",
    "sample_targets",
    "replay_support",
    "kept_set_sizes",
    "kept_set_table",
]

PROFILES = ("synthetic", "lm")
#: ``s`` of the ``lm`` profile's Zipf prior ``-s log(1 + rank)``.
LM_PRIOR_EXPONENT = 1.5
#: ``sigma`` of the ``lm`` profile's per-row context term.
LM_CONTEXT_STD = 3.0
#: The ``synthetic`` profile's logit standard deviation.
SYNTHETIC_STD = 3.0


def draw_logit_factors(
    n: int, h: int, v: int, *, profile: str = "synthetic", generator: torch.Generator, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``hidden [n, h]`` and ``weight [v, h]`` whose product has the ``profile``'s logits (module docstring)."""
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r}: accepted one of {PROFILES}")
    if profile == "synthetic":
        hidden = torch.randn(n, h, generator=generator, device=device)
        weight = torch.randn(v, h, generator=generator, device=device) * (SYNTHETIC_STD / h**0.5)
        return hidden, weight
    if h < 2:
        raise ValueError(f"h={h}: the lm profile needs h >= 2 (one hidden unit carries the prior)")
    hidden = torch.randn(n, h, generator=generator, device=device)
    hidden[:, -1] = 1.0
    weight = torch.randn(v, h, generator=generator, device=device) * (LM_CONTEXT_STD / (h - 1) ** 0.5)
    rank = torch.randperm(v, generator=generator, device=device).float()
    weight[:, -1] = -LM_PRIOR_EXPONENT * torch.log1p(rank)
    return hidden, weight


@torch.no_grad()
def sample_targets(hidden: torch.Tensor, weight: torch.Tensor, rule: str, gen: torch.Generator) -> torch.Tensor:
    """Targets drawn from the pruned policy, as RL rollouts sampled with the same rule are: Gumbel-max on the
    kept logits (``argmax(z + G)`` with ``G = -log(-log U)`` is a draw from ``softmax(z)``), on the inputs' device."""
    keep_rule = parse_rule(rule)
    out = []
    for h in hidden.split(256):
        z = (h @ weight.t()).float()
        z = z.masked_fill(~keep_rule.keep_mask(z), float("-inf"))
        uniform = torch.rand(z.shape, generator=gen, device=z.device).clamp_min_(torch.finfo(torch.float32).tiny)
        out.append((z - uniform.log_().neg_().log_()).argmax(-1))
    return torch.cat(out)


@torch.no_grad()
def replay_support(hidden: torch.Tensor, weight: torch.Tensor, rule: str):
    """The sets ``rule`` keeps on these logits, as a :class:`~safevocab.support.SafeSupport` (``fused_replay``)."""
    keep_rule = parse_rule(rule)
    ids, sizes = [], []
    for h in hidden.split(256):
        keep = keep_rule.keep_mask((h @ weight.t()).float())
        ids.append(keep.nonzero()[:, 1])
        sizes.append(keep.sum(-1))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=hidden.device), torch.cat(sizes).cumsum(0)])
    return SafeSupport(torch.cat(ids), offsets)


@torch.no_grad()
def kept_set_sizes(hidden: torch.Tensor, weight: torch.Tensor, rule: str, rows: int = 1024) -> dict[str, float]:
    """Median, 99th percentile and mean of ``|S|`` under ``rule`` over the first ``rows`` rows (fp32 logits)."""
    keep_rule = parse_rule(rule)
    sizes = torch.cat([keep_rule.keep_mask((h @ weight.t()).float()).sum(-1) for h in hidden[:rows].split(256)])
    sizes = sizes.float().cpu()
    return {"median": float(sizes.median()), "p99": float(sizes.quantile(0.99)), "mean": float(sizes.mean())}


def kept_set_table(
    rules: tuple[str, ...] = ("min_p=0.001", "min_p=0.01", "top_p=0.9", "top_k=50,min_p=0.01"),
    *,
    n: int = 256,
    h: int = 64,
    v: int = 151936,
    seed: int = 0,
) -> str:
    """``|S|`` per rule and profile on the CPU (the figures quoted in the module docstring)."""
    lines = ["| profile | rule | median | p99 | mean |", "|---|---|---:|---:|---:|"]
    for profile in PROFILES:
        gen = torch.Generator().manual_seed(seed)
        hidden, weight = draw_logit_factors(n, h, v, profile=profile, generator=gen, device="cpu")
        for rule in rules:
            s = kept_set_sizes(hidden, weight, rule)
            lines.append(f"| {profile} | {rule} | {s['median']:.0f} | {s['p99']:.0f} | {s['mean']:.1f} |")
    return "\n".join(lines)
