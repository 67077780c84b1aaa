"""SafeVocabGRPOConfig reads Python values as the command line reads them (issue 57, C1/C2/C4): a boolean string is
parsed, a sampler setting, count, reward weight or sign out of range is refused in one line naming the field."""

from __future__ import annotations

import math

import pytest
from trl_helpers import grpo_kwargs

from trl_integration import SafeVocabGRPOConfig


def config(tmp_path, **fields):
    return SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, **fields))


@pytest.mark.parametrize("text, expected", [("false", False), ("False", False), ("no", False), ("0", False),
                                            ("true", True), ("YES", True), ("1", True)])  # fmt: skip
def test_boolean_strings_are_parsed_not_read_by_truthiness(tmp_path, text, expected):
    made = config(tmp_path, safe_vocab_in_sampler=text, length_decay=text, log_entropy_metrics=text,
                  use_cpu=True, mask_truncated_completions=text)  # fmt: skip
    assert made.safe_vocab_in_sampler is expected and made.length_decay is expected
    assert made.log_entropy_metrics is expected and made.mask_truncated_completions is expected  # a trl field too


def test_an_optional_boolean_keeps_none_and_a_non_boolean_is_refused(tmp_path):
    assert config(tmp_path, rollout_logprobs=None).rollout_logprobs is not None  # resolved by the config itself
    with pytest.raises(TypeError, match=r"^length_decay='maybe' is not accepted: accepted True, False or one of"):
        config(tmp_path, length_decay="maybe")
    with pytest.raises(TypeError, match=r"^safe_vocab_check_rewards=1 is not accepted"):
        config(tmp_path, safe_vocab_check_rewards=1)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(min_p=math.nan), r"^min_p=nan is out of range: accepted None or a number in \[0, 1\]"),
        (dict(top_p=1.5), r"^top_p=1.5 is out of range: accepted a number in \(0, 1\]"),
        (dict(top_k=2.5), r"^top_k=2.5 is not accepted: accepted an integer >= -1"),
        (dict(top_k=True), r"^top_k=True is not accepted"),
        (dict(temperature=math.inf), r"^temperature=inf is out of range: accepted a finite number > 0"),
        (dict(generation_kwargs={"top_p": 0.0}), r"^generation_kwargs.top_p=0.0 is out of range"),
        (dict(reward_weights=[1.0, math.nan]), r"^reward_weights\[1\]=nan is out of range: accepted a finite number"),
        (dict(num_iterations=0), r"^num_iterations=0 is out of range: accepted an integer >= 1"),
        (dict(per_device_train_batch_size=0), r"^per_device_train_batch_size=0 is out of range"),
        (dict(gradient_accumulation_steps=0), r"^gradient_accumulation_steps=0 is out of range"),
        (dict(steps_per_generation=0), r"^steps_per_generation=0 is out of range"),
        (dict(num_generations=0), r"^num_generations=0 is out of range: accepted an integer >= 2"),
        (dict(beta=-0.1), r"^beta=-0.1 is out of range: accepted a number >= 0 \(a negative KL coefficient"),
        (dict(epsilon=-0.2), r"^epsilon=-0.2 is out of range: accepted a number >= 0"),
    ],
)
def test_values_trl_leaves_unchecked_are_refused_in_one_line(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message) as err:
        config(tmp_path, **fields)
    assert "\n" not in str(err.value)
