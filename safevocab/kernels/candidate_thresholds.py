"""The candidate phase of :mod:`safevocab.kernels.threshold_select`, in torch: which floors a rule's stages allow,
and the exact threshold decided over the compacted candidates.

:func:`selection_plan` gives a rule's stages in its engine's order (:func:`safevocab.engine_order.composition_stages`)
and the parts whose floors make ``c``: the stages up to, not including, the first mass-dependent stage (``top_p``,
``min_prob``) after the first, whose mass needs the whole kept set of the stages before it.
:func:`decide_thresholds` applies the stages to each row's sorted candidates as the rules' own torch code does
(``top_k`` keeps ties; ``top_p`` takes the first sorted entry whose float64 running mass of the fp32
``e = exp(z - m)`` reaches ``q T_prev``; ``min_p`` is ``m + log rho``; ``min_prob`` ``(m + log kept) + log tau`` in
fp32), each stage capped at ``m``, the result floored and capped as ``SafeVocabRule.threshold_of`` does. A threshold
that lies below the floor ``c`` is not known exactly; the row is flagged for the fallback when such a value would
decide ``t`` or a later stage needs its kept mass, so a floor above ``t`` costs time, never exactness.

**Rounding of the masses.** The kernel's ``T`` (an online sum, rescaled as the maximum grows, with the kernel's own
``exp``) and the rule's (``safevocab.nucleus.row_sum64`` of torch's ``exp``, or a masked sum) are two fp32-rounded
sums of the same masses: they differ by ~1e-8 relative, at worst a few 1e-6. Where a decision lies that close to a
boundary, the two could keep one token apart (seen: ``top_p=0.999`` crossing 2.2e-8 relative below ``q T``). So a
row is certified only with a margin of :data:`MASS_MARGIN` (relative, ``2^-19``, above both sums' worst-case
rounding): ``top_p`` where the first entries reaching ``q T_prev - w`` and ``q T_prev + w`` (``w`` the margin times
``T_prev``) have one value, ``min_prob`` where no candidate lies within the margin (in logit units) of the stage's
threshold. The other rows go to the rule's own code (the fallback): about ``2 w / (boundary token's mass)`` of them,
under 1 % where the boundary token carries 1e-3 of the mass or more.

No Triton here, only torch: the phase lives beside the one kernel that uses it, and imports without Triton (as
``safevocab.kernels``' ``__init__`` does), so the decision can be read and tested apart from the kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from safevocab.engine_order import composition_stages
from safevocab.rules import Intersection, MinP, MinProb, SafeVocabRule, TopK, TopP, finite_floor

__all__ = ["MASS_DEPENDENT", "SelectionPlan", "selection_plan", "decide_thresholds", "sorted_candidates"]

#: The parts whose threshold is a decision on a sum of masses (known to ``MASS_MARGIN``); ``top_k`` (a count) and
#: ``min_p`` (``m + log rho``) are exact.
MASS_DEPENDENT = frozenset({"top_p", "min_prob"})

#: Relative width around a mass boundary inside which the candidate phase leaves a row to the rule's own code (module
#: docstring). Both ``T`` sum fp32 partials of 64 terms in tree order (Triton's ``tl.sum``, torch's cascade sum:
#: at most ~7 roundings, 4.2e-7 relative) of ``exp`` values within ~2 ulps (1.2e-7): ``2^-19`` (1.9e-6) exceeds the
#: two sums' combined worst case, so outside it both put the boundary on the same side.
MASS_MARGIN = 2.0**-19
_ELEMENTARY = (TopK, TopP, MinP, MinProb)


@dataclass(frozen=True)
class SelectionPlan:
    """What the kernel and the candidate phase need of a rule: its non-trivial stages and the parts its floor uses.

    ``stages``: the engine's stages (:func:`composition_stages`) as tuples of elementary rules, without the parts
    that keep everything (``top_k >= V`` is decided per call; ``top_p = 1`` here). ``floor_parts``: the parts whose
    floors make ``c`` (see the module docstring).
    """

    stages: tuple[tuple[SafeVocabRule, ...], ...]
    rule: SafeVocabRule

    def active(self, vocab: int) -> tuple[tuple[SafeVocabRule, ...], ...]:
        """The stages without the parts that keep every token for this vocabulary size (``top_k >= V``)."""
        kept = (tuple(p for p in stage if not (type(p) is TopK and p.k >= vocab)) for stage in self.stages)
        return tuple(stage for stage in kept if stage)

    def floor_parts(self, vocab: int) -> tuple[SafeVocabRule, ...]:
        stages = self.active(vocab)
        parts: list[SafeVocabRule] = []
        for i, stage in enumerate(stages):
            if i > 0 and any(p.key in MASS_DEPENDENT for p in stage):
                break
            parts.extend(stage)
        return tuple(parts)


def selection_plan(rule: SafeVocabRule) -> SelectionPlan | None:
    """The plan for ``rule`` when this kernel computes its threshold: exact ``TopK``, ``TopP``, or an exact
    ``Intersection`` of exact ``TopK``/``TopP``/``MinP``/``MinProb`` parts; else ``None`` (a subclass may change
    its threshold)."""
    if type(rule) in (TopK, TopP):
        parts: tuple[SafeVocabRule, ...] = (rule,)
    elif type(rule) is Intersection and all(type(p) in _ELEMENTARY for p in rule.parts):
        parts = rule.parts
    else:
        return None
    by_key = {p.key: p for p in parts}
    stages = []
    for stage in composition_stages(rule.engine, frozenset(by_key)):
        kept = tuple(by_key[key] for key in stage if not (key == "top_p" and by_key[key].q >= 1.0))
        if kept:
            stages.append(kept)
    return SelectionPlan(tuple(stages), rule)


def decide_thresholds(
    stages: tuple[tuple[SafeVocabRule, ...], ...],
    cand: torch.Tensor,
    count: torch.Tensor,
    floor: torch.Tensor,
    m: torch.Tensor,
    total: torch.Tensor,
    kcap: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate phase: ``(threshold [n] fp32, fallback [n] bool)``.

    Args:
        stages: :meth:`SelectionPlan.active`.
        cand: ``[n, >= kcap]`` fp32 candidates ``z >= floor`` (the first ``min(count, kcap)`` of each row).
        count: ``[n]`` int32 number of candidates (``> kcap``: overflow, a fallback row).
        floor, m: ``[n]`` fp32 floor ``c`` and row maximum; total: ``[n]`` fp64 ``sum_V exp(z - m)``.
    """
    n = cand.shape[0]
    device = cand.device
    neg_inf = -math.inf
    bad = (count > kcap) | ~torch.isfinite(m) | ~torch.isfinite(total)
    vals, valid = sorted_candidates(cand, count, kcap)
    width = vals.shape[1]
    complete = floor <= finite_floor(torch.float32)  # every finite logit is a candidate
    valid_sorted = valid.sort(dim=-1, descending=True).values
    e = torch.where(valid_sorted, (vals - m.unsqueeze(-1)).exp(), 0.0)
    n_valid = count.clamp(max=kcap).long()

    t = None  # [n] fp32 value, with ``known``: exact (else some value below c)
    known = torch.ones(n, dtype=torch.bool, device=device)
    for stage in stages:
        if t is None:
            kept_mask, kept_count, kept_complete = None, n_valid, complete
        else:
            kept_mask = (vals >= t.unsqueeze(-1)) & valid_sorted  # a -inf t keeps the candidates, not the padding
            kept_count = kept_mask.sum(-1)
            kept_complete = complete | (known & (t >= floor))
        stage_t, stage_known = [], []
        for part in stage:
            if type(part) is TopK:
                k = part.k
                kth = vals[:, k - 1] if k <= width else torch.full((n,), -math.inf, device=device)
                enough = kept_count >= k
                stage_t.append(torch.where(enough, kth, neg_inf))
                stage_known.append(enough | kept_complete)
            elif type(part) is TopP:
                if t is None:
                    kept_e, t_prev = e, total
                else:
                    kept_e = torch.where(kept_mask, e, 0.0)
                    t_prev = kept_e.double().sum(-1)
                    bad |= ~kept_complete
                target = part.q * t_prev
                running = kept_e.double().cumsum(-1)
                reached = running >= target.unsqueeze(-1)
                any_reached = reached.any(-1)
                # where the crossing lies within rounding of q T_prev, the rule's sums may pick another entry: the
                # first reaching q T_prev - w or q T_prev + w; ambiguous only when those two differ in value (ties
                # keep the same set)
                if width:
                    margin = (MASS_MARGIN * t_prev).unsqueeze(-1)
                    low, high = running >= target.unsqueeze(-1) - margin, running >= target.unsqueeze(-1) + margin
                    bad |= low.any(-1) & (~high.any(-1) | (_first_value(vals, low) != _first_value(vals, high)))
                t_p = _first_value(vals, reached) if width else m
                # not reached over a complete kept set: nucleus.py's rounding case; leave it to the rule's code
                bad |= ~any_reached & (kept_complete if t is None else torch.ones_like(bad))
                stage_t.append(torch.where(any_reached, t_p, neg_inf))
                stage_known.append(any_reached)
            elif type(part) is MinP:
                stage_t.append(m + math.log(part.rho))
                stage_known.append(torch.ones_like(bad))
            else:  # MinProb: (m + log kept) + log tau, in fp32 as the rule
                if t is None:
                    kept = total.float()
                else:
                    kept = torch.where(kept_mask, e, 0.0).double().sum(-1).float()
                    bad |= ~kept_complete
                stage_value = (m + kept.log()) + math.log(part.tau)
                # log kept is known to MASS_MARGIN (relative mass, so absolute in logits), plus fp32 rounding of the sum
                near_width = MASS_MARGIN + stage_value.abs() * 2.0**-20
                near = ((vals - stage_value.unsqueeze(-1)).abs() <= near_width.unsqueeze(-1)) & valid_sorted
                bad |= near.any(-1)
                stage_t.append(stage_value)
                stage_known.append(torch.ones_like(bad))
        new_t, new_known = _combine(stage_t, stage_known, floor)
        if t is None:
            t, known = new_t, new_known
        else:
            t, known = _combine([t, new_t], [known, new_known], floor)
        t = torch.minimum(t, m)
    if t is None:  # every part keeps everything
        t = torch.full((n,), -math.inf, device=device)
    bad |= ~known
    return torch.minimum(t.clamp_min(finite_floor(torch.float32)), m), bad


def sorted_candidates(cand: torch.Tensor, count: torch.Tensor, kcap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vals, valid)``: each row's candidates sorted descending over the buffer's ``kcap`` columns (``-inf`` past the
    first ``min(count, kcap)``: below every candidate) and the unsorted mask of those columns, ``[n, kcap]`` each.

    The buffer's whole width, not the largest count (a read of the device): the columns past a row's count are
    ``-inf``, of no mass and never counted, so every decision is the same."""
    width = kcap if cand.shape[0] else 0
    valid = torch.arange(width, device=cand.device) < count.clamp(max=kcap).unsqueeze(-1)
    return torch.where(valid, cand[:, :width], -math.inf).sort(dim=-1, descending=True).values, valid


def _first_value(vals: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """``[n]``: each row's value at its first ``hit`` column (the first column where there is none)."""
    return vals.gather(-1, hit.to(torch.uint8).argmax(-1, keepdim=True)).squeeze(-1)


def _combine(values, known, floor):
    """``max`` of thresholds some of which are only known to lie below ``floor``: exact when every one is, or when
    a known one reaches ``floor`` (the unknown ones are below it)."""
    value = values[0] if len(values) == 1 else torch.stack(values).amax(0)
    certain = torch.stack(known)
    ok = certain.all(0) | (certain & (torch.stack(values) >= floor)).any(0)
    known_value = torch.where(certain, torch.stack(values), -math.inf).amax(0)
    return torch.where(ok, known_value, value), ok
