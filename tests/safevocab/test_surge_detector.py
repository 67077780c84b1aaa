"""SurgeDetector: the EMA baseline against pandas, re-arming, settings, states of the first release, missing keys."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from safevocab.schedulers import SurgeDetector

FIRST_RELEASE = Path(__file__).parent / "data" / "length_decay_first_release.pt"


def feed(detector, lengths, start=1):
    return [step for step, length in enumerate(lengths, start) if detector.update(step, length)]


def first_release():
    return torch.load(FIRST_RELEASE, weights_only=True)


def test_first_release_detector_states_resume():
    data = first_release()
    for k, state in data["detector"]["states"].items():
        detector = SurgeDetector()
        detector.load_state_dict(state)
        fired = [
            step for step in range(k + 1, len(data["lengths"]) + 1) if detector.update(step, data["lengths"][step - 1])
        ]
        assert [s for s in data["detector"]["fired"] if s <= k] + fired == data["detector"]["fired"], k
        assert detector.surge_step == data["detector"]["surge_step"]


def pandas_detection(lengths, window, baseline_window, ratio, warmup, alpha):
    """The first (detected_at, surge_step, baselines) from the definition, with pandas' EMA and medians."""
    pd = pytest.importorskip("pandas")
    series = pd.Series(lengths)
    ema = series.ewm(alpha=alpha, adjust=False).mean()
    baselines = {}
    for i in range(len(series)):
        before = i + 1 - window  # lengths that left the recent window
        if before < baseline_window:
            continue
        b = ema.iloc[before - 1]
        baselines[i + 1] = b
        recent = series.iloc[i - window + 1 : i + 1]
        if i + 1 >= warmup and b > 0 and recent.median() >= ratio * b:
            first_high = next(j for j, x in enumerate(recent) if x >= ratio * b)
            return i + 1, i - window + 2 + first_high, baselines
    return None, None, baselines


@pytest.mark.parametrize("seed", range(8))
def test_ema_baseline_matches_pandas(seed):
    rng = random.Random(seed)
    surge_at = rng.randrange(40, 120)
    jump = rng.uniform(1.6, 3.0)
    lengths = [1000 * (jump if step >= surge_at else 1.0) * (1 + 0.1 * rng.gauss(0, 1)) for step in range(1, 201)]
    alpha = rng.uniform(0.02, 0.5)
    detector = SurgeDetector(window=7, baseline_window=12, ratio=1.4, warmup=25, baseline="ema", ema_alpha=alpha)
    detected_at, surge_step, baselines = pandas_detection(lengths, 7, 12, 1.4, 25, alpha)
    fired = None
    for step, length in enumerate(lengths, 1):
        if detector.update(step, length):
            fired = step
            break
        if step in baselines:
            assert detector.baseline_length == pytest.approx(baselines[step], rel=1e-12), step
        else:
            assert detector.baseline_length is None, step
    assert detected_at is not None and fired == detected_at and detector.surge_step == surge_step


def test_rearm_starts_a_fresh_baseline_and_waits_for_not_before():
    det = SurgeDetector(window=3, baseline_window=4, warmup=0)
    assert feed(det, [10.0] * 8 + [40.0] * 2) == [10]  # 2 of the 3 recent lengths are high at step 10
    assert det.detections == [(9, 10)] and not det.armed and feed(det, [40.0], start=11) == []
    det.rearm()  # at once: on the old windows the surge at 9 would be reported again at step 12
    assert feed(det, [40.0] * 8, start=12) == [] and det.baseline_length == 40.0
    det.rearm(not_before=30)
    # A surge at 26 would be reported at 27; at 30 the baseline window (steps 24-27) still holds two 40s.
    assert feed(det, [40.0] * 6 + [160.0] * 10, start=20) == [30]
    assert det.detections == [(9, 10), (28, 30)] and det.surge_step == 9 and det.decay_period == 16


def test_detector_setting_errors():
    for kwargs, fragment in [
        ({"baseline": "mean"}, "baseline='mean'"),
        ({"baseline": "ema", "ema_alpha": 0.0}, "ema_alpha=0.0"),
        ({"baseline": "ema", "ema_alpha": 1.5}, "ema_alpha=1.5"),
        ({"ema_alpha": 0.1}, "ema_alpha=0.1 with baseline='median'"),
    ]:
        with pytest.raises(ValueError) as err:
            SurgeDetector(**kwargs)
        assert fragment in str(err.value)


def test_detector_load_state_dict_names_missing_keys():
    """It raised a bare KeyError('history') (issue 28)."""
    state = SurgeDetector().state_dict()
    del state["history"], state["n_updates"]
    with pytest.raises(ValueError) as err:
        SurgeDetector().load_state_dict(state)
    assert str(err.value) == (
        "state_dict lacks 'history', 'n_updates': accepted a dict from SurgeDetector.state_dict()"
    )
    with pytest.raises(TypeError, match="state_dict must be a dict, got list"):
        SurgeDetector().load_state_dict([])


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            {"history": [(1, 3.0), ("x", 3.0)]},
            TypeError,
            "state_dict['history'][1] step must be an integer, got str: 'x'",
        ),
        ({"history": [(1, -3.0)]}, ValueError, "state_dict['history'][0] length=-3.0 is out of range"),
        ({"history": [(1, float("nan"))]}, ValueError, "state_dict['history'][0] length=nan is out of range"),
        ({"history": [1, 2]}, ValueError, "state_dict['history'][0]=1 is out of range: accepted a pair of two values"),
        ({"n_updates": -1}, ValueError, "state_dict['n_updates']=-1 is out of range: accepted an integer >= 0"),
        ({"detections": [(3, "4")]}, TypeError, "state_dict['detections'][0] detection step must be an integer"),
        ({"armed": "no"}, TypeError, "state_dict['armed'] must be a bool"),
        ({"ratio": 0.5}, ValueError, "ratio=0.5 is out of range: accepted a finite ratio > 1"),
    ],
)
def test_detector_load_state_dict_checks_every_value(change, error, message):
    """Issue 37, N3b: a history step "x" was a raw ValueError from int('x'). One line naming the entry; the
    detector is left unchanged."""
    detector = SurgeDetector(window=2, baseline_window=2, warmup=0)
    for step in range(3):
        detector.update(step, 10.0)
    before = detector.state_dict()
    with pytest.raises(error) as err:
        detector.load_state_dict({**before, **change})
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
    assert detector.state_dict() == before
