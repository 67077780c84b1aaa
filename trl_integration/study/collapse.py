"""When, if ever, a study run collapsed: Study 4's registered criterion, computed from the run's logged series.

A run *collapses* at the first step ``t`` (its *onset*) at which one of four conditions holds; the time to collapse is
the earliest onset over them, and a run in which none holds is *censored* at its last logged step. With ``s_t`` the
logged value at optimizer step ``t`` and ``avg_k(s)_t`` the mean of ``s`` over steps ``t - k + 1 .. t`` (defined once
``k`` values exist):

1. ``non_finite``: the loss or the gradient norm logged at step ``t`` is NaN or infinite (``run["nonfinite"]``); or the
   run stopped on a non-finite value (``run["stopped_non_finite"]``: non-finite parameters, or a sampling distribution
   holding inf/NaN, the logits having overflowed): onset one step after its last logged step.
2. ``grad_norm``: ``grad_norm_t > grad_norm_factor x median(grad_norm over steps 1..grad_norm_baseline_steps)`` at every
   step ``t .. t + grad_norm_hold - 1`` (registered: 10x, steps 1-50, 10 consecutive steps).
3. ``reward``: ``avg_k(reward)_u < reward_drop x max_{v <= u} avg_k(reward)_v`` at every step ``u`` in
   ``t .. t + reward_hold - 1``, with ``t > reward_after`` (registered: ``k = 10``, below 50 % of the running maximum,
   after step 100, held 50 steps).
4. ``entropy``: ``avg_k(H_full)_t < entropy_floor`` at every step ``t .. t + entropy_hold - 1``, ``H_full`` the
   policy's full-softmax entropy (``safevocab/entropy_full``; trl's ``entropy`` where a run did not log it, which is
   the full softmax's for rule ``none``) (registered: ``k = 10``, floor 0.1 nats, held 10 steps).

A condition whose holding window would run past the run's last logged step does not count (the run is censored
there). Steps are the logged optimizer steps (``run["series"]["step"]``); a value that was not logged at a step (None)
breaks a holding window, as it cannot be shown to hold there.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CRITERIA", "CollapseCriterion", "CollapseResult", "collapse_of_run", "collapse_summary"]

#: The four conditions, in the order they are checked (ties in onset go to the earlier one).
CRITERIA = ("non_finite", "grad_norm", "reward", "entropy")


@dataclass(frozen=True)
class CollapseCriterion:
    """The registered thresholds of the collapse criterion (the module docstring); the defaults are Study 4's."""

    grad_norm_factor: float = 10.0
    grad_norm_baseline_steps: int = 50
    grad_norm_hold: int = 10
    reward_smooth: int = 10
    reward_drop: float = 0.5
    reward_after: int = 100
    reward_hold: int = 50
    entropy_smooth: int = 10
    entropy_floor: float = 0.1
    entropy_hold: int = 10


@dataclass
class CollapseResult:
    """The collapse of one run.

    Attributes:
        step: the onset of the collapse (the earliest over ``onsets``), or ``None``: no collapse.
        criterion: which condition gave ``step`` (one of :data:`CRITERIA`), or ``None``.
        censored_at: the run's last logged step (where a run without collapse is censored).
        onsets: each condition's own onset, or ``None``.
    """

    step: int | None
    criterion: str | None
    censored_at: int
    onsets: dict[str, int | None] = field(default_factory=dict)

    @property
    def collapsed(self) -> bool:
        return self.step is not None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "collapsed": self.collapsed}


def _trailing_mean(values: Sequence[float | None], k: int) -> list[float | None]:
    """``avg_k`` of the module docstring: None until ``k`` values, or where the window holds a missing value."""
    out: list[float | None] = []
    for i in range(len(values)):
        window = values[max(0, i - k + 1) : i + 1]
        out.append(None if len(window) < k or any(v is None for v in window) else sum(window) / k)
    return out


def _first_held(steps: Sequence[int], holds: Sequence[bool], hold: int, after: int = 0) -> int | None:
    """The first step ``t > after`` from which ``holds`` is true at ``hold`` consecutive logged steps."""
    run = 0
    for i, ok in enumerate(holds):
        if not ok or steps[i] <= after:
            run = 0
            continue
        run += 1
        if run == hold:
            return steps[i - hold + 1]
    return None


def _non_finite_onset(run: dict, steps: Sequence[int]) -> int | None:
    marks = run.get("nonfinite") or {}
    flagged = [s for key in ("loss", "grad_norm") for s in marks.get(key, [])]
    if flagged:
        return min(flagged)
    if run.get("stopped_non_finite") or run.get("parameters_finite") is False:
        return (steps[-1] if steps else 0) + 1
    return None


def _grad_norm_onset(series: dict, steps: Sequence[int], c: CollapseCriterion) -> int | None:
    norms = series.get("grad_norm") or []
    baseline = [g for s, g in zip(steps, norms) if 1 <= s <= c.grad_norm_baseline_steps and g is not None]
    if not baseline:
        return None
    limit = c.grad_norm_factor * statistics.median(baseline)
    return _first_held(steps, [g is not None and g > limit for g in norms], c.grad_norm_hold)


def _reward_onset(series: dict, steps: Sequence[int], c: CollapseCriterion) -> int | None:
    smoothed = _trailing_mean(series.get("reward") or [], c.reward_smooth)
    holds, best = [], -math.inf
    for value in smoothed:
        if value is not None:
            best = max(best, value)
        holds.append(value is not None and value < c.reward_drop * best)
    return _first_held(steps, holds, c.reward_hold, after=c.reward_after)


def _entropy_onset(series: dict, steps: Sequence[int], c: CollapseCriterion) -> int | None:
    entropy = series.get("safevocab/entropy_full") or series.get("entropy") or []
    smoothed = _trailing_mean(entropy, c.entropy_smooth)
    return _first_held(steps, [v is not None and v < c.entropy_floor for v in smoothed], c.entropy_hold)


def collapse_of_run(run: dict, criterion: CollapseCriterion | None = None) -> CollapseResult:
    """The collapse of one run record of ``results.json`` (``series``, ``nonfinite``, ``stopped_non_finite``)."""
    c = criterion or CollapseCriterion()
    series = run.get("series") or {}
    steps = [int(s) for s in series.get("step") or []]
    onsets = {
        "non_finite": _non_finite_onset(run, steps),
        "grad_norm": _grad_norm_onset(series, steps, c),
        "reward": _reward_onset(series, steps, c),
        "entropy": _entropy_onset(series, steps, c),
    }
    found = [(step, name) for name, step in onsets.items() if step is not None]
    step, name = min(found, key=lambda pair: (pair[0], CRITERIA.index(pair[1]))) if found else (None, None)
    return CollapseResult(step=step, criterion=name, censored_at=steps[-1] if steps else 0, onsets=onsets)


def collapse_summary(runs: Sequence[dict], criterion: CollapseCriterion | None = None) -> dict[str, Any]:
    """Collapses among ``runs`` (those that trained: ``ok`` or ``failed``): counts, onsets and criteria, per seed."""
    trained = [r for r in runs if r.get("status") in ("ok", "failed")]
    results = [(r["seed"], collapse_of_run(r, criterion)) for r in trained]
    return {
        "runs": len(results),
        "collapsed": sum(res.collapsed for _, res in results),
        "by_seed": {str(seed): res.to_dict() for seed, res in results},
    }
