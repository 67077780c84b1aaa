"""LengthDecayLR (Algorithm 1, on-surge start, resume) and SurgeDetector on synthetic traces."""

import io
import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.optim.lr_scheduler import (
    ChainedScheduler,
    CosineAnnealingLR,
    ExponentialLR,
    LambdaLR,
    LinearLR,
    MultiStepLR,
    ReduceLROnPlateau,
    SequentialLR,
    StepLR,
)

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


@pytest.mark.parametrize(
    "period, min_ratio, steps", [(1, 0.1, 10), (3, 0.1, 40), (7, 0.25, 60), (204, 0.1, 1000), (5, 0.0, 80)]
)
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
    for kwargs, fragment in [
        ({"ratio": 1.0}, "ratio=1.0"),
        ({"window": 0}, "window=0"),
        ({"factor": -1}, "factor=-1"),
        ({"warmup": -2}, "warmup=-2"),
    ]:
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


# ---------------------------------------------------------------------------------------------- over any schedule

BASES = {
    "constant": None,
    "step": lambda opt: StepLR(opt, step_size=7, gamma=0.7),
    "multistep": lambda opt: MultiStepLR(opt, milestones=[10, 25, 60], gamma=0.5),
    "exponential": lambda opt: ExponentialLR(opt, gamma=0.97),
    "cosine": lambda opt: CosineAnnealingLR(opt, T_max=40, eta_min=1e-5),
    "lambda": lambda opt: LambdaLR(opt, lambda t: min(1.0, (t + 1) / 10) * 0.99**t),
    "warmup_then_cosine": lambda opt: SequentialLR(
        opt, [LinearLR(opt, start_factor=0.1, total_iters=10), CosineAnnealingLR(opt, T_max=50)], milestones=[10]
    ),
    "chained": lambda opt: ChainedScheduler([LinearLR(opt, start_factor=0.5, total_iters=8), ExponentialLR(opt, 0.98)]),
}


class ReferenceFactor:
    """The factor from its definition, step by step as Algorithm 1 halves (not from the closed form): the exponent
    grows by one at every multiple of the period after the start and at every later accepted decay."""

    def __init__(self, step0, period, r_min, max_decays, cooldown):
        self.decays = [0] if step0 else []
        self.period, self.r_min, self.max_decays, self.cooldown = period, r_min, max_decays, cooldown
        self.exponent = 0

    def advance(self, t):
        if self.decays and t > self.decays[0] and (t - self.decays[0]) % self.period == 0:
            self.exponent += 1

    def trigger(self, t):
        if len(self.decays) >= self.max_decays or (self.decays and t - self.decays[-1] < self.cooldown):
            return False
        if self.decays:
            self.exponent += 1
        self.decays.append(t)
        return True

    def factor(self):
        return max(0.5**self.exponent, self.r_min) if self.decays else 1.0


@given(
    base=st.sampled_from(sorted(BASES)),
    period=st.integers(1, 25),
    r_min=st.floats(0.0, 1.0),
    step0=st.booleans(),
    max_decays=st.integers(1, 4),
    cooldown=st.integers(0, 15),
    triggers=st.sets(st.integers(0, 70), max_size=8),
)
def test_effective_lr_is_the_base_schedule_times_the_factor(base, period, r_min, step0, max_decays, cooldown, triggers):
    """The wrapped schedule's LR equals an unwrapped twin of the same torch scheduler (its own optimizer) times the
    reference factor, exactly, at every step; trigger() accepts and refuses exactly as the reference does."""
    ref_opt, opt = make_optimizer((1e-3, 3e-4)), make_optimizer((1e-3, 3e-4))
    ref_base = BASES[base](ref_opt) if BASES[base] else None
    sched = LengthDecayLR(
        opt,
        period,
        min_lr_ratio=r_min,
        start="step0" if step0 else "on_surge",
        base_scheduler=BASES[base](opt) if BASES[base] else None,
        max_decays=max_decays,
        cooldown=cooldown,
    )
    ref = ReferenceFactor(step0, period, r_min, max_decays, cooldown)

    def check(t):
        base_lrs = [group["lr"] for group in ref_opt.param_groups]
        expected = [lr * ref.factor() for lr in base_lrs]
        assert [group["lr"] for group in opt.param_groups] == expected, t
        assert sched.get_last_lr() == expected and sched.get_last_base_lr() == base_lrs and sched.factor == ref.factor()

    for t in range(0, 91):
        if t:
            opt.step()
            sched.step()
            ref_opt.step()
            if ref_base is not None:
                ref_base.step()
            ref.advance(t)
        if t in triggers:
            assert sched.trigger() == ref.trigger(t), t
        check(t)
    assert sched.decay_steps == ref.decays and sched.num_decays == len(ref.decays)


@given(
    base=st.sampled_from(sorted(BASES)),
    step0=st.booleans(),
    cooldown=st.integers(0, 10),
    triggers=st.sets(st.integers(1, 60), max_size=6),
    resume_at=st.integers(0, 60),
)
def test_resume_through_bytes_continues_any_base_schedule_exactly(base, step0, cooldown, triggers, resume_at):
    def fresh():
        opt = make_optimizer((1e-3, 3e-4))
        return opt, LengthDecayLR(
            opt,
            6,
            min_lr_ratio=0.05,
            start="step0" if step0 else "on_surge",
            base_scheduler=BASES[base](opt) if BASES[base] else None,
            max_decays=4,
            cooldown=cooldown,
        )

    def drive(opt, sched, first, last):
        out = []
        for t in range(first, last + 1):
            opt.step()
            sched.step()
            if t in triggers:
                sched.trigger()
            out.append([group["lr"] for group in opt.param_groups])
        return out

    opt, sched = fresh()
    full = drive(opt, sched, 1, 60)
    opt, sched = fresh()
    head = drive(opt, sched, 1, resume_at)
    buffer = io.BytesIO()
    torch.save({"scheduler": sched.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    opt, sched = fresh()
    sched.load_state_dict(saved["scheduler"])  # sets the groups' LRs too: the next optimizer step's are right
    expected = full[resume_at - 1] if resume_at else fresh()[1].get_last_lr()
    assert [group["lr"] for group in opt.param_groups] == expected
    opt.load_state_dict(saved["optimizer"])
    assert head + drive(opt, sched, resume_at + 1, 60) == full


def test_no_base_scheduler_is_the_constant_schedule():
    """The first release's behaviour (no base scheduler) equals wrapping a constant LambdaLR."""
    opt_a, opt_b = make_optimizer((1e-3, 5e-4)), make_optimizer((1e-3, 5e-4))
    plain = LengthDecayLR(opt_a, decay_period=4, min_lr_ratio=0.2)
    wrapped = LengthDecayLR(opt_b, decay_period=4, min_lr_ratio=0.2, base_scheduler=LambdaLR(opt_b, lambda t: 1.0))
    assert run(plain, opt_a, 60, trigger_at=9) == run(wrapped, opt_b, 60, trigger_at=9)


def test_a_later_decay_halves_at_once_without_restarting_the_clock():
    opt = make_optimizer((1.0,))
    sched = LengthDecayLR(opt, decay_period=10, min_lr_ratio=0.0, max_decays=3, cooldown=4)
    accepted, lrs = {}, []
    for t in range(1, 41):
        opt.step()
        sched.step()
        if t in (5, 8, 9, 15, 30):
            accepted[t] = sched.trigger()
        lrs.append(opt.param_groups[0]["lr"])
    # 5: start (the clock runs from 5); 8: within the cooldown; 9: halves at once; 15: the clock halves (5 + 10) and
    # the third decay halves once more; 30: past the cap. The clock halves again at 25 and 35.
    assert accepted == {5: True, 8: False, 9: True, 15: True, 30: False}
    expected = [1.0] * 8 + [0.5] * 6 + [0.125] * 10 + [0.0625] * 10 + [0.03125] * 6
    assert lrs == expected and sched.decay_steps == [5, 9, 15] and sched.trigger_step == 5


def test_floor_holds_and_decays_at_the_floor_still_count():
    opt = make_optimizer((1.0,))
    sched = LengthDecayLR(opt, decay_period=1, min_lr_ratio=0.3, start="step0", max_decays=3)
    run(sched, opt, 5)
    assert opt.param_groups[0]["lr"] == 0.3 and sched.factor == 0.3
    assert sched.trigger() and sched.trigger() and not sched.trigger()
    assert opt.param_groups[0]["lr"] == 0.3 and sched.num_decays == 3


def drive_surges(baseline, cooldown, max_decays=3):
    """Surges at steps 41, 81, 131 and 171 (x4 each); the detector reports one when 3 of its 5 recent lengths are
    high, 2 steps after it starts."""
    lengths = [100.0] * 40 + [400.0] * 40 + [1600.0] * 50 + [6400.0] * 40 + [25600.0] * 60
    opt = make_optimizer()
    det = SurgeDetector(window=5, baseline_window=10, warmup=10, baseline=baseline)
    sched = LengthDecayLR(
        opt, decay_period=1000, min_lr_ratio=0.0, detector=det, max_decays=max_decays, cooldown=cooldown
    )
    decays = []
    for step, length in enumerate(lengths, 1):
        opt.step()
        sched.step()
        if sched.observe_length(step, length):
            decays.append(step)
    assert decays == sched.decay_steps
    return sched, det, opt.param_groups[0]["lr"]


@pytest.mark.parametrize("baseline", ["median", "ema"])
def test_repeated_surges_decay_until_the_cap(baseline):
    sched, det, lr = drive_surges(baseline, cooldown=0)
    assert sched.decay_steps == [43, 83, 133] and lr == 1e-3 * 0.25  # the start, then two halvings at once
    assert det.detections == [(41, 43), (81, 83), (131, 133)] and not det.armed  # the surge at 171 is past the cap
    sched, det, lr = drive_surges(baseline, cooldown=0, max_decays=4)
    assert sched.decay_steps == [43, 83, 133, 173] and lr == 1e-3 * 0.125


@pytest.mark.parametrize("baseline", ["median", "ema"])
def test_cooldown_holds_the_next_report_back(baseline):
    # Cooldown 45: the surge at 81 is reported when the cooldown ends (43 + 45 = 88), still standing out against
    # the baseline window then; the first recent step above the threshold is 84.
    sched, det, _ = drive_surges(baseline, cooldown=45)
    assert sched.decay_steps == [43, 88, 133] and det.detections == [(41, 43), (84, 88), (131, 133)]
    # Cooldown 60 (until 103): by then the fresh baseline has absorbed the surge at 81, which is never reported; the
    # one at 131 is, and the one at 171 falls in the next cooldown (until 193) and is absorbed too.
    sched, det, lr = drive_surges(baseline, cooldown=60)
    assert sched.decay_steps == [43, 133] and det.detections == [(41, 43), (131, 133)] and lr == 1e-3 * 0.5
    assert det.armed and det.not_before == 193


# ---------------------------------------------------------------------------------------------- errors and old states


def test_wrapping_errors():
    opt = make_optimizer()
    for base, error, fragment in [
        (StepLR(make_optimizer(), 3), ValueError, "base_scheduler drives another optimizer"),
        (ReduceLROnPlateau(opt), TypeError, "got ReduceLROnPlateau"),
        ("cosine", TypeError, "got str"),
    ]:
        with pytest.raises(error, match=fragment):
            LengthDecayLR(opt, 5, base_scheduler=base)
    with pytest.raises(ValueError, match="last_epoch=3 with a base_scheduler"):
        LengthDecayLR(opt, 5, last_epoch=3, base_scheduler=StepLR(opt, 3))
    for kwargs, fragment in [({"max_decays": 0}, "max_decays=0"), ({"cooldown": -1}, "cooldown=-1")]:
        with pytest.raises(ValueError, match=fragment):
            LengthDecayLR(make_optimizer(), 5, **kwargs)
    base = StepLR(opt, 3)
    sched = LengthDecayLR(opt, 5, base_scheduler=base)
    opt.step()
    base.step()
    with pytest.raises(RuntimeError, match=r"base_scheduler was stepped outside LengthDecayLR \(its last_epoch=1"):
        sched.step()
    with pytest.raises(ValueError, match="epoch=4"):
        LengthDecayLR(make_optimizer(), 5).step(4)


def test_scheduler_load_state_dict_names_missing_keys():
    """It loaded a state without 'trigger_step' or 'last_epoch' silently, keeping the fresh scheduler's values."""
    opt = make_optimizer()
    state = LengthDecayLR(opt, 5).state_dict()
    del state["trigger_step"], state["last_epoch"]
    with pytest.raises(ValueError) as err:
        LengthDecayLR(make_optimizer(), 5).load_state_dict(state)
    assert str(err.value) == (
        "state_dict lacks 'trigger_step', 'last_epoch': accepted a dict from LengthDecayLR.state_dict()"
    )


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            {"min_lr_ratio": 2.0},
            ValueError,
            "state_dict['min_lr_ratio']=2.0 is out of range: accepted 0 <= min_lr_ratio <= 1",
        ),
        ({"min_lr_ratio": math.nan}, ValueError, "state_dict['min_lr_ratio']=nan is out of range"),
        (
            {"start": "bogus"},
            ValueError,
            "state_dict['start']='bogus' is out of range: accepted one of ('on_surge', 'step0')",
        ),
        ({"max_decays": 0}, ValueError, "state_dict['max_decays']=0 is out of range: accepted an integer >= 1"),
        (
            {"cooldown": -1},
            ValueError,
            "state_dict['cooldown']=-1 is out of range: accepted an integer number of steps >= 0",
        ),
        ({"decay_period": 0}, ValueError, "state_dict['decay_period']=0 is out of range: accepted an integer >= 1"),
        (
            {"base_lrs": [math.nan]},
            ValueError,
            "state_dict['base_lrs'][0]=nan is out of range: accepted a finite learning rate >= 0",
        ),
        ({"_last_lr": [-1e-3]}, ValueError, "state_dict['_last_lr'][0]=-0.001 is out of range"),
        (
            {"_last_lr": [1e-3, 1e-3]},
            ValueError,
            "state_dict['_last_lr']=[0.001, 0.001] is out of range: accepted a list of 1 ",
        ),
        ({"last_epoch": "4"}, TypeError, "state_dict['last_epoch'] must be an integer, got str"),
        ({"trigger_step": -2, "decay_steps": [-2]}, ValueError, "state_dict['trigger_step']=-2 is out of range"),
        ({"trigger_step": 3, "decay_steps": [3, 1]}, ValueError, "state_dict['decay_steps']=[3, 1] is out of range"),
        ({"auto_period": "yes"}, TypeError, "state_dict['auto_period'] must be a bool"),
        (
            {"detector": {**SurgeDetector().state_dict(), "history": [("x", 3.0)]}},
            TypeError,
            "state_dict['history'][0] step must be an integer, got str: 'x'",
        ),
    ],
)
def test_scheduler_load_state_dict_checks_what_the_constructor_checks(change, error, message):
    """Issue 37, N3b: min_lr_ratio=2.0 turned the decay into doubling; start='bogus', max_decays=0, cooldown=-1 and
    NaN LRs were accepted. Each is one line naming the key, and the scheduler is left unchanged."""
    sched = LengthDecayLR(make_optimizer(), 5, max_decays=2, detector=SurgeDetector())
    before = sched.state_dict()
    with pytest.raises(error) as err:
        sched.load_state_dict({**sched.state_dict(), **change})
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
    assert sched.state_dict() == before


def test_states_with_and_without_a_base_scheduler_do_not_mix():
    opt = make_optimizer()
    with_base = LengthDecayLR(opt, 5, base_scheduler=StepLR(opt, 3)).state_dict()
    with pytest.raises(ValueError, match="holds a base_scheduler's state but this LengthDecayLR wraps none"):
        LengthDecayLR(make_optimizer(), 5).load_state_dict(with_base)
    without = LengthDecayLR(make_optimizer(), 5).state_dict()
    opt = make_optimizer()
    with pytest.raises(ValueError, match="has no base_scheduler state .* wraps StepLR"):
        LengthDecayLR(opt, 5, base_scheduler=StepLR(opt, 3)).load_state_dict(without)
