"""Length-decay LR schedule wired into SafeVocabGRPOTrainer: config, the factor over trl's own schedule, the controls,
the metrics, resume through the trainer's checkpoints (and from a checkpoint of the code before), the CLI."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import trl_helpers
from trl_helpers import grpo_kwargs, prompt_dataset

from safevocab.schedulers import LengthDecayLR
from trl_integration import HardenedSafeVocabGRPOTrainer, SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration.commands.grpo import make_parser, run
from trl_integration.grpo.length_decay import METRICS, LengthDecayCallback

transformers = pytest.importorskip("transformers")

#: The smallest GRPO step trl accepts: 2 prompts' worth of rows in groups of 2, completions of at most 2 tokens.
SMALL = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=2)
BEFORE_ISSUE32 = Path(__file__).parent / "data" / "length_decay_before_issue32.pt"


def make_trainer(model_dir, tmp_path, trainer_cls=SafeVocabGRPOTrainer, **config):
    return trl_helpers.make_trainer(model_dir, tmp_path, trainer_cls, train_dataset=prompt_dataset(16), **config)


def logged(trainer, key):
    """``key``'s value at each logged training step (``None`` where the step's log lacks it)."""
    return [h.get(key) for h in trainer.state.log_history if "loss" in h]


class StepLR(transformers.TrainerCallback):
    """The LR each optimizer step used, read off the optimizer before it steps."""

    def __init__(self):
        self.lrs = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def twin_schedule(make, steps, lr):
    """The LR of each of ``steps`` optimizer steps under transformers' schedule ``make(optimizer)``, built
    independently on a twin optimizer: after ``t`` scheduler steps, the LR of step ``t + 1``."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = make(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return lrs


# ---------------------------------------------------------------------------------------------- config


def test_config_fields_and_errors(tmp_path):
    cfg = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, length_decay=True, length_decay_period="200"))
    assert cfg.length_decay_period == "200" and cfg.length_decay_period_steps == 200
    assert not cfg.length_decay_auto_period
    assert (cfg.length_decay_max_decays, cfg.length_decay_cooldown, cfg.length_surge_baseline) == (1, 0, "median")
    cfg = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, length_decay=True))
    assert cfg.length_decay_auto_period and cfg.length_decay_period_steps is None
    for kwargs, message in [
        ({"length_decay_period": "0"}, "length_decay_period='0' is not accepted"),
        ({"length_decay_period": "soon"}, "length_decay_period='soon' is not accepted"),
        ({"length_decay_start": "later"}, "length_decay_start='later' is not accepted"),
        ({"length_decay": True, "length_decay_start": "step0"}, "needs an integer length_decay_period"),
        ({"length_decay_min_lr_ratio": 2.0}, "length_decay_min_lr_ratio=2.0 is out of range"),
        ({"length_surge_ratio": 1.0}, "ratio=1.0"),
        ({"length_surge_window": 0}, "window=0"),
        ({"length_decay_max_decays": 0}, "length_decay_max_decays=0 is out of range: accepted an integer >= 1"),
        (
            {"length_decay_cooldown": -2},
            "length_decay_cooldown=-2 is out of range: accepted an integer number of steps",
        ),
        ({"length_decay": True, "length_decay_cooldown": 3}, "length_decay_cooldown=3 with length_decay_max_decays=1"),
        (
            {"length_surge_baseline": "mean"},
            "length_surge_baseline='mean' is not accepted: accepted one of ('median', ",
        ),
        ({"length_surge_ema_alpha": 0.3}, "length_surge_ema_alpha=0.3 with length_surge_baseline='median': accepted "),
        ({"length_surge_baseline": "ema", "length_surge_ema_alpha": 0.0}, "length_surge_ema_alpha=0.0 is out of range"),
        (
            {"length_decay": True, "lr_scheduler_type": "reduce_lr_on_plateau"},
            "lr_scheduler_type='reduce_lr_on_plateau'",
        ),
        ({"length_decay": True, "lr_scheduler_type": "greedy"}, "lr_scheduler_type='greedy' with length_decay=True"),
    ]:
        with pytest.raises(ValueError) as err:
            SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, **kwargs))
        assert message in str(err.value) and "\n" not in str(err.value)


def test_cli_parses_length_decay_flags(tmp_path):
    _, cfg, _, _ = make_parser().parse_args_and_config(
        args=[
            "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false",
            "--length_decay", "--length_decay_period", "auto", "--length_decay_min_lr_ratio", "0.2",
            "--length_surge_window", "5", "--length_surge_ratio", "2.0", "--length_surge_factor", "1.5",
            "--length_decay_max_decays", "3", "--length_decay_cooldown", "40", "--length_surge_baseline", "ema",
            "--length_surge_ema_alpha", "0.25", "--lr_scheduler_type", "cosine", "--warmup_steps", "20",
        ]
    )  # fmt: skip
    assert cfg.length_decay and cfg.length_decay_auto_period and cfg.length_decay_min_lr_ratio == 0.2
    assert (cfg.length_decay_max_decays, cfg.length_decay_cooldown) == (3, 40)
    detector = cfg.make_surge_detector()
    assert (detector.window, detector.ratio, detector.factor) == (5, 2.0, 1.5)
    assert (detector.baseline, detector.ema_alpha) == ("ema", 0.25)


# ---------------------------------------------------------------------------------------------- over trl's schedule


def test_the_lr_is_transformers_cosine_with_warmup_times_the_factor(tiny_model_dir, tmp_path):
    """Issue 32's "Done when": 200 steps of cosine with 20 warm-up steps, period 50 from step 0, floor 0.1. The LR of
    optimizer step t + 1 is transformers' get_cosine_schedule_with_warmup (on a twin optimizer) after t steps, times
    max(0.5^floor(t / 50), 0.1), to 1e-6 relative: as logged (learning_rate) and as the optimizer used it."""
    used = StepLR()
    trainer = make_trainer(
        tiny_model_dir, tmp_path, lr_scheduler_type="cosine", warmup_steps=20, length_decay=True,
        length_decay_period="50", length_decay_start="step0", length_decay_min_lr_ratio=0.1, max_steps=200, **SMALL,
    )  # fmt: skip
    trainer.add_callback(used)
    trainer.train()
    assert isinstance(trainer.lr_scheduler, LengthDecayLR)
    base = twin_schedule(lambda o: transformers.get_cosine_schedule_with_warmup(o, 20, 200), 200, lr=1e-2)
    expected = [b * max(0.5 ** (t // 50), 0.1) for t, b in enumerate(base)]
    assert logged(trainer, "learning_rate") == pytest.approx(expected, rel=1e-6, abs=0.0)
    assert used.lrs == pytest.approx(expected, rel=1e-6, abs=0.0)
    assert logged(trainer, "lr_base") == pytest.approx(base, rel=1e-6, abs=0.0)
    assert expected[10] == pytest.approx(5e-3) and expected[60] < expected[40] / 2 and expected[150] > 0  # the shape


def test_trl_default_linear_schedule_is_multiplied_and_constant_holds_the_lr(tiny_model_dir, tmp_path):
    """No lr_scheduler_type: trl's default, linear decay to 0, is the base; "constant" builds no base (the schedule
    before issue 32), its LR the initial one."""
    linear = make_trainer(
        tiny_model_dir,
        tmp_path / "linear",
        length_decay=True,
        length_decay_start="step0",
        length_decay_period="2",
        max_steps=6,
        **SMALL,
    )
    linear.train()
    base = twin_schedule(lambda o: transformers.get_linear_schedule_with_warmup(o, 0, 6), 6, lr=1e-2)
    assert linear.lr_scheduler.base_scheduler is not None
    assert logged(linear, "learning_rate") == pytest.approx([b * 0.5 ** (t // 2) for t, b in enumerate(base)])
    constant = make_trainer(
        tiny_model_dir,
        tmp_path / "constant",
        length_decay=True,
        length_decay_start="step0",
        length_decay_period="2",
        max_steps=6,
        lr_scheduler_type="constant",
        **SMALL,
    )
    constant.train()
    assert constant.lr_scheduler.base_scheduler is None
    assert logged(constant, "learning_rate") == [1e-2, 1e-2, 5e-3, 5e-3, 2.5e-3, 2.5e-3]
    assert logged(constant, "lr_base") == [1e-2] * 6


def test_step0_schedule_halves_per_optimizer_step_with_accumulation(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, length_decay=True, length_decay_start="step0", length_decay_period="1",
        length_decay_min_lr_ratio=0.25, max_steps=4, gradient_accumulation_steps=2, learning_rate=1e-2,
        lr_scheduler_type="constant",
    )  # fmt: skip
    trainer.train()
    assert isinstance(trainer.lr_scheduler, LengthDecayLR) and trainer.lr_scheduler.detector is None
    assert any(isinstance(cb, LengthDecayCallback) for cb in trainer.callback_handler.callbacks)
    # Algorithm 1 with period 1, floor 0.25: the LR of step t + 1 is max(0.5^t, 0.25) x 1e-2.
    assert logged(trainer, "learning_rate") == pytest.approx([1e-2, 5e-3, 2.5e-3, 2.5e-3])
    assert logged(trainer, "length_decay/factor") == [1.0, 0.5, 0.25, 0.25]
    assert logged(trainer, "length_decay/active") == [1.0] * 4
    assert logged(trainer, "length_decay/period") == [1.0] * 4
    assert logged(trainer, "length_decay/surge_step") == [None] * 4  # no detector: never known


def test_later_decays_after_a_step0_start_need_the_detector(tiny_model_dir, tmp_path):
    args = dict(length_decay=True, length_decay_start="step0", length_decay_period="5", **SMALL)
    alone = make_trainer(tiny_model_dir, tmp_path, **args)
    alone.create_optimizer_and_scheduler(num_training_steps=4)
    assert alone.lr_scheduler.detector is None
    more = make_trainer(tiny_model_dir, tmp_path, length_decay_max_decays=2, length_decay_cooldown=3, **args)
    more.create_optimizer_and_scheduler(num_training_steps=4)
    assert more.lr_scheduler.detector is not None
    assert (more.lr_scheduler.max_decays, more.lr_scheduler.cooldown) == (2, 3)


def test_detector_sees_every_generations_mean_length(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, length_decay=True, max_steps=3, lr_scheduler_type="constant")
    trainer.train()
    detector = trainer.lr_scheduler.detector
    assert [step for step, _ in detector.history] == [1, 2, 3]
    assert [length for _, length in detector.history] == pytest.approx(logged(trainer, "completions/mean_length"))
    assert logged(trainer, "length_decay/active") == [0.0] * 3  # no surge: LR held
    assert logged(trainer, "learning_rate") == pytest.approx([1e-2] * 3)


# ---------------------------------------------------------------------------------------------- the controls, resumed

#: Mean lengths injected at steps 1..18: surges at 4 (the start), 7 (within the cooldown: absorbed into the baseline),
#: 11 (the second decay), 14 (within the cooldown again) and 17 (the third decay, the cap: nothing after it counts).
LENGTHS = [4, 4, 4, 10, 10, 10, 25, 25, 25, 25, 60, 60, 60, 150, 150, 150, 400, 400]
STEPS = len(LENGTHS)
CONTROLS = dict(
    lr_scheduler_type="cosine", warmup_steps=2, max_steps=STEPS, length_decay=True, length_decay_period="4",
    length_decay_min_lr_ratio=0.1, length_decay_max_decays=3, length_decay_cooldown=4, length_surge_window=1,
    length_surge_baseline_window=2, length_surge_warmup=0, length_surge_ratio=1.5, length_surge_baseline="ema",
    length_surge_ema_alpha=0.5, save_strategy="steps", save_steps=3, **SMALL,
)  # fmt: skip
SERIES = ("learning_rate", *METRICS)


def inject_lengths(trainer):
    """Replace the real mean length of each generation by ``LENGTHS`` at its step (the step it trains)."""
    original = trainer._generate_and_score_completions

    def generate_with_injected_lengths(inputs):
        output = original(inputs)
        trainer._length_decay.pending_lengths[-1] = float(LENGTHS[trainer.state.global_step])
        return output

    trainer._generate_and_score_completions = generate_with_injected_lengths
    return trainer


@pytest.fixture(scope="module")
def controlled_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("controls")
    trainer = inject_lengths(make_trainer(tiny_model_dir, out, **CONTROLS))
    trainer.train()
    return out, trainer


def test_the_controls_decide_and_the_metrics_say_so(controlled_run):
    """Cosine with warm-up x the factor of decays at 4, 11, 17 (cooldown 4 absorbs the surge at 7 and the one at 14,
    the cap of 3 stops at 17), period 4, floor 0.1, EMA baseline; every metric of each step as defined."""
    _, trainer = controlled_run
    scheduler = trainer.lr_scheduler
    assert scheduler.decay_steps == [4, 11, 17]
    assert [surge for surge, _ in scheduler.detector.detections] == [4, 11, 17]
    assert scheduler.detector.baseline == "ema" and not scheduler.detector.armed  # the cap: no more re-arming
    base = twin_schedule(lambda o: transformers.get_cosine_schedule_with_warmup(o, 2, STEPS), STEPS, lr=1e-2)

    def factor(t):  # of optimizer step t + 1, from the definition: the clock from 4, one more halving per later decay
        if t < 4:
            return 1.0
        return max(0.5 ** ((t - 4) // 4 + sum(1 for d in (11, 17) if d <= t)), 0.1)

    assert logged(trainer, "lr_base") == base  # transformers' own schedule, exactly
    assert logged(trainer, "length_decay/factor") == [factor(t) for t in range(STEPS)]
    assert logged(trainer, "learning_rate") == [b * factor(t) for t, b in enumerate(base)]  # the product, exactly
    assert logged(trainer, "length_decay/active") == [0.0] * 4 + [1.0] * 14
    assert logged(trainer, "length_decay/num_decays") == [0.0] * 4 + [1.0] * 7 + [2.0] * 6 + [3.0]
    assert logged(trainer, "length_decay/surge_step") == [None] * 4 + [4.0] * 7 + [11.0] * 6 + [17.0]
    assert logged(trainer, "length_decay/period") == [None] * 4 + [4.0] * 14


@pytest.mark.parametrize("at", [3, 6, 12, 15])
def test_resume_reproduces_the_uninterrupted_run(controlled_run, tiny_model_dir, tmp_path, at):
    """Resumed from the trainer's own checkpoint-{at} (before the start, in a cooldown, between decays, the detector
    armed for the last one), the run logs the uninterrupted run's LR, base LR and controls at every step, and ends
    in the same scheduler state (base schedule and detector included)."""
    first_dir, first = controlled_run
    resumed = inject_lengths(make_trainer(tiny_model_dir, tmp_path, **CONTROLS))
    resumed.train(resume_from_checkpoint=str(first_dir / f"checkpoint-{at}"))
    for key in SERIES:
        assert logged(resumed, key) == logged(first, key), key
    assert len(logged(resumed, "learning_rate")) == STEPS
    assert resumed.lr_scheduler.state_dict() == first.lr_scheduler.state_dict()


def test_resume_restores_scheduler_and_detector(tiny_model_dir, tmp_path):
    common = dict(
        length_decay=True, length_decay_period="2", max_steps=4, save_strategy="steps", save_steps=2,
        length_surge_window=2, length_surge_baseline_window=3, length_surge_warmup=0,
    )  # fmt: skip
    first = make_trainer(tiny_model_dir, tmp_path / "a", **common)
    first.train()
    saved = torch.load(tmp_path / "a" / "checkpoint-2" / "scheduler.pt", weights_only=True)
    assert len(saved["detector"]["history"]) == 2 and saved["base_scheduler"] is not None  # trl's linear schedule

    second = make_trainer(tiny_model_dir, tmp_path / "b", **common)
    second.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    resumed = second.lr_scheduler
    assert resumed.last_epoch == 4 and resumed.base_scheduler.last_epoch == 4
    assert resumed.detector.history[0] == tuple(saved["detector"]["history"][0])
    assert resumed.detector.history[1] == tuple(saved["detector"]["history"][1])
    assert resumed.detector.n_updates == 4
    # Same LR decision as the uninterrupted run whenever the detector saw the same lengths.
    if list(resumed.detector.history) == list(first.lr_scheduler.detector.history):
        assert resumed.state_dict() == first.lr_scheduler.state_dict()


# ---------------------------------------------------------------------------------------------- checkpoints from before


def test_a_checkpoint_from_before_issue32_resumes_with_the_constant_schedule(tiny_model_dir, tmp_path):
    """scheduler.pt written by the trainer before length decay composed with trl's schedules (LengthDecayLR without a
    base; tests/trl_integration/grpo/data/make_length_decay_before_issue32.py) resumes with lr_scheduler_type="constant" and continues
    that run's LR sequence; with trl's default schedule it is refused in one line naming the schedule to resume with."""
    record = torch.load(BEFORE_ISSUE32, weights_only=True)
    settings = {**record["settings"], "lr_scheduler_type": "constant"}
    make_trainer(tiny_model_dir, tmp_path / "new", **settings).train()  # today's model and optimizer state at step 2
    checkpoint = tmp_path / "old" / "checkpoint-2"
    shutil.copytree(tmp_path / "new" / "checkpoint-2", checkpoint)
    torch.save(record["scheduler_at_step_2"], checkpoint / "scheduler.pt")

    resumed = make_trainer(tiny_model_dir, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(resumed, "learning_rate")[2:] == record["learning_rate"][2:] == [2.5e-3, 1.25e-3]

    # the run harness refuses it before anything loads (the plain trainer leaves resuming to transformers)
    linear = make_trainer(tiny_model_dir, tmp_path / "linear", HardenedSafeVocabGRPOTrainer, **record["settings"])
    with pytest.raises(ValueError) as err:
        linear.train(resume_from_checkpoint=str(checkpoint))
    assert str(err.value) == (
        f"resume_from_checkpoint='{checkpoint}' holds a length-decay schedule without a base schedule (written with "
        "lr_scheduler_type='constant', or before length decay composed with trl's schedules), but "
        "lr_scheduler_type='linear' builds one: resume with lr_scheduler_type='constant' (--lr_scheduler_type "
        "constant), the schedule it trained with"
    )
    assert linear.state.global_step == 0  # refused before anything was loaded


def test_a_checkpoint_over_a_schedule_does_not_resume_as_constant(controlled_run, tiny_model_dir, tmp_path):
    first_dir, _ = controlled_run
    trainer = make_trainer(
        tiny_model_dir, tmp_path, HardenedSafeVocabGRPOTrainer, **{**CONTROLS, "lr_scheduler_type": "constant"}
    )
    with pytest.raises(
        ValueError,
        match=r"holds a length-decay schedule over a base schedule, but "
        r"lr_scheduler_type='constant' builds none: resume with the lr_scheduler_type",
    ):
        trainer.train(resume_from_checkpoint=str(first_dir / "checkpoint-3"))


def test_a_scheduler_state_missing_keys_is_refused_in_one_line_naming_them(controlled_run, tiny_model_dir, tmp_path):
    first_dir, _ = controlled_run
    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(first_dir / "checkpoint-6", checkpoint)
    state = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    del state["base_lrs"], state["_last_lr"]
    torch.save(state, checkpoint / "scheduler.pt")
    trainer = inject_lengths(make_trainer(tiny_model_dir, tmp_path / "run", **CONTROLS))
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(err.value) == "state_dict lacks 'base_lrs', '_last_lr': accepted a dict from LengthDecayLR.state_dict()"


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_short_run_with_length_decay(tiny_model_dir, tmp_path):
    trainer = run(
        [
            "--model_name_or_path", tiny_model_dir, "--dataset_name", "synthetic", "--max_steps", "3",
            "--output_dir", str(tmp_path / "run"), "--length_decay", "--length_decay_start", "step0",
            "--length_decay_period", "1", "--learning_rate", "0.01", "--lr_scheduler_type", "cosine",
            "--warmup_steps", "1", "--length_decay_max_decays", "2", "--length_decay_cooldown", "1",
            "--length_surge_baseline", "ema",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
            "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--use_cpu", "true",
            "--bf16", "false", "--no_gradient_checkpointing", "--disable_tqdm", "true",
        ]
    )  # fmt: skip
    assert isinstance(trainer.lr_scheduler, LengthDecayLR) and trainer.lr_scheduler.detector.baseline == "ema"
    base = twin_schedule(lambda o: transformers.get_cosine_schedule_with_warmup(o, 1, 3), 3, lr=1e-2)
    assert logged(trainer, "learning_rate") == pytest.approx([b * 0.5**t for t, b in enumerate(base)])
    assert not any(math.isnan(v) for v in logged(trainer, "length_decay/factor"))
