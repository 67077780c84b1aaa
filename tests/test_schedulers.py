"""LengthDecayLR (Algorithm 1, on-surge start, resume) and SurgeDetector on synthetic traces."""

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from safevocab.schedulers import LengthDecayLR, SurgeDetector


def make_optimizer(lrs=(1e-3,)):
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in lrs]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])


def run(scheduler, optimizer, steps, trigger_at=None, trigger_period=None):
    lrs = []
    for t in range(1, steps + 1):
        optimizer.step()
        scheduler.step()
        if trigger_at is not None and t == trigger_at:
            scheduler.trigger(trigger_period)
        lrs.append([g["lr"] for g in optimizer.param_groups])
    return lrs


def algorithm_1(eta0, period, min_ratio, steps):
    """The paper's Algorithm 1, literally: after step t, halve when t is a multiple of the period."""
    eta, out = eta0, []
    for t in range(1, steps + 1):
        if t % period == 0:
            eta = max(eta / 2, min_ratio * eta0)
        out.append(eta)
    return out


@pytest.mark.parametrize("period, min_ratio, steps", [(1, 0.1, 10), (3, 0.1, 40), (7, 0.25, 60), (204, 0.1, 1000), (5, 0.0, 80)])
def test_step0_is_algorithm_1(period, min_ratio, steps):
    opt = make_optimizer((1e-3, 3e-4))
    sched = LengthDecayLR(opt, period, min_lr_ratio=min_ratio, start="step0")
    lrs = run(sched, opt, steps)
    for group, eta0 in enumerate((1e-3, 3e-4)):
        expected = algorithm_1(eta0, period, min_ratio, steps)
        assert [lr[group] for lr in lrs] == pytest.approx(expected, rel=1e-12)


@given(st.integers(1, 30), st.floats(0.0, 1.0), st.integers(0, 60))
def test_on_surge_holds_then_follows_algorithm_1_from_the_trigger(period, min_ratio, trigger_at):
    opt = make_optimizer()
    sched = LengthDecayLR(opt, decay_period=1000, min_lr_ratio=min_ratio)
    lrs = [lr[0] for lr in run(sched, opt, trigger_at + 120, trigger_at=trigger_at or None, trigger_period=period)]
    if trigger_at == 0:
        assert lrs == [1e-3] * len(lrs)  # never triggered
        return
    assert lrs[:trigger_at] == [1e-3] * trigger_at
    assert lrs[trigger_at:] == pytest.approx(algorithm_1(1e-3, period, min_ratio, 120), rel=1e-12)


def test_trigger_only_once():
    opt = make_optimizer()
    sched = LengthDecayLR(opt, decay_period=2)
    run(sched, opt, 3)
    assert sched.trigger() is True and sched.decay_active and sched.trigger_step == 3
    assert sched.trigger(decay_period=50) is False and sched.decay_period == 2


def test_state_dict_resume_reproduces_sequence():
    def fresh():
        opt = make_optimizer((1e-3, 5e-4))
        return opt, LengthDecayLR(opt, decay_period=4, min_lr_ratio=0.2)

    opt, sched = fresh()
    full = run(sched, opt, 10) + run(sched, opt, 5, trigger_at=2, trigger_period=3) + run(sched, opt, 30)

    opt, sched = fresh()
    head = run(sched, opt, 10) + run(sched, opt, 5, trigger_at=2, trigger_period=3)
    state, opt_state = sched.state_dict(), opt.state_dict()
    opt2, sched2 = fresh()
    opt2.load_state_dict(opt_state)
    sched2.load_state_dict(state)
    tail = run(sched2, opt2, 30)
    assert head + tail == full


def test_gradient_accumulation_steps_once_per_optimizer_step():
    # The scheduler counts optimizer steps, not micro-batches: with accumulation 4, 20 micro-batches
    # are 5 steps, and the LR sequence equals Algorithm 1 over those 5 steps.
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = LengthDecayLR(opt, decay_period=2, start="step0")
    seen = []
    for micro in range(1, 21):
        model(torch.randn(3, 2)).sum().backward()
        if micro % 4 == 0:
            opt.step()
            sched.step()
            opt.zero_grad()
            seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx(algorithm_1(0.1, 2, 0.1, 5))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"decay_period": 0}, "decay_period=0"),
        ({"decay_period": 5, "min_lr_ratio": 1.5}, "min_lr_ratio=1.5"),
        ({"decay_period": 5, "start": "later"}, "start='later'"),
    ],
)
def test_scheduler_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        LengthDecayLR(make_optimizer(), **kwargs)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"decay_period": 2.5}, "decay_period must be an integer, got float"),
        ({"decay_period": "5"}, "decay_period must be an integer, got str"),
        ({"decay_period": 5, "min_lr_ratio": None}, "min_lr_ratio must be a real number, got NoneType"),
    ],
)
def test_scheduler_wrong_types(kwargs, fragment):
    with pytest.raises(TypeError) as err:
        LengthDecayLR(make_optimizer(), **kwargs)
    assert fragment in str(err.value)


# ---------------------------------------------------------------------------------------------- detector


def feed(detector, lengths, start=1):
    fired = [step for step, length in enumerate(lengths, start) if detector.update(step, length)]
    return fired


def test_flat_trace_never_fires():
    det = SurgeDetector()
    assert feed(det, [1000.0] * 500) == []
    assert det.surge_step is None and det.decay_period is None


@pytest.mark.parametrize("baseline", ["median", "ema"])
@pytest.mark.parametrize("seed", range(20))
def test_noisy_flat_no_false_alarm(seed, baseline):
    rng = random.Random(seed)
    lengths = [1000 * (1 + 0.15 * rng.gauss(0, 1)) + (2000 if rng.random() < 0.02 else 0) for _ in range(600)]
    assert feed(SurgeDetector(baseline=baseline), lengths) == []


@pytest.mark.parametrize("baseline", ["median", "ema"])
@pytest.mark.parametrize("seed", range(10))
def test_surge_near_step_100_gives_period_near_180(seed, baseline):
    rng = random.Random(seed)
    lengths = []
    for step in range(1, 301):
        base = 1000 if step < 100 else min(3000, 1000 + 700 * (step - 99))  # triples within 3 steps
        lengths.append(base * (1 + 0.08 * rng.gauss(0, 1)))
    det = SurgeDetector(baseline=baseline)
    fired = feed(det, lengths)
    assert len(fired) == 1 and 100 <= fired[0] <= 110  # detected within a few steps, once
    assert 98 <= det.surge_step <= 103
    assert 176 <= det.decay_period <= 186


@pytest.mark.parametrize("baseline", ["median", "ema"])
@pytest.mark.parametrize("total_growth_steps", [150, 400, 1000])
def test_gradual_growth_is_not_a_surge(total_growth_steps, baseline):
    lengths = [1000 + 2000 * min(1.0, step / total_growth_steps) for step in range(1, 1201)]
    assert feed(SurgeDetector(baseline=baseline), lengths) == []


def test_detector_state_dict_resume():
    rng = random.Random(0)
    lengths = [1000 * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(80)] + [3000.0] * 40
    ref = SurgeDetector()
    ref_fired = feed(ref, lengths)
    det = SurgeDetector()
    assert feed(det, lengths[:82]) == []  # resume before the detection
    resumed = SurgeDetector()
    resumed.load_state_dict(det.state_dict())
    fired = feed(resumed, lengths[82:], start=83)
    assert fired == ref_fired and resumed.surge_step == ref.surge_step and resumed.decay_period == ref.decay_period


def test_detector_ignores_nan_and_validates():
    det = SurgeDetector(window=2, baseline_window=2, warmup=0)
    assert not det.update(1, math.nan)
    assert det.n_updates == 0
    with pytest.raises(ValueError, match="mean_length"):
        det.update(2, -1.0)
    for kwargs, fragment in [({"ratio": 1.0}, "ratio=1.0"), ({"window": 0}, "window=0"), ({"factor": -1}, "factor=-1"), ({"warmup": -2}, "warmup=-2")]:
        with pytest.raises(ValueError) as err:
            SurgeDetector(**kwargs)
        assert fragment in str(err.value)


def test_detector_drives_scheduler():
    opt = make_optimizer()
    sched = LengthDecayLR(opt, decay_period=10**6)
    det = SurgeDetector(window=5, baseline_window=10, warmup=10)
    lengths = [100.0] * 40 + [400.0] * 200
    for step, length in enumerate(lengths, 1):
        opt.step()
        sched.step()
        if det.update(step, length):
            sched.trigger(det.decay_period)
    assert det.surge_step == 41 and sched.decay_period == round(1.8 * 41)
    assert sched.trigger_step == det.detected_at
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 ** ((240 - det.detected_at) // 74))


def test_scheduler_with_detector_resumes_through_weights_only_checkpoint(tmp_path):
    """The Trainer saves the scheduler with torch.save and loads it with weights_only=True."""
    rng = random.Random(1)
    lengths = [500 * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(70)] + [1500.0] * 130

    def fresh():
        opt = make_optimizer((1e-3, 2e-4))
        return opt, LengthDecayLR(opt, decay_period=7, detector=SurgeDetector(), auto_period=True)

    def drive(opt, sched, steps, start):
        lrs = []
        for step in range(start, start + steps):
            opt.step()
            sched.step()
            sched.observe_length(step, lengths[step - 1])
            lrs.append([g["lr"] for g in opt.param_groups])
        return lrs

    opt, sched = fresh()
    full = drive(opt, sched, 200, 1)
    assert sched.detector.surge_step == 71 and sched.decay_period == round(1.8 * 71)

    opt, sched = fresh()
    head = drive(opt, sched, 60, 1)  # checkpoint before the surge: the detector's window matters
    torch.save(sched.state_dict(), tmp_path / "scheduler.pt")
    opt2, sched2 = fresh()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(torch.load(tmp_path / "scheduler.pt", weights_only=True))
    assert head + drive(opt2, sched2, 140, 61) == full


def test_fixed_period_with_detector_and_errors():
    opt = make_optimizer()
    sched = LengthDecayLR(opt, decay_period=5, detector=SurgeDetector(window=2, baseline_window=3, warmup=0))
    for step, length in enumerate([10.0] * 5 + [40.0] * 3, 1):
        opt.step()
        sched.step()
        sched.observe_length(step, length)
    assert sched.decay_active and sched.decay_period == 5  # fixed period kept without auto_period
    with pytest.raises(ValueError, match="detector"):
        LengthDecayLR(make_optimizer(), decay_period=5).observe_length(1, 1.0)
    with pytest.raises(ValueError, match="auto_period"):
        LengthDecayLR(make_optimizer(), decay_period=5, auto_period=True)
