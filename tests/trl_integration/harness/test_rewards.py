"""Rewards through the Python API (issue 28, D11): an infinite reward or a non-number is refused, naming the reward
function (and, for an infinite reward, the step); missing rewards (None/NaN) keep trl's behaviour; what trl reads from
a reward function (its name, whether it is async) is unchanged. Real trainers on the tiny model, nothing faked."""

from __future__ import annotations

import functools
import logging
import math

import numpy as np
import pytest
import torch
import transformers
import trl_helpers
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_callable_name
from trl_helpers import build_tokenizer, grpo_kwargs, prompt_dataset

from trl_integration import HardenedSafeVocabGRPOTrainer, SafeVocabGRPOConfig
from trl_integration.commands import grpo


def _at_step(completions, step: int, value, finite: float = 0.5):
    """``finite`` for every completion, ``value`` for the second one (from ``step`` on)."""
    rewards = [finite + 0.1 * i for i in range(len(completions))]
    if step >= 1:
        rewards[1] = value
    return rewards


def inf_at_step_1(completions, trainer_state, **kwargs):
    return _at_step(completions, trainer_state.global_step, math.inf)


def minus_inf_at_step_1(completions, trainer_state, **kwargs):
    return _at_step(completions, trainer_state.global_step, -math.inf)


def make_trainer(model_dir, tmp_path, reward_funcs, trainer_cls=HardenedSafeVocabGRPOTrainer, config_cls=SafeVocabGRPOConfig,
                 **kwargs):  # fmt: skip
    return trl_helpers.make_trainer(model_dir, tmp_path, trainer_cls, config_cls, reward_funcs=reward_funcs,
                                    trainer_kwargs=kwargs, report_to="none", save_strategy="no")  # fmt: skip


@pytest.mark.parametrize(("func", "shown"), [(inf_at_step_1, "inf"), (minus_inf_at_step_1, "-inf")])
def test_an_infinite_reward_is_refused_naming_the_function_and_the_step(tiny_model_dir, tmp_path, func, shown):
    trainer = make_trainer(tiny_model_dir, tmp_path, func)
    with pytest.raises(ValueError) as info:
        trainer.train()
    message = str(info.value)
    expected = f"reward function '{func.__name__}' returned {shown} for completion 1 of 4 at global_step=1: "
    assert message.startswith(expected)
    assert "\n" not in message
    assert trainer.state.global_step == 1  # the first step trained; the second was refused before its loss


def strings(completions, **kwargs):
    return ["1.0"] * len(completions)


def one_float(completions, **kwargs):
    return 0.5


def nested(completions, **kwargs):
    return [0.5] * (len(completions) - 1) + [[0.5, 0.5]]


def no_return(completions, **kwargs):
    pass


@pytest.mark.parametrize(
    ("func", "shown"),
    [
        (strings, "str '1.0' for completion 0 of 4"),
        (nested, "list [0.5, 0.5] for completion 3 of 4"),
        (one_float, "float 0.5"),
        (no_return, "NoneType None"),
    ],
)
def test_a_reward_that_is_not_a_number_is_named(tiny_model_dir, tmp_path, func, shown):
    trainer = make_trainer(tiny_model_dir, tmp_path, func)
    with pytest.raises(TypeError) as info:
        trainer.train()
    assert str(info.value) == (
        f"reward function '{func.__name__}' returned {shown} at global_step=0: accepted a list of one float (or None "
        "for no reward) per completion"
    )


# --- what trl reads from a reward function is kept: the name of its metrics, sync or async ------------------------


def scaled(completions, scale, **kwargs):
    return [scale * len(c) for c in completions]


async def async_scaled(completions, scale=0.1, **kwargs):
    return [scale * len(c) for c in completions]


class LengthReward:
    """A callable object (trl names it after its class)."""

    def __call__(self, completions, **kwargs):
        return [0.1 * len(c) for c in completions]


class AsyncLengthReward:
    async def __call__(self, completions, **kwargs):
        return [0.1 * len(c) for c in completions]


class AsyncInfReward:
    async def __call__(self, completions, **kwargs):
        return [math.inf] * len(completions)


def length(completions, **kwargs):
    return [0.1 * len(c) for c in completions]


def mixed_types(completions, **kwargs):
    """What trl's ``torch.tensor(..., dtype=float32)`` takes besides floats: numpy scalars, 0-dim tensors, bools,
    ints."""
    return [np.float32(0.5), torch.tensor(0.25), True, 1][: len(completions)]


FORMS = {
    "function": length,
    "partial": functools.partial(scaled, scale=0.1),
    "async function": async_scaled,
    "partial of async": functools.partial(async_scaled, scale=0.2),
    "callable object": LengthReward(),
    "async callable object": AsyncLengthReward(),
    "mixed types": mixed_types,
}


@pytest.mark.parametrize("form", list(FORMS))
def test_reward_forms_train_and_log_under_trls_own_name(tiny_model_dir, tmp_path, form):
    """Each form trains as under stock trl and logs ``rewards/<name>/mean`` under the name stock trl gives it."""
    func = FORMS[form]
    stock = make_trainer(tiny_model_dir, tmp_path / "stock", func, GRPOTrainer, GRPOConfig)
    ours = make_trainer(tiny_model_dir, tmp_path / "ours", func)
    assert ours.reward_func_names == stock.reward_func_names
    assert get_callable_name(ours.reward_funcs[0]) == stock.reward_func_names[0]  # should trl read the name again
    assert ours._has_async_funcs == stock._has_async_funcs  # trl's own decision, taken before the wrapping
    ours.args.max_steps = 1
    ours.train()
    name = stock.reward_func_names[0]
    means = [h[f"rewards/{name}/mean"] for h in ours.state.log_history if f"rewards/{name}/mean" in h]
    assert len(means) == 1 and math.isfinite(means[0])


def test_an_async_reward_is_checked_too(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, AsyncInfReward())
    with pytest.raises(ValueError, match=r"^reward function 'AsyncInfReward' returned inf for completion 0 of 4 at "
                                         r"global_step=0: "):  # fmt: skip
        trainer.train()


def _reward_model(tokenizer, scale: float):
    """A tiny sequence-classification Llama whose score is ``scale`` times hidden unit 0 (inf: an infinite score)."""
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.weight[0, 0] = scale
    return model


@pytest.mark.parametrize("scale", [1.0, math.inf])
def test_a_reward_model_with_an_infinite_score_is_refused(tiny_model_dir, tmp_path, scale):
    tokenizer = build_tokenizer()
    trainer = make_trainer(
        tiny_model_dir, tmp_path, _reward_model(tokenizer, scale), reward_processing_classes=tokenizer
    )
    trainer.args.max_steps = 1
    if math.isfinite(scale):
        trainer.train()
        assert trainer.state.global_step == 1
        return
    pattern = r"^reward model LlamaForSequenceClassification returned -?inf for completion 0 of 4 at global_step=0: "
    with pytest.raises(ValueError, match=pattern):
        trainer.train()


# --- missing rewards keep trl's behaviour in the API; the command stops -------------------------------------------


def all_none(completions, **kwargs):
    return [None] * len(completions)


def all_nan(completions, **kwargs):
    return [math.nan] * len(completions)


@pytest.mark.parametrize("func", [all_none, all_nan])
def test_missing_rewards_keep_trls_warning_and_training_goes_on(tiny_model_dir, tmp_path, func, caplog):
    trainer = make_trainer(tiny_model_dir, tmp_path, func)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 2
    assert "All reward functions returned None" in caplog.text


def test_the_command_names_an_infinite_reward(tmp_path, capsys):
    from trl_integration.demo.model import tiny_model_path

    argv = [
        "--model_name_or_path", str(tiny_model_path()), "--dataset_name", "synthetic",
        "--reward_funcs", f"{__name__}.inf_at_step_1", "--max_steps", "2", "--per_device_train_batch_size", "4",
        "--num_generations", "4", "--max_completion_length", "4", "--report_to", "none", "--save_strategy", "no",
        "--disable_tqdm", "true", "--output_dir", str(tmp_path),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    assert exit_info.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("safevocab-grpo: error: reward function 'inf_at_step_1' returned inf for completion 1 of 4 "
                           "at global_step=1: ")  # fmt: skip


def fine(completions, **kwargs):
    return [0.5] * len(completions)


def divides_by_zero(completions, **kwargs):
    return [1.0 / 0.0 for _ in completions]


def test_the_command_names_the_reward_function_that_raised(tmp_path, capsys):
    """Issue 57, C3: with several reward functions, the one that raised is named in the command's one line (before:
    ``ZeroDivisionError: float division by zero``, naming none)."""
    from trl_integration.demo.model import tiny_model_path

    argv = [
        "--model_name_or_path", str(tiny_model_path()), "--dataset_name", "synthetic",
        "--reward_funcs", f"{__name__}.fine", f"{__name__}.divides_by_zero", "--max_steps", "1",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4",
        "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--output_dir", str(tmp_path),
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        grpo.main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("safevocab-grpo: error: reward function 'divides_by_zero' raised ZeroDivisionError: float division "
                    "by zero at global_step=0 (--debug shows the traceback)")  # fmt: skip


# --- issue 37, N5/N5b: a dict or a set, and rewards large enough to overflow trl's float32 group statistics ---------


def as_dict(completions, **kwargs):
    return {i: 0.1 * len(c) for i, c in enumerate(completions)}


def as_set(completions, **kwargs):
    return {0.1 * i for i in range(len(completions))}


@pytest.mark.parametrize(
    ("func", "kind"),
    [
        (as_dict, "a dict is not: trl would train on its keys"),
        (as_set, "a set is not: trl would train on its elements in hash order"),
    ],
)
def test_a_dict_or_a_set_of_rewards_is_refused(tiny_model_dir, tmp_path, func, kind):
    """Old code: trained on the dict's keys 0..3 (reward 1.5 = mean(0..3)) or the set's elements in hash order."""
    trainer = make_trainer(tiny_model_dir, tmp_path, func)
    with pytest.raises(TypeError) as info:
        trainer.train()
    message = str(info.value)
    assert message.startswith(f"reward function '{func.__name__}' returned {type(func([''])).__name__} ")
    assert message.endswith(f"at global_step=0: accepted a list of one float (or None for no reward) per completion, "
                            f"in the completions' order ({kind})")  # fmt: skip
    assert "\n" not in message and trainer.state.global_step == 0


def huge(completions, **kwargs):
    """Finite float32 rewards: the group mean of 4 overflows to inf (the audit's reproducer, >~ 4e37)."""
    return [1e38 if i % 2 else 0.0 for i in range(len(completions))]


def test_rewards_that_overflow_the_group_statistics_are_refused(tiny_model_dir, tmp_path):
    """Old code: mean/std inf, every advantage 0, loss 0, exit 0 (the run trained nothing)."""
    trainer = make_trainer(tiny_model_dir, tmp_path, huge)
    with pytest.raises(ValueError) as info:
        trainer.train()
    assert str(info.value) == (
        "reward function 'huge' returned 1e+38 for completion 1 of 4 at global_step=0: accepted rewards of magnitude "
        "<= 4.61e+18 (with these reward weights); larger ones overflow trl's float32 group mean/std and the group "
        "trains nothing: rescale it"
    )


def test_the_largest_accepted_reward_keeps_the_statistics_finite():
    """reward_limit is what trl's own statistics take: rewards at +-limit give finite advantages, in float32."""
    from trl.trainer.utils import nanstd

    from trl_integration.harness.rewards import reward_limit

    for rows in (2, 4, 16, 1024):
        limit = reward_limit(rows)
        rewards = torch.full((rows,), limit, dtype=torch.float32)
        rewards[::2] = -limit
        advantages = (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + 1e-4)
        assert bool(torch.isfinite(advantages).all()) and bool((advantages != 0).any()), rows
        assert reward_limit(rows, weight_sum=2.0) == limit / 2


def test_the_reward_checks_can_be_switched_off(tiny_model_dir, tmp_path):
    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, report_to="none", save_strategy="no",
                                             safe_vocab_check_rewards=False))  # fmt: skip
    trainer = HardenedSafeVocabGRPOTrainer(model=tiny_model_dir, reward_funcs=as_dict, args=args,
                                   train_dataset=prompt_dataset(), processing_class=build_tokenizer())  # fmt: skip
    assert trainer.reward_funcs == [as_dict]  # trl's own behaviour: the function is called as it is
