"""Built-in tiny prompt dataset and reward for smoke runs (``safevocab-grpo --dataset_name synthetic``).

The task is "repeat a character": the prompt ``"repeat x: "`` asks for ``x`` again and again, and the reward is
the fraction of the completion's characters equal to ``x``. It works with any tokenizer, needs no download, and
gives rewards that differ between completions from the first step (so GRPO advantages are non-zero).
"""

from __future__ import annotations

import string

__all__ = ["SYNTHETIC_DATASET_NAME", "synthetic_dataset", "repeat_char_reward"]

SYNTHETIC_DATASET_NAME = "synthetic"


def synthetic_dataset(num_prompts: int = 64, seed: int = 0):
    """A ``datasets.Dataset`` with a plain-text ``prompt`` column and the ``target`` character of each prompt."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + string.digits
    targets = [rng.choice(alphabet) for _ in range(num_prompts)]
    return Dataset.from_dict({"prompt": [f"repeat {t}: " for t in targets], "target": targets})


def repeat_char_reward(completions, target=None, **kwargs) -> list[float]:
    """Fraction of each completion's non-space characters equal to its prompt's ``target`` character."""
    if target is None:
        raise ValueError("repeat_char_reward needs the dataset's 'target' column (use the synthetic dataset)")
    rewards = []
    for completion, t in zip(completions, target):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        chars = [c for c in text if not c.isspace()]
        rewards.append(sum(c == t for c in chars) / len(chars) if chars else 0.0)
    return rewards
