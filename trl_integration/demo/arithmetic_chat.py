"""The arithmetic task as chat messages, for a pretrained instruct model (SmolLM2-135M-Instruct: ``--model
smollm2-135m``).

Problems come from :mod:`trl_integration.demo.arithmetic`'s generator (``sample_problems``: the same disjoint
train/test splits), asked as one user message, ``"What is 6+7? Reply with just the number."``, in trl's
*conversational* format: the ``prompt`` column is a list of messages, which trl renders through the model's own chat
template, and the completion comes back as an assistant message. The ``answer`` column holds the canonical result.

Reward (:func:`arithmetic_chat_reward`): 1.0 iff the **last** integer in the completion is exactly the answer, else
0.0. An instruct model answers in sentences ("6 + 7 = 13."), so the bundled task's rule (the completion must *start*
with the answer) would reward almost nothing; the last number is the one a sentence ends on. A completion without a
number, or cut off before its result, earns 0.

The defaults (single-digit addition) are what a 135M-parameter model gets right part of the time: SmolLM2-135M's
sampled accuracy at temperature 1 was about a third on them (and a few per cent on two-digit addition), so GRPO
has signal from the first step.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from trl_integration.demo.arithmetic import completion_text, sample_problems

__all__ = ["QUESTION", "CHAT_TASK_OPTIONS", "chat_messages", "make_chat_dataset", "arithmetic_chat_reward"]

#: The user message; ``{problem}`` is the generator's prompt without its ``=`` (``"6+7"``).
QUESTION = "What is {problem}? Reply with just the number."
#: The problems of the chat task (``sample_problems`` options): single-digit addition.
CHAT_TASK_OPTIONS: dict[str, Any] = dict(operations="+", min_digits=1, max_digits=1)

_INTEGER = re.compile(r"-?[0-9]+")


def chat_messages(problem: str) -> list[dict[str, str]]:
    """The conversational prompt for a generator prompt (``"6+7="`` -> one user message)."""
    return [{"role": "user", "content": QUESTION.format(problem=problem.rstrip("="))}]


def make_chat_dataset(n: int, seed: int = 0, split: str = "train", **options: Any):
    """A ``datasets.Dataset`` of ``n`` problems: ``prompt`` (a list with one user message) and ``answer`` (``"13"``).

    Deterministic in ``(n, seed, split, options)``; ``options`` override :data:`CHAT_TASK_OPTIONS` (any
    ``sample_problems`` keyword: ``operations``, ``min_digits``, ``max_digits``, ``test_fraction``).
    """
    from datasets import Dataset

    rows = sample_problems(
        n, random.Random(f"arithmetic-chat-{split}-{seed}"), split, **{**CHAT_TASK_OPTIONS, **options}
    )
    return Dataset.from_dict({"prompt": [chat_messages(p) for p, _ in rows], "answer": [a for _, a in rows]})


def arithmetic_chat_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str | int], **kwargs: Any
) -> list[float]:
    """trl reward function: 1.0 where the last integer of the completion equals ``answer`` exactly, else 0.0.

    Args:
        prompts: the prompts (unused; part of trl's reward signature).
        completions: generated completions, conversational (a list with the assistant message) or plain strings.
        answer: the dataset's ``answer`` column, one per row.
    """
    if len(completions) != len(answer):
        raise ValueError(f"completions and answer must have the same length, got {len(completions)} and {len(answer)}")
    rewards = []
    for completion, expected in zip(completions, answer):
        numbers = _INTEGER.findall(completion_text(completion))
        rewards.append(1.0 if numbers and numbers[-1] == str(expected) else 0.0)
    return rewards
