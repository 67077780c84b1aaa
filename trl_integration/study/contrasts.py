"""Contrasts of a study: signed combinations of arms, paired by seed, for the questions a DVP study asks.

A contrast is ``sum_a w_a · outcome(a, seed)`` over arms ``a`` with weights ``w_a`` summing to 0, computed for each
training seed at which every arm of the contrast finished, then averaged over those seeds with a 95 % t-interval
(:func:`~trl_integration.study.aggregate.paired_stats`). With the matched controls ``no_mismatch`` (no remedy, no
injected mismatch) and ``dvp_no_mismatch`` (DVP, no injected mismatch) in the same study:

| contrast | arms | reads |
|---|---|---|
| ``harm`` | ``no_remedy − no_mismatch`` | what the injected mismatch costs without a remedy |
| ``dvp_cost`` | ``dvp_no_mismatch − no_mismatch`` | what DVP costs on its own, without mismatch |
| ``dvp_residual_harm`` | ``dvp − dvp_no_mismatch`` | what the mismatch still costs under DVP |
| ``dvp_interaction`` | ``(dvp − dvp_no_mismatch) − (no_remedy − no_mismatch)`` | how much of the harm DVP removes |
| ``dvp_gain`` | ``dvp − no_remedy`` | DVP against no remedy, under the mismatch (its cost included) |
| ``tis_gain`` | ``tis − no_remedy`` | truncated IS against no remedy |
| ``tis_residual_harm`` | ``tis − no_mismatch`` | what the mismatch still costs under truncated IS |
| ``dvp_minus_tis`` | ``dvp − tis`` | DVP against truncated IS, under the mismatch |
| ``dvp_residual_clean`` | ``dvp − no_mismatch`` | DVP under the mismatch against the clean control (its cost included) |
| ``dvp_tis_gain`` | ``dvp_tis − no_remedy`` | DVP + truncated IS against no remedy |
| ``dvp_tis_minus_dvp`` | ``dvp_tis − dvp`` | what truncated IS adds to DVP |
| ``dvp_tis_residual_clean`` | ``dvp_tis − no_mismatch`` | DVP + truncated IS against the clean control |

Each is computed for the late and the final held-out metric of every scoring the runs recorded (the full
distribution; the DVP rule's support with ``--eval_on_rule``: keys with ``_rule``), and, with evaluation seeds,
for each evaluation seed alone (``<key>_by_eval_seed``), so that a reader can see whether a result hinges on one
evaluation draw. Contrasts whose arms did not all run are left out. To combine two studies (e.g. a condition
without its own controls), append the other study's control runs to ``results["runs"]`` and their arms to
``results["arms"]`` before calling :func:`contrasts`: runs pair by seed, whichever file they come from.
"""

from __future__ import annotations

from typing import Any

from trl_integration.study.aggregate import (
    eval_seed_outcomes,
    eval_seeds,
    metric_name,
    paired_stats,
    run_metrics,
    scorings,
)

__all__ = ["CONTRASTS", "contrasts"]

#: name -> (arm weights, what it reads).
CONTRASTS: dict[str, tuple[dict[str, int], str]] = {
    "harm": ({"no_remedy": 1, "no_mismatch": -1}, "the mismatch's cost without a remedy"),
    "dvp_cost": ({"dvp_no_mismatch": 1, "no_mismatch": -1}, "DVP's own cost, without mismatch"),
    "dvp_residual_harm": ({"dvp": 1, "dvp_no_mismatch": -1}, "the mismatch's cost under DVP"),
    "dvp_interaction": (
        {"dvp": 1, "dvp_no_mismatch": -1, "no_remedy": -1, "no_mismatch": 1},
        "the part of the harm DVP removes (residual harm − harm)",
    ),
    "dvp_gain": ({"dvp": 1, "no_remedy": -1}, "DVP against no remedy under the mismatch"),
    "tis_gain": ({"tis": 1, "no_remedy": -1}, "truncated IS against no remedy"),
    "tis_residual_harm": ({"tis": 1, "no_mismatch": -1}, "the mismatch's cost under truncated IS"),
    "dvp_minus_tis": ({"dvp": 1, "tis": -1}, "DVP against truncated IS under the mismatch"),
    "dvp_residual_clean": ({"dvp": 1, "no_mismatch": -1}, "DVP under the mismatch against the clean control"),
    "dvp_tis_gain": ({"dvp_tis": 1, "no_remedy": -1}, "DVP + truncated IS against no remedy"),
    "dvp_tis_minus_dvp": ({"dvp_tis": 1, "dvp": -1}, "what truncated IS adds to DVP"),
    "dvp_tis_residual_clean": ({"dvp_tis": 1, "no_mismatch": -1}, "DVP + truncated IS against the clean control"),
}


def _formula(weights: dict[str, int]) -> str:
    plus = [a for a, w in weights.items() if w > 0]
    minus = [a for a, w in weights.items() if w < 0]
    if len(plus) == len(minus) == 1:
        return f"{plus[0]} − {minus[0]}"
    return f"({plus[0]} − {minus[0]}) − ({minus[1]} − {plus[1]})"  # the interaction's form


def contrasts(results: dict) -> dict[str, dict[str, Any]]:
    """Every contrast of `CONTRASTS` whose arms all ran in ``results`` (see the module docstring).

    Returns:
        ``{name: {"weights", "formula", "description", <outcome>: paired_stats, <outcome>_by_eval_seed: [...]}}``
        with ``<outcome>`` in ``final_metric``, ``late_metric`` (and ``..._rule`` when scored on the rule's support).
    """
    metric = metric_name(results)
    outcomes: dict[tuple[str, int], dict[str, Any]] = {}  # per run: its scalar outcomes, and per evaluation seed
    per_eval_seed: dict[tuple[str, int], dict[str, list]] = {}
    for run in results.get("runs", []):
        if run.get("status") == "ok":
            outcomes[(run["arm"], run["seed"])] = run_metrics(run, metric)
            per_eval_seed[(run["arm"], run["seed"])] = eval_seed_outcomes(run, metric)
    keys = [f"{key}{suffix}" for suffix in scorings(results) for key in ("final_metric", "late_metric")]
    n_eval_seeds = len(eval_seeds(results) or [])
    out: dict[str, dict[str, Any]] = {}
    for name, (weights, description) in CONTRASTS.items():
        if not all(arm in results.get("arms", {}) for arm in weights):
            continue
        seeds = sorted({seed for (_, seed) in outcomes if all((arm, seed) in outcomes for arm in weights)})
        entry: dict[str, Any] = {"weights": dict(weights), "formula": _formula(weights), "description": description}
        for key in keys:
            entry[key] = _combine(outcomes, weights, seeds, lambda m, k=key: m.get(k))
            if n_eval_seeds:
                entry[f"{key}_by_eval_seed"] = [
                    _combine(
                        per_eval_seed, weights, seeds, lambda m, k=key, j=j: (m.get(k) or [None] * n_eval_seeds)[j]
                    )
                    for j in range(n_eval_seeds)
                ]
        out[name] = entry
    return out


def _combine(outcomes: dict, weights: dict[str, int], seeds: list[int], value) -> dict[str, Any]:
    """`paired_stats` of ``sum_a w_a · value(outcomes[a, seed])`` over the seeds where every value is defined."""
    diffs, used = [], []
    for seed in seeds:
        values = [value(outcomes[(arm, seed)]) for arm in weights]
        if None not in values:
            diffs.append(sum(w * v for w, v in zip(weights.values(), values)))
            used.append(seed)
    return paired_stats(diffs, used)
