"""Helpers for the TRL integration tests: a tiny causal LM and a character-level tokenizer built in code.

Nothing is downloaded. The model is a 2-layer Llama (hidden 32, vocab ~60) whose LM head is scaled up so its
next-token distributions are peaked enough for min-p / top-k / top-p to prune something; the tokenizer maps
each character to one token. Both are saved to a temporary directory so that trainers can load them by path
(trl builds the reference model from the policy's path when ``beta != 0``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("SAFEVOCAB_EXPERIMENTAL_SILENCE", "1")  # the lab's and the study's import notice (tested apart)
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,!?+-=:")
PROMPTS = ["abc", "hello", "1+1=", "count:", "xyz", "the cat", "go!", "ok?"]
#: torch.distributed's variables, which a vLLM engine built in this process sets (RANK, MASTER_PORT, ...): a child that
#: inherited them would join that rendezvous (accelerate's ``Accelerator()`` then waits on a port nobody serves).
DISTRIBUTED = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def user_env() -> dict[str, str]:
    """This process's environment as a user's shell has it: without torch.distributed's variables."""
    return {k: v for k, v in os.environ.items() if k not in DISTRIBUTED}


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (each character is a token): the demo's, on this alphabet."""
    from trl_integration.demo.tokenizer import build_tokenizer as build_character_tokenizer

    return build_character_tokenizer(specials=SPECIALS, characters=CHARS, model_max_length=None)


def build_model(tokenizer, *, arch: str = "llama", head_scale: float = 6.0, seed: int = 0, **overrides):
    """A tiny randomly initialised causal LM whose head is scaled by ``head_scale`` (peaked distributions)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "gemma2":
        common.setdefault("head_dim", 8)
        common.setdefault("final_logit_softcapping", 5.0)
        config = transformers.Gemma2Config(**common)
        model = transformers.Gemma2ForCausalLM(config)
    else:  # pragma: no cover - test helper misuse
        raise ValueError(arch)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def prompt_dataset(n_rows: int = 8):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n_rows)]})


def vowel_reward(completions, **kwargs):
    """Fraction of vowels in each completion: cheap, deterministic, and varies across completions."""
    return [sum(c in "aeiou" for c in text) / max(1, len(text)) for text in completions]


def grpo_kwargs(output_dir, **overrides):
    """Small, fast, deterministic GRPO settings for CPU tests: the tiny demo job (``tiny_grpo_config_kwargs``) at
    4 prompts x 4 completions for 2 steps, logged every step."""
    from trl_integration.demo.config import tiny_grpo_config_kwargs

    kwargs = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return tiny_grpo_config_kwargs(**kwargs)


def make_trainer(model_dir, output_dir, trainer_cls=None, config_cls=None, *, reward_funcs=None, train_dataset=None,
                 trainer_kwargs=None, **config):  # fmt: skip
    """A trainer on the test settings (:func:`grpo_kwargs` with ``config``): ``trainer_cls(model=model_dir, ...)``
    (default ``SafeVocabGRPOTrainer``, config ``SafeVocabGRPOConfig``; trl's ``GRPOTrainer``/``GRPOConfig`` for a stock
    reference), the vowel reward, :func:`prompt_dataset` and the tiny tokenizer unless given; ``trainer_kwargs`` go to
    the trainer (``rollout_perturbation=``, ...)."""
    from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer

    trainer_cls = trainer_cls or SafeVocabGRPOTrainer
    args = (config_cls or SafeVocabGRPOConfig)(**grpo_kwargs(output_dir, **config))
    return trainer_cls(
        model=model_dir,
        reward_funcs=vowel_reward if reward_funcs is None else reward_funcs,
        args=args,
        train_dataset=prompt_dataset() if train_dataset is None else train_dataset,
        processing_class=build_tokenizer(),
        **(trainer_kwargs or {}),
    )
