"""Conformance: every trl GRPO feature trains under SafeVocabGRPOTrainer as under stock trl (issue 14).

Each test builds the trainers the way a trl user would (local tiny models and tokenizers, nothing downloaded) and
trains two steps three times: stock ``trl.GRPOTrainer``, ``SafeVocabGRPOTrainer`` with the default rule, and
``SafeVocabGRPOTrainer`` with rule ``"none"``. All three must train; the rule-``"none"`` run must agree with stock trl
(same logged loss and rewards, same weights) wherever its effective rule is ``"none"``. The features mirror trl
1.16's own GRPO tests (tools, environments, ``rollout_func``, loss types, ...); where trl's tests replace
``generate`` by a fake, so do these, and the rollout log-prob recorder must degrade instead of crashing.

The list of covered features is in docs/trl.md ("Conformance with trl").
"""

from __future__ import annotations

import logging
import math
import warnings
from unittest.mock import patch

import pytest
import torch
from chat_helpers import build_chat_tokenizer, encode
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from trl_helpers import build_model, build_tokenizer, grpo_kwargs, prompt_dataset, vowel_reward

from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer

#: (name, trainer class, config class, extra config) of the three runs of every feature.
VARIANTS = [
    ("stock", GRPOTrainer, GRPOConfig, {}),
    ("safevocab", SafeVocabGRPOTrainer, SafeVocabGRPOConfig, {}),
    ("none", SafeVocabGRPOTrainer, SafeVocabGRPOConfig, {"safe_vocab_rule": "none"}),
]

FALLBACK = "rollout log-probabilities could not be recorded"
FRAC = "safevocab/rollout_logprobs_frac"


# ----------------------------------------------------------------------------------------------------------------
# models, data and the run harness


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A tiny Llama with the Qwen3-style tool-calling chat tokenizer (long context: tool prompts are ~800 chars)."""
    path = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = build_chat_tokenizer()
    model = build_model(tokenizer, head_scale=1.0, max_position_embeddings=2048)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_multiply_tool(a: int, b: int) -> int:
    """
    Asynchronously multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def chat_dataset(n_rows: int = 8) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"What is {i} times 4?"}] for i in range(n_rows)]}
    )


def chat_reward(completions, **kwargs):
    """Length of the whole conversation turn: differs between tool-calling and plain completions."""
    return [float(sum(len(str(m.get("content", ""))) for m in c)) / 10.0 for c in completions]


def fake_generate_from(turns, pad_id: int):
    """A ``generate`` replacement (as trl's tests use) that returns the prompt followed by fixed completions.

    ``turns(batch_size)`` gives the completion id lists of a call, right-padded here with ``pad_id``."""

    def fake_generate(input_ids, **kwargs):
        rows = turns(input_ids.shape[0])
        width = max(len(r) for r in rows)
        completion = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=input_ids.device)
        return torch.cat([input_ids, completion], dim=-1)

    return fake_generate


def train_variant(
    variant,
    model,
    tmp_path,
    *,
    processing_class,
    train_dataset=None,
    reward_funcs=vowel_reward,
    fake_generate=None,
    patch_class_generate=False,
    trainer_kwargs=None,
    **config,
):
    """Build the trainer of ``variant`` as a trl user would and train it (two steps unless ``max_steps`` is set).

    Returns ``(trainer, initial parameters, fallback warnings)``."""
    name, trainer_cls, config_cls, extra = variant
    args = config_cls(**grpo_kwargs(tmp_path / name, **{**config, **extra}))
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        processing_class=processing_class,
        **(trainer_kwargs or {}),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fake_generate is None:
            trainer.train()
        elif patch_class_generate:
            with patch("transformers.generation.utils.GenerationMixin.generate", side_effect=fake_generate):
                trainer.train()
        else:
            with patch.object(trainer.model, "generate", side_effect=fake_generate):
                trainer.train()
    fallbacks = [str(w.message) for w in caught if FALLBACK in str(w.message)]
    return trainer, before, fallbacks


def steps(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_trained(trainer, before, n_steps: int = 2) -> None:
    """The run logged ``n_steps`` finite losses and moved the weights."""
    rows = steps(trainer)
    assert len(rows) == n_steps
    assert all(math.isfinite(h["loss"]) for h in rows), [h["loss"] for h in rows]
    assert trainer.state.log_history[-1]["train_loss"] is not None
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert moved, "no parameter changed"


def max_relative_weight_diff(a, b) -> float:
    """``max over tensors of max|p - q| / max|p|`` between two models' trainable parameters."""
    worst = 0.0
    for (_name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        scale = p.detach().abs().max().clamp(min=1e-12)
        worst = max(worst, float((p.detach() - q.detach()).abs().max() / scale))
    return worst


AGREE_KEYS = ("loss", "reward", "reward_std", "entropy")


def assert_agree(stock, ours, rel: float = 1e-6) -> None:
    """Rule ``"none"`` is stock trl: the same logged loss, rewards and entropy per step, and the same weights."""
    a, b = steps(stock), steps(ours)
    assert len(a) == len(b)
    for key in AGREE_KEYS:
        x = [h.get(key) for h in a]
        y = [h.get(key) for h in b]
        assert [v is None for v in x] == [v is None for v in y], key
        assert [v for v in x if v is not None] == pytest.approx([v for v in y if v is not None], rel=rel), key
    assert max_relative_weight_diff(stock, ours) < rel


def run_all(model, tmp_path, *, agree: bool = True, **kwargs):
    """Train the three variants; check all trained and, when ``agree``, that rule "none" equals stock trl."""
    runs = {variant[0]: train_variant(variant, model, tmp_path, **kwargs) for variant in VARIANTS}
    for trainer, before, _ in runs.values():
        assert_trained(trainer, before, kwargs.get("max_steps", 2))
    if agree:
        assert_agree(runs["stock"][0], runs["none"][0])
        # rule "none" with default settings is stock trl: nothing recorded, nothing warned, no safevocab metric
        assert not runs["none"][2]
        assert not any(FRAC in h for h in steps(runs["none"][0]))
    return runs


def plain(tiny_model_dir, **config):
    return dict(model=tiny_model_dir, processing_class=build_tokenizer(), train_dataset=prompt_dataset(), **config)


# ----------------------------------------------------------------------------------------------------------------
# loss types, importance-sampling level, iterations, reference model and other GRPOConfig flags


LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_types(tiny_model_dir, tmp_path, loss_type):
    runs = run_all(
        tmp_path=tmp_path,
        loss_type=loss_type,
        importance_sampling_level="sequence" if loss_type == "luspo" else "token",
        gradient_accumulation_steps=2,  # dapo/cispo/vespo normalise over an accumulated generation batch
        **plain(tiny_model_dir),
    )
    # the default rule records rollout log-probabilities on the generate path and corrects with them
    ours = steps(runs["safevocab"][0])
    assert all(h[FRAC] == 1.0 for h in ours)
    assert all("mismatch/is_mean" in h for h in ours)


def test_vespo_with_sequence_importance_sampling_mode(tiny_model_dir, tmp_path):
    """trl checks VESPO's token-level IS modes on vLLM only; its default mode (sequence_mask) trains here too."""
    runs = run_all(
        tmp_path=tmp_path, loss_type="vespo", vllm_importance_sampling_mode="sequence_mask", **plain(tiny_model_dir)
    )
    assert runs["safevocab"][0].args.vllm_importance_sampling_mode == "sequence_mask"


def test_sequence_level_importance_sampling(tiny_model_dir, tmp_path):
    run_all(tmp_path=tmp_path, importance_sampling_level="sequence", loss_type="grpo", **plain(tiny_model_dir))


def test_num_iterations(tiny_model_dir, tmp_path):
    """Two iterations per generation: trl scores the old policy, the trainer takes its safe sets from that pass."""
    runs = run_all(tmp_path=tmp_path, num_iterations=2, max_steps=4, **plain(tiny_model_dir))
    ours = steps(runs["safevocab"][0])
    assert sum("safevocab/pruned_mass_mean" in h for h in ours) == 2  # one generation every two steps


def test_reference_model_and_flags(tiny_model_dir, tmp_path):
    """beta > 0 (reference model), off-policy sequence mask, entropy filter, two-sided clipping, bias-corrected KL,
    fp32 LM head: the GRPOConfig flags that touch the loss."""
    run_all(
        tmp_path=tmp_path,
        beta=0.04,
        off_policy_mask_threshold=0.5,
        top_entropy_quantile=0.5,
        delta=2.0,
        use_bias_correction_kl=True,
        cast_lm_head_to_fp32=True,
        scale_rewards="batch",
        **plain(tiny_model_dir),
    )


@pytest.mark.slow  # transformers' continuous batching takes ~10 s per trainer on CPU
def test_transformers_continuous_batching(tiny_model_dir, tmp_path):
    """trl's generate_batch path (no log-probabilities): accepted with trl's default IS switch, nothing recorded."""
    runs = run_all(tmp_path=tmp_path, use_transformers_continuous_batching=True, **plain(tiny_model_dir))
    trainer = runs["safevocab"][0]
    assert trainer.args.rollout_logprobs is False and trainer.args.vllm_importance_sampling_correction
    assert not any(FRAC in h for h in steps(trainer))


def test_peft(tiny_model_dir, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is in the test extra; install safevocab[test]")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    runs = run_all(tmp_path=tmp_path, trainer_kwargs={"peft_config": config}, beta=0.04, **plain(tiny_model_dir))
    for trainer, _, _ in runs.values():
        assert type(trainer.model).__name__.startswith("Peft")


def test_vlm_inputs(tmp_path_factory, tmp_path):
    """A vision-language model (tiny LLaVA) with image prompts: pixel values reach generation and every scoring
    pass (trl's multimodal fields pass through the safe head)."""
    from transformers import AutoProcessor
    from vlm_helpers import build_vlm, image_dataset

    path = str(tmp_path_factory.mktemp("tiny-llava"))
    build_vlm(path)
    runs = run_all(
        model=path,
        tmp_path=tmp_path,
        processing_class=AutoProcessor.from_pretrained(path),
        train_dataset=image_dataset(),
        reward_funcs=chat_reward,
    )
    ours = steps(runs["safevocab"][0])
    assert all(h[FRAC] == 1.0 for h in ours)
    # trl suppresses the image token while sampling (generation_config.suppress_tokens), which the trainer's set
    # keeps: the recorded ratio measures that (documented as a known difference in docs/trl.md)
    assert runs["safevocab"][0].generation_config.suppress_tokens


# ----------------------------------------------------------------------------------------------------------------
# sampler settings


def test_sampler_flags_compose(tiny_model_dir, tmp_path):
    """trl's test_train_with_additional_generation_kwargs settings: accepted; the effective rule is the rule &
    the sampler's truncation; repetition_penalty with IS on cannot be reproduced, so those batches fall back."""
    settings = dict(top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1)
    runs = run_all(tmp_path=tmp_path, agree=False, **plain(tiny_model_dir, **settings))
    for name in ("safevocab", "none"):
        trainer, _, fallbacks = runs[name]
        assert trainer.args.safe_vocab_effective_rule == "top_k=10,top_p=0.9,min_p=0.01"
        assert str(trainer.safe_vocab_rule) == "top_k=10,top_p=0.9,min_p=0.01"
        assert len(fallbacks) == 1 and "repetition_penalty" in fallbacks[0]
        assert all(h[FRAC] == 0.0 for h in steps(trainer))
        assert not any("mismatch/is_mean" in h for h in steps(trainer))


def test_sampler_flags_without_penalty_record(tiny_model_dir, tmp_path, caplog):
    """Truncation alone composes and is recorded: the ratio is exactly 1 in fp32 (same support on both sides); the
    effective rule is logged once per trainer (the trainer's logger, at INFO: the library prints nothing)."""
    with caplog.at_level(logging.INFO, logger="trl_integration.grpo.trainer"):
        runs = run_all(tmp_path=tmp_path, agree=False, **plain(tiny_model_dir, top_p=0.9, top_k=10, min_p=0.01))
    logged = [r.getMessage() for r in caplog.records if "effective rule" in r.getMessage()]
    assert len(logged) == 2 and all("'top_k=10,top_p=0.9,min_p=0.01'" in line for line in logged)
    for name in ("safevocab", "none"):
        trainer, _, fallbacks = runs[name]
        assert not fallbacks
        for h in steps(trainer):
            assert h[FRAC] == 1.0
            assert h["mismatch/is_raw_mean"] == pytest.approx(1.0, abs=1e-4)


def test_generation_kwargs_beam_search(tiny_model_dir, tmp_path):
    """generation_kwargs with beams: accepted, rollout log-probabilities fall back with one warning."""
    gk = {"top_k": 50, "num_beams": 2, "do_sample": True, "length_penalty": 1.0}
    runs = run_all(tmp_path=tmp_path, agree=False, **plain(tiny_model_dir, generation_kwargs=gk))
    trainer, _, fallbacks = runs["safevocab"]
    assert trainer.args.safe_vocab_effective_rule == "top_k=50,min_p=0.001"
    assert len(fallbacks) == 1 and "num_beams" in fallbacks[0]
    assert all(h[FRAC] == 0.0 for h in steps(trainer))
    # rule "none" with top_k=50 prunes nothing on a 49-token vocabulary... but the rule is still top_k=50
    assert runs["none"][0].args.safe_vocab_effective_rule == "top_k=50"


# ----------------------------------------------------------------------------------------------------------------
# replaced generate: truncation masking (trl's test patches GenerationMixin.generate)


def test_mask_truncated_completions_dapo(tiny_model_dir, tmp_path):
    tokenizer = build_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [
        [10, 11, 12, 13, 14, 15, 16, 17],  # truncated
        [18, 19, 20, eos],  # terminated
        [21, 22, 23, 24, 25, 26, 27, eos],  # terminated at the limit
        [28, 29, eos],
    ]
    runs = run_all(
        tmp_path=tmp_path,
        fake_generate=fake_generate_from(lambda n: [rows[i % 4] for i in range(n)], pad),
        patch_class_generate=True,
        mask_truncated_completions=True,
        loss_type="dapo",
        **plain(tiny_model_dir),
    )
    trainer, _, fallbacks = runs["safevocab"]
    assert len(fallbacks) == 1 and "never called" in fallbacks[0]
    assert all(h[FRAC] == 0.0 for h in steps(trainer))


# ----------------------------------------------------------------------------------------------------------------
# tools, multi-turn, environments, rollout_func


def tool_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'


def agent_turns(tokenizer, first: list[str], batch_size: int, then: str = "Done!<|im_end|>"):
    """Completions of a first-turn call (a full generation batch: ``first`` cycled over it) and of a post-tool call
    (only the rollouts that called a tool: ``then`` for each), told apart by the batch size as in trl's tests."""
    first_ids = [encode(tokenizer, text) for text in first]
    then_ids = encode(tokenizer, then)

    def turns(n):
        return [first_ids[i % len(first_ids)] for i in range(n)] if n == batch_size else [then_ids] * n

    return turns


def agent(chat_model_dir, first, per_device_train_batch_size=3, num_generations=3, **config):
    tokenizer = build_chat_tokenizer()
    turns = agent_turns(tokenizer, first, per_device_train_batch_size)
    return dict(
        model=chat_model_dir,
        processing_class=tokenizer,
        reward_funcs=chat_reward,
        fake_generate=fake_generate_from(turns, tokenizer.pad_token_id),
        max_completion_length=256,
        per_device_train_batch_size=per_device_train_batch_size,
        num_generations=num_generations,
        learning_rate=0.1,
        **config,
    )


@pytest.mark.parametrize("tool", [multiply_tool, async_multiply_tool], ids=["sync", "async"])
def test_tools_multi_turn(chat_model_dir, tmp_path, tool):
    """trl's test_train_with_tools: two of three completions call the tool (one with a wrong argument); the
    completions that called it are regenerated after the tool's answer (a second turn)."""
    name = tool.__name__
    first = [
        tool_call(name, '{"a": 3, "b": 4}'),
        tool_call(name, '{"a": 3, "c": 4}'),
        "I don't know any tool<|im_end|>",
    ]
    runs = run_all(
        tmp_path=tmp_path,
        train_dataset=chat_dataset(),
        trainer_kwargs={"tools": [tool]},
        **agent(chat_model_dir, first),
    )
    for trainer, _, _ in runs.values():
        last = steps(trainer)[-1]
        assert last["tools/call_frequency"] == pytest.approx(2 / 3)
        assert last["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert len(runs["safevocab"][2]) == 1  # the fake generate runs no logits processor: one warning per run


def test_malformed_tool_calls(chat_model_dir, tmp_path):
    first = [
        '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
        '<toolcall>\n{"arguments": {"a": 3, "b": 4}}\n</toolcall><|im_end|>',
        '<tool_call>\n{"arguments": {a: 3, b: 4}}\n</tool_call><|im_end|>',
    ]
    run_all(
        tmp_path=tmp_path,
        train_dataset=chat_dataset(),
        trainer_kwargs={"tools": [multiply_tool]},
        **agent(chat_model_dir, first),
    )


class CounterEnvironment:
    def reset(self, **kwargs):
        self._counter = 0
        return "Count."

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter


class EchoEnvironment:
    def reset(self, **kwargs):
        return "Echo."

    def shout(self, text: str) -> str:
        """
        Shout the given text.

        Args:
            text: Text to shout.

        Returns:
            The text in upper case.
        """
        return text.upper()


class RewardedCounterEnvironment(CounterEnvironment):
    def get_reward(self) -> float:
        return float(self._counter)


class WordEnvironment:
    def reset(self, **kwargs):
        return "Guess the 5-letter word."


ENV_FIRST = [
    tool_call("increment", '{"step": 1}'),
    tool_call("decrement", '{"step": 2}'),
    "I won't increment<|im_end|>",
]


@pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")
def test_environment_factory(chat_model_dir, tmp_path):
    runs = run_all(
        tmp_path=tmp_path,
        trainer_kwargs={"environment_factory": CounterEnvironment},
        **agent(chat_model_dir, ENV_FIRST),
    )
    for trainer, _, _ in runs.values():
        assert steps(trainer)[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
        assert trainer.environments[0]._counter == 1


@pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")
def test_environment_owned_reward(chat_model_dir, tmp_path):
    kwargs = agent(chat_model_dir, ENV_FIRST)
    kwargs["reward_funcs"] = None
    runs = run_all(tmp_path=tmp_path, trainer_kwargs={"environment_factory": RewardedCounterEnvironment}, **kwargs)
    for trainer, _, _ in runs.values():
        assert trainer.reward_func_names == ["RewardedCounterEnvironment"]


@pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")
def test_environment_owned_data(chat_model_dir, tmp_path):
    kwargs = agent(chat_model_dir, ["Done!<|im_end|>", "DoneDone!<|im_end|>", "DoneDoneDone!<|im_end|>"])
    kwargs["max_completion_length"] = 16
    run_all(tmp_path=tmp_path, trainer_kwargs={"environment_factory": WordEnvironment}, **kwargs)


@pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")
def test_multiple_environments(chat_model_dir, tmp_path):
    first = [
        tool_call("increment", '{"step": 1}'),
        "I won't<|im_end|>",
        tool_call("shout", '{"text": "hi"}'),
        "Done!<|im_end|>",
    ]
    kwargs = agent(chat_model_dir, first, per_device_train_batch_size=4, num_generations=2, shuffle_dataset=False)
    runs = run_all(
        tmp_path=tmp_path,
        train_dataset=Dataset.from_dict({"environment": ["counter", "echo"] * 8}),
        trainer_kwargs={"environment_factory": {"counter": CounterEnvironment, "echo": EchoEnvironment}},
        **kwargs,
    )
    for trainer, _, _ in runs.values():
        assert steps(trainer)[-1]["tools/call_frequency"] == pytest.approx(2 / 4)
        assert steps(trainer)[-1]["tools/failure_frequency"] == pytest.approx(0.0)


def test_rollout_func(tiny_model_dir, tmp_path):
    """A custom rollout function owns generation (trl's rollout_func): fixed completions, an env_mask extra field
    and rollout log-probabilities it cannot give (None)."""
    tokenizer = build_tokenizer()
    completions = [encode(tokenizer, text) + [tokenizer.eos_token_id] for text in ("aei", "bcd", "ou", "xyz")]

    def rollout_func(prompts, trainer):
        prompt_ids = [encode(tokenizer, p) for p in prompts]
        completion_ids = [completions[i % len(completions)] for i in range(len(prompts))]
        env_mask = [[1] * len(c) for c in completion_ids]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "env_mask": env_mask}

    runs = run_all(tmp_path=tmp_path, trainer_kwargs={"rollout_func": rollout_func}, **plain(tiny_model_dir))
    assert not any(FRAC in h for h in steps(runs["safevocab"][0]))  # no rollout log-probabilities: no IS, no metric


def test_rollout_func_with_logprobs(tiny_model_dir, tmp_path):
    """A rollout function that returns log-probabilities with a gap (None, as vLLM reports an unscorable token):
    the batch trains without generate-path IS and the recorded share is logged."""
    tokenizer = build_tokenizer()
    completions = [encode(tokenizer, text) + [tokenizer.eos_token_id] for text in ("aeiou", "bcdfg", "aebcd")]

    def rollout_func(prompts, trainer):
        prompt_ids = [encode(tokenizer, p) for p in prompts]
        completion_ids = [completions[i % 3] for i in range(len(prompts))]
        logprobs = [[-1.0] * (len(c) - 1) + [None] for c in completion_ids]  # the EOS token has none
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    runs = run_all(tmp_path=tmp_path, trainer_kwargs={"rollout_func": rollout_func}, **plain(tiny_model_dir))
    ours = steps(runs["safevocab"][0])
    assert all(h[FRAC] == pytest.approx(5 / 6) for h in ours)
    assert not any("mismatch/is_mean" in h for h in ours)
