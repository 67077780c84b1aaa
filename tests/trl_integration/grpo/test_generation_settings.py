"""Generation settings that reshape the sampled distribution (issue 58): one start line per setting the trainer's sets
cannot follow, naming it and the setting that makes it exact; none for a setting the sets reproduce, one that acts
after the rule, one with no effect, or one replay covers.

Real trainers on the bundled tiny model (the ``generate`` path: building one takes a second, and the start lines
come from the trainer, not from the function alone); the vLLM path's lines from its config (building an engine is
``test_generation_settings_vllm.py``'s).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from trl_integration import SafeVocabGRPOTrainer
from trl_integration.demo import arithmetic_reward, make_dataset, tiny_grpo_config, tiny_model_path
from trl_integration.grpo.generation_settings import (
    GENERATE_RESHAPING,
    VLLM_ONLY,
    VLLM_RESHAPING,
    engine_sets_only,
    warn_reshaping_settings,
)
from trl_integration.grpo.replay import SupportReplay
from trl_integration.grpo.structured_outputs import grammar_active

DOCS = "docs/trl.md#generation-settings"
#: One line (about 280 characters: the setting as written, what happens, the fix, the docs' anchor).
MAX_LINE = 310

#: The vLLM settings that reshape the distribution before its truncation, each with a value that turns it on
#: (bundled vocabulary: "1" is id 5, "<eos>" id 2).
VLLM_ON = {
    "repetition_penalty": 1.3,
    "presence_penalty": 1.0,
    "frequency_penalty": 1.0,
    "logit_bias": {5: -100.0},
    "bad_words": ["1"],
    "min_tokens": 2,
    "allowed_token_ids": [2, 4, 5, 6],
    "thinking_token_budget": 8,
}
#: The same for the generate path (transformers' processors that run before its sampling warpers).
GENERATE_ON = {
    "repetition_penalty": 1.3,
    "encoder_repetition_penalty": 1.3,
    "no_repeat_ngram_size": 2,
    "encoder_no_repeat_ngram_size": 2,
    "bad_words_ids": [[5]],
    "min_length": 4,
    "min_new_tokens": 2,
    "sequence_bias": {(5,): 2.0},
    "suppress_tokens": [5],
    "begin_suppress_tokens": [5],
    "forced_eos_token_id": 2,
    "exponential_decay_length_penalty": (2, 1.5),
    "guidance_scale": 1.5,
}
#: vLLM keys that trl's generate path ignores.
VLLM_ONLY_KEYS = ("presence_penalty", "frequency_penalty", "logit_bias", "bad_words", "min_tokens", "allowed_token_ids",
                  "thinking_token_budget")  # fmt: skip

#: Settings the trainer's sets follow (composed into the rule), that act after the rule, or that change no
#: distribution: no start line on either path.
SILENT = {
    "temperature": 0.7,
    "top_k": 10,
    "top_p": 0.9,
    "min_p": 0.05,
    "typical_p": 0.9,
    "epsilon_cutoff": 3e-4,
    "max_new_tokens": 6,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
}


def _config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, safe_vocab_rule="min_p=0.1", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    settings.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the config's own notices (e.g. generation_kwargs' temperature)
        return tiny_grpo_config(**settings)


def _start_lines(tmp_path, **overrides) -> list[str]:
    """The generation-settings lines a trainer on the generate path prints while it is built."""
    args = _config(tmp_path, **overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SafeVocabGRPOTrainer(
            model=str(tiny_model_path()), reward_funcs=arithmetic_reward, args=args,
            train_dataset=make_dataset(16, seed=0, split="train"),
        )  # fmt: skip
    return [str(w.message) for w in caught if DOCS in str(w.message)]


def _lines(args, replay=None) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = warn_reshaping_settings(args, replay)
    assert [str(w.message) for w in caught if DOCS in str(w.message)] == returned
    return returned


def test_the_tables_are_the_tested_ones():
    assert set(VLLM_RESHAPING) == set(VLLM_ON) and set(GENERATE_RESHAPING) == set(GENERATE_ON)
    assert set(VLLM_ONLY) == set(VLLM_ONLY_KEYS)


@pytest.mark.parametrize("key", sorted(GENERATE_ON))
def test_a_reshaping_generate_setting_prints_one_start_line_naming_it(tmp_path, key):
    lines = _start_lines(tmp_path, generation_kwargs={key: GENERATE_ON[key]})
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"generation_kwargs[{key!r}]=")
    assert "reshapes the generate path's distribution" in lines[0]
    assert "use_vllm=True with safe_vocab_support='replay'" in lines[0] and len(lines[0]) <= MAX_LINE


def test_the_repetition_penalty_flag_prints_its_own_name(tmp_path):
    lines = _start_lines(tmp_path, repetition_penalty=1.3)
    assert len(lines) == 1 and lines[0].startswith("repetition_penalty=1.3 reshapes")
    # generation_kwargs override the flag, as in trl: one line, the override's
    lines = _start_lines(tmp_path, repetition_penalty=1.3, generation_kwargs={"repetition_penalty": 1.1})
    assert len(lines) == 1 and lines[0].startswith("generation_kwargs['repetition_penalty']=1.1 reshapes")


def test_reproduced_after_the_rule_and_neutral_settings_print_nothing(tmp_path):
    assert _start_lines(tmp_path, generation_kwargs=dict(SILENT)) == []
    assert _lines(_config(tmp_path, use_vllm=True, generation_kwargs={"temperature": 0.7, "top_p": 0.9, "seed": 1,
                                                                       "stop": ["."], "min_tokens": 0})) == []  # fmt: skip


def test_rule_none_prunes_nothing_and_prints_nothing(tmp_path):
    assert _start_lines(tmp_path, safe_vocab_rule="none", generation_kwargs={"no_repeat_ngram_size": 2}) == []


#: vLLM settings refused at start: trl's engine lacks what they need (thinking_token_budget: a reasoning_config).
REFUSED_ON_VLLM = ("thinking_token_budget",)


@pytest.mark.parametrize("key", sorted(set(VLLM_ON) - set(REFUSED_ON_VLLM)))
def test_a_reshaping_vllm_setting_prints_one_line_unless_replayed(tmp_path, key):
    args = _config(tmp_path, use_vllm=True, generation_kwargs={key: VLLM_ON[key]})
    lines = _lines(args)
    assert len(lines) == 1 and lines[0].startswith(f"generation_kwargs[{key!r}]=")
    assert "fix: safe_vocab_support='replay'" in lines[0] and len(lines[0]) <= MAX_LINE
    assert engine_sets_only(args)  # replayed, the engine's set is the whole safe set
    assert _lines(args, replay=SupportReplay()) == []
    cannot = SupportReplay()
    cannot.fallback_reason = "no top_k"
    lines = _lines(args, replay=cannot)
    assert len(lines) == 1 and "cannot read this engine's sets" in lines[0]


@pytest.mark.parametrize("key", REFUSED_ON_VLLM)
def test_a_setting_trls_engine_cannot_honour_is_refused_at_start_in_one_line(tmp_path, key):
    """vLLM refuses thinking_token_budget at the first rollout (no reasoning_config in trl's engine): refused when the
    config is built instead (the command line's early checks: before the model or the engine loads), replayed or not,
    in one line naming the setting; the generate path, which ignores the key, is not refused."""
    pattern = rf"^generation_kwargs\[{key!r}\]=\S+ needs vLLM's reasoning_config"
    for support in ("rule", "replay"):
        with pytest.raises(ValueError, match=pattern) as err:
            tiny_grpo_config(output_dir=str(tmp_path), use_vllm=True, safe_vocab_rule="top_k=20",
                             safe_vocab_support=support, generation_kwargs={key: VLLM_ON[key]})  # fmt: skip
        assert "\n" not in str(err.value) and len(str(err.value)) <= MAX_LINE
    args = _config(tmp_path, generation_kwargs={key: VLLM_ON[key]})  # generate path: named as ignored, not refused
    with pytest.raises(ValueError, match=pattern):
        warn_reshaping_settings(SimpleNamespace(**{**vars(args), "use_vllm": True}), None)


@pytest.mark.parametrize("key", VLLM_ONLY_KEYS)
def test_a_vllm_only_key_on_the_generate_path_is_named_as_ignored(tmp_path, key):
    lines = _start_lines(tmp_path, generation_kwargs={key: VLLM_ON[key]})
    assert len(lines) == 1 and lines[0].startswith(f"generation_kwargs[{key!r}]=")
    assert "trl's generate path ignores" in lines[0] and len(lines[0]) <= MAX_LINE


def test_a_rollout_func_samples_itself_and_gets_no_line(tmp_path):
    args = _config(tmp_path, use_vllm=True, generation_kwargs={"presence_penalty": 1.0})
    assert warn_reshaping_settings(args, None, rollout_func=lambda prompts, trainer: {}) == []


def test_the_generate_path_keeps_the_rule_intersection_and_grammar_kwargs_count(tmp_path):
    assert not engine_sets_only(_config(tmp_path, generation_kwargs={"no_repeat_ngram_size": 2}))
    assert not engine_sets_only(_config(tmp_path, use_vllm=True))
    grammar = _config(tmp_path, use_vllm=True, generation_kwargs={"structured_outputs": {"regex": "[0-9]+"}})
    assert grammar_active(grammar) and engine_sets_only(grammar)
    from trl_integration.grpo.structured_outputs import warn_grammar_without_replay

    with pytest.warns(UserWarning, match=r"^generation_kwargs\['structured_outputs'\]=\{'regex': '\[0-9\]\+'\} with"):
        warn_grammar_without_replay(grammar, replay=False)
