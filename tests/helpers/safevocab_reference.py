"""An independent float64 reference of the safe log-softmax, written from the definitions in docs/guide.md ("What is computed").

It shares no code with ``safevocab``: the transform, every rule, their composition in sampler order,
the outputs and (through torch autograd on these float64 formulas) the gradients are restated from the
definitions, row by row, with the full softmax and an explicit safe set:

- transform: ``logit_scale``, then softcap ``c tanh(z / c)`` (``-inf`` stays ``-inf``), then ``/ T``;
- rules, applied in the order top_k -> top_p -> min_p -> min_prob, each on the distribution
  renormalised over what the previous ones kept, every step keeping the argmax (and its ties):

  - ``top_k``: ``z_a >=`` the k-th largest logit (ties kept);
  - ``top_p``: ``a`` is kept iff the mass strictly above it (descending order) is ``< q``; tokens tied
    with the smallest kept logit are kept too; ``q = 1`` keeps everything;
  - ``min_p``: ``p_a >= rho p_max``;
  - ``min_prob``: ``p_a >= tau``;
  - tokens of probability 0 (``-inf`` logits) are never kept.

- outputs: ``log pi_S(y)`` for ``y in S``, else the full ``log p(y)``; ``in_safe``; ``log(1 - m)``;
  ``|S|``; the entropy of ``pi_S``.

The reference also says when a row is *ambiguous*: some token lies so close to a rule's boundary
(within ``tol_z`` in logit space, or ``tol_p`` in cumulative mass for top_p) that float32 rounding may
legitimately decide it the other way. Property tests skip such examples; exact ties are not ambiguous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ORDER = ("top_k", "top_p", "min_p", "min_prob")


@dataclass
class Reference:
    logprobs: torch.Tensor
    in_safe: torch.Tensor
    log_kept_mass: torch.Tensor
    safe_size: torch.Tensor
    entropy: torch.Tensor
    keep: torch.Tensor  # [N, V] bool: the safe sets
    ambiguous: bool


def transform(raw: torch.Tensor, temperature: float, softcap: float | None, logit_scale: float) -> torch.Tensor:
    z = raw.double() * logit_scale
    if softcap is not None:
        z = torch.where(z == -math.inf, z, softcap * torch.tanh(z / softcap))
    return z / temperature


def safe_set(z: torch.Tensor, parts: list[tuple[str, float]], tol_z: float, tol_p: float) -> tuple[torch.Tensor, bool]:
    """The safe set of one row ``z`` [V] (float64, transformed) under ``parts`` (key, value) pairs."""
    z = z.detach().double()
    keep = z > -math.inf
    ambiguous = False
    for key, value in sorted(parts, key=lambda kv: ORDER.index(kv[0])):
        kept_z = z[keep]
        z_max = kept_z.max()
        if key == "top_k":
            k = int(value)
            if k >= kept_z.numel():
                continue
            kth = torch.sort(kept_z, descending=True).values[k - 1]
            new = keep & (z >= kth)
            near = keep & (z != kth) & ((z - kth).abs() <= tol_z)
        elif key == "top_p":
            if value >= 1.0:
                continue
            p = torch.softmax(kept_z, 0)
            order = torch.argsort(kept_z, descending=True, stable=True)
            mass_above = torch.cumsum(p[order], 0) - p[order]
            kept_sorted = mass_above < value
            smallest = kept_z[order][kept_sorted].min()
            new = keep & (z >= smallest)
            near_mass = ((mass_above - value).abs() <= tol_p).any()
            near = keep & (z != smallest) & ((z - smallest).abs() <= tol_z)
            ambiguous |= bool(near_mass)
        elif key == "min_p":
            t = z_max + math.log(value)
            new = keep & (z >= t)
            near = keep & (z != z_max) & ((z - t).abs() <= tol_z)
        elif key == "min_prob":
            t = torch.logsumexp(kept_z, 0) + math.log(value)
            new = keep & ((z >= t) | (z == z_max))
            near = keep & (z != z_max) & ((z - t).abs() <= tol_z)
        else:
            raise AssertionError(key)
        ambiguous |= bool(near.any())
        keep = new | (keep & (z == z_max))  # the argmax (and its ties) always survives
    return keep, ambiguous


def reference(
    raw: torch.Tensor,
    targets: torch.Tensor,
    parts: list[tuple[str, float]],
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    tol_z: float = 0.0,
    tol_p: float = 0.0,
    support: list[list[int]] | None = None,
    z_exact: torch.Tensor | None = None,
) -> Reference:
    """Reference outputs for raw logits ``raw`` [N, V] (float64; may require grad) and ``targets`` [N].

    ``support``: replayed kept ids per row; ``S`` is then those ids, intersected with the rules' set (computed on
    the full distribution) and with the tokens of nonzero probability.

    ``z_exact``: the transformed logits in exact (float64) arithmetic, when ``raw`` holds them rounded to the
    statistics dtype: a row whose set changes with that rounding (a softcap saturating two distinct logits to
    one float32 value, say) is ambiguous too, since implementations may round it either way.
    """
    z = transform(raw, temperature, softcap, logit_scale)
    rows = [safe_set(row, parts, tol_z, tol_p) for row in z]
    rule_keep = torch.stack([k for k, _ in rows]) if rows else torch.zeros(z.shape, dtype=torch.bool)
    keep = rule_keep
    if support is not None:
        replayed = torch.zeros_like(keep)
        for i, ids in enumerate(support):
            replayed[i, list(ids)] = True
        keep = keep & replayed
    ambiguous = any(a for _, a in rows)
    if z_exact is not None:
        # the rules' sets before the replayed ids (comparing with ``keep`` called every strict subset ambiguous, so
        # the fuzz skipped all but the supports that held the whole rule set: issue 37)
        exact_keep = torch.stack([safe_set(row, parts, 0.0, 0.0)[0] for row in z_exact]) if rows else rule_keep
        ambiguous |= not torch.equal(exact_keep, rule_keep)
    out = {name: [] for name in ("logprobs", "log_kept_mass", "entropy")}
    for i in range(z.shape[0]):
        zi, si, y = z[i], keep[i], int(targets[i])
        row_max = zi.detach().max()
        shifted = zi - row_max  # a constant shift: same values, no cancellation in float64 either
        lse_full = torch.logsumexp(shifted, 0)
        log_p = shifted - lse_full  # full log-softmax
        # pi_S and the kept mass from S's own shift m_S: S (a replayed one) may sit far below the row maximum m, where
        # log_p[S] would keep only ulp(m - m_S) of S's differences, in float64 too (issue 37)
        set_max = zi.detach()[si].max() if bool(si.any()) else row_max
        shifted_safe = zi[si] - set_max
        lse_safe = torch.logsumexp(shifted_safe, 0)
        log_kept = (set_max - row_max) + lse_safe - lse_full  # log of the kept mass
        log_p_safe = shifted_safe - lse_safe
        log_p_y_safe = log_p_safe[int(si[:y].sum())] if bool(si[y]) else None
        out["logprobs"].append(log_p_y_safe if bool(si[y]) else log_p[y])
        out["log_kept_mass"].append(log_kept)
        out["entropy"].append(-(log_p_safe.exp() * log_p_safe).sum())
    stack = {k: torch.stack(v) if v else torch.zeros(0, dtype=torch.float64) for k, v in out.items()}
    idx = torch.arange(z.shape[0])
    return Reference(
        logprobs=stack["logprobs"],
        in_safe=keep[idx, targets.long()],
        log_kept_mass=stack["log_kept_mass"],
        safe_size=keep.sum(-1),
        entropy=stack["entropy"],
        keep=keep,
        ambiguous=ambiguous,
    )
