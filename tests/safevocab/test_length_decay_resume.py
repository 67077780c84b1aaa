"""LengthDecayLR over transformers' warm-up + cosine schedule, resume at every step with the controls active, and the
first release's checkpoints."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
import torch

from safevocab.schedulers import LengthDecayLR, SurgeDetector

FIRST_RELEASE = Path(__file__).parent / "data" / "length_decay_first_release.pt"


def two_groups():
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    return torch.optim.SGD([{"params": [params[0]], "lr": 1e-3}, {"params": [params[1]], "lr": 2e-4}])


def lrs(optimizer):
    return [group["lr"] for group in optimizer.param_groups]


# ---------------------------------------------------------------------------------------------- transformers' schedule


def test_cosine_with_warmup_times_the_factor_equals_transformers_schedule():
    """Issue 32's case: warm-up 20, 200 steps, period 50 from step 0, floor 0.1. The reference is transformers' own
    schedule on a twin optimizer; the factor is written here from the definition."""
    transformers = pytest.importorskip("transformers")
    cosine = transformers.get_cosine_schedule_with_warmup
    ref_opt, opt = two_groups(), two_groups()
    ref = cosine(ref_opt, num_warmup_steps=20, num_training_steps=200)
    sched = LengthDecayLR(
        opt,
        decay_period=50,
        min_lr_ratio=0.1,
        start="step0",
        base_scheduler=cosine(opt, num_warmup_steps=20, num_training_steps=200),
    )
    seen, expected = [], []
    for t in range(200):  # the LR of optimizer step t + 1, set after t scheduler steps
        seen.append(lrs(opt))
        expected.append([lr * max(0.5 ** (t // 50), 0.1) for lr in lrs(ref_opt)])
        assert sched.get_last_base_lr() == lrs(ref_opt)
        opt.step()
        sched.step()
        ref_opt.step()
        ref.step()
    for t, (got, want) in enumerate(zip(seen, expected)):
        assert got == pytest.approx(want, rel=1e-6, abs=0.0), t
    assert seen == expected  # exactly: the same product in the same order
    assert expected[10][0] == pytest.approx(1e-3 * 10 / 20) and expected[60][0] < expected[40][0] / 2


# ---------------------------------------------------------------------------------------------- resume at every step

STEPS = 300


def surge_lengths():
    """Surges at 60, 130, 170, 220 and 285 over 300 steps, 3 % noise."""
    rng = random.Random(7)
    levels = [(60, 500.0), (130, 1500.0), (170, 4000.0), (220, 9000.0), (285, 20000.0), (STEPS + 1, 45000.0)]
    out = []
    for step in range(1, STEPS + 1):
        level = next(value for end, value in levels if step < end)
        out.append(level * (1 + 0.03 * rng.gauss(0, 1)))
    return out


LENGTHS = surge_lengths()


def build(max_decays=3, cooldown=50):
    transformers = pytest.importorskip("transformers")
    opt = two_groups()
    base = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=20, num_training_steps=STEPS)
    detector = SurgeDetector(window=5, baseline_window=10, warmup=10, baseline="ema", ema_alpha=0.2)
    sched = LengthDecayLR(
        opt,
        decay_period=1,
        min_lr_ratio=0.1,
        detector=detector,
        auto_period=True,
        base_scheduler=base,
        max_decays=max_decays,
        cooldown=cooldown,
    )
    return opt, sched


def drive(opt, sched, first, last):
    """Steps ``first`` to ``last``: per step the effective and base LRs, the factor, whether it decayed, and the
    detector's baseline and arming."""
    trace = []
    for step in range(first, last + 1):
        opt.step()
        sched.step()
        decayed = sched.observe_length(step, LENGTHS[step - 1])
        detector = sched.detector
        trace.append(
            (
                lrs(opt),
                sched.get_last_lr(),
                sched.get_last_base_lr(),
                sched.factor,
                decayed,
                detector.baseline_length,
                detector.armed,
            )
        )
    return trace


def test_the_resume_scenario_exercises_cooldown_cap_floor_and_ema():
    opt, sched = build()
    drive(opt, sched, 1, STEPS)
    det = sched.detector
    # Start at 62 (period round(1.8 x 60) = 108), a halving at once at 132; the surge at 170 falls in the cooldown
    # (until 182) and the EMA absorbs it by then; 222 is the third and last decay, so the surge at 285 is not watched.
    assert sched.decay_steps == [62, 132, 222] and sched.decay_period == 108
    assert [d for _, d in det.detections] == [62, 132, 222] and not det.armed
    assert sched.factor == 0.1  # 0.5 ** ((300 - 62) // 108 + 2) = 0.0625, floored
    _, without_cooldown = build(cooldown=0)
    _, more = build(max_decays=4)
    drive(without_cooldown.optimizer, without_cooldown, 1, STEPS)
    drive(more.optimizer, more, 1, STEPS)
    assert without_cooldown.decay_steps == [62, 132, 172] and more.decay_steps == [62, 132, 222, 287]


def resume_points(decisions: list[int]) -> list[int]:
    """The steps after which the resume test saves: every step of the warm-up (detector warm-up and baseline window,
    the cosine warm-up), every step from a window and a baseline window before each surge or decay to the end of its
    cooldown's first steps, each cooldown's last steps, the last steps of the run, and every 6th step in between.

    Every step from 0 to 300 took ~300 resumes x 300 steps (quadratic: the fast suite's slowest pure-CPU test); these
    are the steps where a state left out of ``state_dict`` changes what comes next (inside a detection window, at a
    decision, around a cooldown's end), plus a regular grid for anything else."""
    points = set(range(0, 26)) | set(range(0, STEPS + 1, 6)) | set(range(STEPS - 3, STEPS + 1))
    for step in decisions:
        points |= set(range(step - 16, step + 4)) | set(range(step + 47, step + 53))
    return sorted(k for k in points if 0 <= k <= STEPS)


def test_resume_at_every_step_reproduces_the_run_exactly():
    """Scheduler and optimizer states saved to bytes after step k, loaded (weights_only) into a fresh optimizer,
    base schedule, detector and wrapper, continue exactly as the uninterrupted run: LRs, factor and decisions. The
    steps k (:func:`resume_points`): every step near a surge, a decay or a cooldown's end, every 6th elsewhere."""
    opt, sched = build()
    full = drive(opt, sched, 1, STEPS)
    full_state, full_detections = sched.state_dict(), list(sched.detector.detections)
    surges = [60, 130, 170, 220, 285]  # surge_lengths()'s level changes: detections may follow, decays or not
    points = resume_points(sorted({*surges, *sched.decay_steps}))
    for k in points:
        opt, sched = build()
        head = drive(opt, sched, 1, k)
        buffer = io.BytesIO()
        torch.save({"scheduler": sched.state_dict(), "optimizer": opt.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        opt, sched = build()
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        assert lrs(opt) == (full[k - 1][0] if k else lrs(build()[0])), k
        tail = drive(opt, sched, k + 1, STEPS)
        assert head + tail == full, f"resumed after step {k}"
        assert sched.state_dict() == full_state, f"resumed after step {k}"  # every decision, the EMA, the windows
        assert sched.detector.detections == full_detections, f"resumed after step {k}"


# ---------------------------------------------------------------------------------------------- the first release


def first_release():
    return torch.load(FIRST_RELEASE, weights_only=True)


@pytest.mark.parametrize("run", ["on_surge", "step0"])
def test_first_release_checkpoints_resume_as_that_release_continued(run):
    """States written by the first release (tests/safevocab/data/make_length_decay_first_release.py: no base scheduler,
    cooldown, cap or EMA keys) load into today's class, which continues with that release's own LRs."""
    data = first_release()
    recorded = data[run]

    def fresh():  # what SafeVocabGRPOTrainer builds from the same config today
        opt = two_groups()
        if run == "on_surge":
            return opt, LengthDecayLR(opt, decay_period=1, detector=SurgeDetector(), auto_period=True)
        return opt, LengthDecayLR(opt, decay_period=7, min_lr_ratio=0.2, start="step0")

    for k, state in recorded["states"].items():
        assert "decay_steps" not in state["scheduler"] and "max_decays" not in state["scheduler"]
        opt, sched = fresh()
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        tail = []
        for step in range(k + 1, len(data["lengths"]) + 1):
            opt.step()
            sched.step()
            if sched.detector is not None:
                sched.observe_length(step, data["lengths"][step - 1])
            tail.append(lrs(opt))
        assert tail == recorded["lrs"][k:], f"resumed after step {k}"
        assert sched.trigger() is False  # that release decayed once: the start is its only decay
