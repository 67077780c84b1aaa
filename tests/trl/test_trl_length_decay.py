"""Length-decay LR schedule wired into SafeVocabGRPOTrainer: config, scheduler creation, callback, resume, CLI."""

from __future__ import annotations

import pytest
import torch
from trl_helpers import grpo_kwargs, prompt_dataset, vowel_reward

from safevocab.schedulers import LengthDecayLR
from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration.commands.grpo import make_parser, run
from trl_integration.grpo.length_decay import LengthDecayCallback


def make_trainer(model_dir, tmp_path, **config):
    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, **config))
    return SafeVocabGRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=args, train_dataset=prompt_dataset(16))


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# ---------------------------------------------------------------------------------------------- config


def test_config_fields_and_errors(tmp_path):
    cfg = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, length_decay=True, length_decay_period="200"))
    assert cfg.length_decay_period == "200" and cfg.length_decay_period_steps == 200
    assert not cfg.length_decay_auto_period
    cfg = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, length_decay=True))
    assert cfg.length_decay_auto_period and cfg.length_decay_period_steps is None
    for kwargs, fragment in [
        ({"length_decay_period": "0"}, "length_decay_period='0'"),
        ({"length_decay_period": "soon"}, "length_decay_period='soon'"),
        ({"length_decay_start": "later"}, "length_decay_start='later'"),
        ({"length_decay": True, "length_decay_start": "step0"}, "needs an integer length_decay_period"),
        ({"length_decay_min_lr_ratio": 2.0}, "length_decay_min_lr_ratio=2.0"),
        ({"length_surge_ratio": 1.0}, "ratio=1.0"),
        ({"length_surge_window": 0}, "window=0"),
    ]:
        with pytest.raises(ValueError) as err:
            SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, **kwargs))
        assert fragment in str(err.value)


def test_cli_parses_length_decay_flags(tmp_path):
    _, cfg, _, _ = make_parser().parse_args_and_config(
        args=[
            "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false",
            "--length_decay", "--length_decay_period", "auto", "--length_decay_min_lr_ratio", "0.2",
            "--length_surge_window", "5", "--length_surge_ratio", "2.0", "--length_surge_factor", "1.5",
        ]
    )  # fmt: skip
    assert cfg.length_decay and cfg.length_decay_auto_period and cfg.length_decay_min_lr_ratio == 0.2
    detector = cfg.make_surge_detector()
    assert (detector.window, detector.ratio, detector.factor) == (5, 2.0, 1.5)


# ---------------------------------------------------------------------------------------------- trainer


def test_step0_schedule_halves_per_optimizer_step_with_accumulation(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, length_decay=True, length_decay_start="step0", length_decay_period="1",
        length_decay_min_lr_ratio=0.25, max_steps=4, gradient_accumulation_steps=2, learning_rate=1e-2,
    )  # fmt: skip
    trainer.train()
    assert isinstance(trainer.lr_scheduler, LengthDecayLR)
    assert any(isinstance(cb, LengthDecayCallback) for cb in trainer.callback_handler.callbacks)
    # Algorithm 1 with period 1, floor 0.25: LR after step t is max(0.5^t, 0.25) x 1e-2.
    assert logged(trainer, "lr") == pytest.approx([5e-3, 2.5e-3, 2.5e-3, 2.5e-3])
    assert logged(trainer, "safevocab/lr_decay_active") == [1.0] * 4
    assert logged(trainer, "safevocab/length_decay_period") == [1.0] * 4


def test_detector_sees_every_generations_mean_length(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, length_decay=True, max_steps=3)
    trainer.train()
    detector = trainer.lr_scheduler.detector
    assert [step for step, _ in detector.history] == [1, 2, 3]
    assert [length for _, length in detector.history] == pytest.approx(logged(trainer, "completions/mean_length"))
    assert logged(trainer, "safevocab/lr_decay_active") == [0.0] * 3  # no surge: LR held
    assert logged(trainer, "lr") == pytest.approx([1e-2] * 3)


def test_surge_triggers_decay_with_auto_period(tiny_model_dir, tmp_path):
    """A length stream with a surge at step 3 (injected through the trainer's queue) triggers the decay."""
    trainer = make_trainer(
        tiny_model_dir, tmp_path, length_decay=True, max_steps=6, length_surge_window=1,
        length_surge_baseline_window=2, length_surge_warmup=0, length_surge_ratio=1.5, length_surge_factor=1.0,
    )  # fmt: skip
    lengths = iter([4.0, 4.0, 4.0, 12.0, 12.0, 12.0])
    original = trainer._generate_and_score_completions

    def generate_with_fake_lengths(inputs):
        output = original(inputs)
        trainer.pending_mean_lengths[-1] = next(lengths)  # replace the real mean length of this generation
        return output

    trainer._generate_and_score_completions = generate_with_fake_lengths
    trainer.train()
    detector = trainer.lr_scheduler.detector
    assert detector.surge_step == 4 and detector.detected_at == 4
    assert trainer.lr_scheduler.decay_period == 4  # round(1.0 x 4)
    assert logged(trainer, "safevocab/lr_decay_active") == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert logged(trainer, "safevocab/length_surge_step") == [4.0, 4.0, 4.0]
    assert logged(trainer, "lr") == pytest.approx([1e-2] * 6)  # the first halving is due at step 4 + 4


def test_resume_restores_scheduler_and_detector(tiny_model_dir, tmp_path):
    common = dict(
        length_decay=True, length_decay_period="2", max_steps=4, save_strategy="steps", save_steps=2,
        length_surge_window=2, length_surge_baseline_window=3, length_surge_warmup=0,
    )  # fmt: skip
    first = make_trainer(tiny_model_dir, tmp_path / "a", **common)
    first.train()
    saved = torch.load(tmp_path / "a" / "checkpoint-2" / "scheduler.pt", weights_only=True)
    assert len(saved["detector"]["history"]) == 2

    second = make_trainer(tiny_model_dir, tmp_path / "b", **common)
    second.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    resumed = second.lr_scheduler
    assert resumed.last_epoch == 4
    assert resumed.detector.history[0] == tuple(saved["detector"]["history"][0])
    assert resumed.detector.history[1] == tuple(saved["detector"]["history"][1])
    assert resumed.detector.n_updates == 4
    # Same LR decision as the uninterrupted run whenever the detector saw the same lengths.
    if list(resumed.detector.history) == list(first.lr_scheduler.detector.history):
        assert resumed.state_dict() == first.lr_scheduler.state_dict()


def test_cli_short_run_with_length_decay(tiny_model_dir, tmp_path):
    trainer = run(
        [
            "--model_name_or_path", tiny_model_dir, "--dataset_name", "synthetic", "--max_steps", "2",
            "--output_dir", str(tmp_path / "run"), "--length_decay", "--length_decay_start", "step0",
            "--length_decay_period", "1", "--learning_rate", "0.01",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
            "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--use_cpu", "true",
            "--bf16", "false", "--no_gradient_checkpointing", "--disable_tqdm", "true",
        ]
    )  # fmt: skip
    assert isinstance(trainer.lr_scheduler, LengthDecayLR)
    assert logged(trainer, "lr") == pytest.approx([5e-3, 2.5e-3])
