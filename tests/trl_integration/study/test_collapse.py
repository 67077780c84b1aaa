"""Study 4's collapse criterion on hand-made runs: each condition flagged where it holds, and only there."""

from __future__ import annotations

import math

import pytest

from trl_integration.study.collapse import CollapseCriterion, collapse_of_run, collapse_summary


def make_run(steps=600, reward=None, grad_norm=None, entropy=None, nonfinite=None, parameters_finite=True, **extra):
    """A run record as ``results.json`` holds it: flat healthy series unless given."""
    series = {
        "step": list(range(1, steps + 1)),
        "reward": reward if reward is not None else [0.3] * steps,
        "grad_norm": grad_norm if grad_norm is not None else [0.5] * steps,
        "safevocab/entropy_full": entropy if entropy is not None else [3.0] * steps,
        "loss": [0.0] * steps,
        **extra,
    }
    return {"arm": "no_remedy", "seed": 14, "status": "ok", "series": series,
            "nonfinite": nonfinite or {}, "parameters_finite": parameters_finite}  # fmt: skip


def test_a_healthy_run_does_not_collapse_and_is_censored_at_its_last_step():
    result = collapse_of_run(make_run())
    assert not result.collapsed and result.step is None and result.censored_at == 600
    assert result.onsets == {"non_finite": None, "grad_norm": None, "reward": None, "entropy": None}


def test_a_non_finite_loss_collapses_at_its_step():
    result = collapse_of_run(make_run(nonfinite={"loss": [250], "reward": [3]}))  # a NaN reward is not the criterion
    assert (result.step, result.criterion) == (250, "non_finite")


def test_a_run_stopped_on_a_non_finite_value_collapses_after_its_last_step():
    run = {**make_run(steps=120), "status": "failed", "stopped_non_finite": True}
    assert (collapse_of_run(run).step, collapse_of_run(run).criterion) == (121, "non_finite")
    run = {**make_run(steps=120, parameters_finite=False), "status": "failed"}
    assert collapse_of_run(run).step == 121
    run = {**make_run(steps=120), "status": "failed", "stopped_non_finite": False}  # another failure: not a collapse
    assert not collapse_of_run(run).collapsed


def test_the_gradient_norm_must_stay_above_ten_times_its_baseline_median_for_ten_steps():
    norms = [0.5] * 600
    norms[300:309] = [6.0] * 9  # 9 steps above 5.0 (10 x 0.5): not held long enough
    assert collapse_of_run(make_run(grad_norm=norms)).onsets["grad_norm"] is None
    norms[400:410] = [5.1] * 10  # steps 401..410
    assert collapse_of_run(make_run(grad_norm=norms)).onsets["grad_norm"] == 401
    norms2 = [0.5] * 600
    norms2[400:410] = [5.0] * 10  # equal to the limit is not above it
    assert collapse_of_run(make_run(grad_norm=norms2)).onsets["grad_norm"] is None


def test_a_reward_collapse_is_flagged_at_the_start_of_its_fifty_steps():
    reward = [0.4] * 200 + [0.1] * 400  # the 10-step mean: 0.22 at step 206 (4 x 0.4 + 6 x 0.1), 0.19 at step 207
    result = collapse_of_run(make_run(reward=reward))
    assert (result.step, result.criterion) == (207, "reward")


def test_a_reward_drop_that_recovers_or_ends_the_run_is_not_a_collapse():
    recovered = [0.4] * 200 + [0.1] * 45 + [0.4] * 355  # below half for fewer than 50 steps
    assert collapse_of_run(make_run(reward=recovered)).onsets["reward"] is None
    at_the_end = [0.4] * 570 + [0.1] * 30  # its 50 steps would run past step 600: censored
    assert collapse_of_run(make_run(reward=at_the_end)).onsets["reward"] is None


def test_a_reward_collapse_before_step_100_counts_only_from_step_101():
    reward = [0.4] * 20 + [0.1] * 580
    assert collapse_of_run(make_run(reward=reward)).onsets["reward"] == 101


def test_an_entropy_below_the_floor_for_ten_steps_collapses():
    entropy = [3.0] * 100 + [0.05] * 500  # the 10-step mean is below 0.1 from step 110 (all ten values low)
    result = collapse_of_run(make_run(entropy=entropy))
    assert (result.step, result.criterion) == (110, "entropy")
    assert collapse_of_run(make_run(entropy=entropy), CollapseCriterion(entropy_floor=0.01)).onsets["entropy"] is None


def test_the_entropy_falls_back_to_trls_entropy_for_runs_without_the_full_one():
    run = make_run()
    del run["series"]["safevocab/entropy_full"]
    run["series"]["entropy"] = [3.0] * 50 + [0.01] * 550
    assert collapse_of_run(run).onsets["entropy"] == 60


def test_a_missing_value_breaks_a_holding_window():
    reward = [0.4] * 200 + [0.1] * 400
    reward[230] = None  # not logged at step 231: the 10-step means around it are undefined
    assert collapse_of_run(make_run(reward=reward)).onsets["reward"] == 241  # the first full window after the gap


def test_the_earliest_condition_wins_and_the_summary_counts_trained_runs_only():
    both = make_run(reward=[0.4] * 200 + [0.1] * 400, entropy=[3.0] * 150 + [0.01] * 450)
    assert collapse_of_run(both).criterion == "entropy"
    not_run = {"arm": "no_remedy", "seed": 15, "status": "not_run", "series": {"step": []}}
    healthy = {**make_run(), "seed": 16}
    summary = collapse_summary([both, healthy, not_run])
    assert summary["runs"] == 2 and summary["collapsed"] == 1
    assert summary["by_seed"]["14"]["collapsed"] is True


@pytest.mark.parametrize("nan", [math.nan, None])
def test_series_without_values_do_not_collapse(nan):
    run = make_run(steps=5, reward=[nan] * 5, grad_norm=[None] * 5, entropy=[None] * 5)
    assert not collapse_of_run(run).collapsed
