"""A verifiable synthetic task: integer arithmetic with a short, exactly checkable answer.

A prompt is ``"<a><op><b>="`` with no spaces (``"37+48="``, ``"5-713="``), and the expected completion is the
canonical decimal result followed by the end-of-sequence token (``"85"``, ``"-708"``). This is trl's standard
*non-conversational* format: the dataset has a plain-string ``prompt`` column, plus an ``answer`` column (the
canonical answer string) that trl forwards to the reward function as a keyword argument.

Problems
    Each operand independently draws its number of digits uniformly from ``[min_digits, max_digits]`` and then a
    value uniformly among the numbers with exactly that many digits (``0``–``9`` for one digit, ``10``–``99``
    for two, ...). The operator is drawn uniformly from ``operations``. The defaults (``"+-"``, 1–3 digits) mix
    easy problems (``4+7=``) with hard ones (``587-926=``), so a small model is right on some prompts and wrong
    on others: GRPO gets non-zero advantages from the first step and has headroom to improve.

Splits
    A problem belongs to the *test* split iff a SHA-256 hash of its prompt string falls in the first
    ``test_fraction`` of the hash range (the default ``0.1`` puts about 10% of all problems in test), and to
    *train* otherwise. The split is a property of the problem itself, not of the seed or of ``n``: any train
    dataset and any test dataset built with the same ``test_fraction`` are disjoint. Within a dataset, problems
    may repeat (there are only 200 one-digit-by-one-digit problems); draws are i.i.d. from the task distribution
    restricted to the split.

Answers and rewards (what counts as correct)
    :func:`parse_answer` reads a completion as follows: leading whitespace is skipped, then the longest prefix
    matching ``-?[0-9]+`` is the model's answer; everything after it (spaces, ``=``, operators, a decoded
    ``<eos>``, more text) is ignored. The completion is correct iff that prefix is *exactly* the canonical
    decimal string of the result: no leading zeros (``"085"`` is wrong for 85), no ``"+"`` sign, ``"0"`` not
    ``"-0"``. Digits that continue the number are part of it (``"851"`` is wrong for 85); a completion that does
    not start with a number (``""``, ``"=85"``, ``" x"``) is wrong.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "OPERATIONS",
    "MAX_ANSWER_CHARS",
    "arithmetic_reward",
    "parse_answer",
    "is_test_problem",
    "sample_problems",
    "make_dataset",
    "completion_text",
    "accuracy",
]

#: Supported operators and their meaning.
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

#: Longest answer string of the default task (``"-999"`` or ``"1998"``); add 1 token for EOS.
MAX_ANSWER_CHARS = 4

_ANSWER_RE = re.compile(r"\s*(-?[0-9]+)")
_HASH_RANGE = 2**64


def parse_answer(text: str) -> str | None:
    """The answer a completion gives: its leading ``-?[0-9]+`` after optional whitespace, or ``None``."""
    match = _ANSWER_RE.match(text)
    return match.group(1) if match else None


def completion_text(completion: Any) -> str:
    """The text of a completion in trl's plain (``str``) or conversational (list of messages) format."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"completion must be a str or a list of chat messages, got {type(completion).__name__}")


def arithmetic_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str | int], **kwargs: Any
) -> list[float]:
    """trl reward function: 1.0 where the completion's parsed answer equals ``answer`` exactly, else 0.0.

    Args:
        prompts: the prompts (unused; part of trl's reward signature).
        completions: generated texts, ``str`` or conversational messages, one per row.
        answer: the dataset's ``answer`` column (canonical strings, ints are accepted too), one per row.

    See the module docstring for exactly what counts as correct.
    """
    if len(completions) != len(answer):
        raise ValueError(f"completions and answer must have the same length, got {len(completions)} and {len(answer)}")
    rewards = []
    for completion, expected in zip(completions, answer):
        given = parse_answer(completion_text(completion))
        rewards.append(1.0 if given is not None and given == str(expected) else 0.0)
    return rewards


def _check_options(operations: str, min_digits: int, max_digits: int, test_fraction: float) -> None:
    if not operations or any(op not in OPERATIONS for op in operations):
        raise ValueError(f"operations must be a non-empty string of {sorted(OPERATIONS)}, got {operations!r}")
    if not (isinstance(min_digits, int) and isinstance(max_digits, int) and 1 <= min_digits <= max_digits <= 9):
        raise ValueError(
            "need integers 1 <= min_digits <= max_digits <= 9, "
            f"got min_digits={min_digits!r}, max_digits={max_digits!r}"
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")


def is_test_problem(prompt: str, test_fraction: float = 0.1) -> bool:
    """Whether a prompt belongs to the test split (a stable hash of the prompt string, independent of seeds)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < test_fraction * _HASH_RANGE


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def sample_problems(
    n: int,
    rng: random.Random,
    split: str = "train",
    *,
    operations: str = "+-",
    min_digits: int = 1,
    max_digits: int = 3,
    test_fraction: float = 0.1,
) -> list[tuple[str, str]]:
    """``n`` i.i.d. ``(prompt, answer)`` pairs from ``split``, drawn with ``rng`` (rejection on the split hash)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not (isinstance(n, int) and n >= 0):
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    _check_options(operations, min_digits, max_digits, test_fraction)
    want_test = split == "test"
    out: list[tuple[str, str]] = []
    while len(out) < n:
        a = _operand(rng, min_digits, max_digits)
        b = _operand(rng, min_digits, max_digits)
        op = rng.choice(operations)
        prompt = f"{a}{op}{b}="
        if is_test_problem(prompt, test_fraction) == want_test:
            out.append((prompt, str(OPERATIONS[op](a, b))))
    return out


def make_dataset(
    n: int,
    seed: int = 0,
    split: str = "train",
    *,
    operations: str = "+-",
    min_digits: int = 1,
    max_digits: int = 3,
    test_fraction: float = 0.1,
):
    """A ``datasets.Dataset`` of ``n`` problems with string columns ``prompt`` (``"37+48="``) and ``answer`` (``"85"``).

    Deterministic in ``(n, seed, split, options)``; a larger ``n`` with the same seed extends the smaller dataset
    (same first rows). Train and test datasets never share a problem (see the module docstring).
    """
    from datasets import Dataset

    rows = sample_problems(
        n,
        random.Random(f"arithmetic-{split}-{seed}"),
        split,
        operations=operations,
        min_digits=min_digits,
        max_digits=max_digits,
        test_fraction=test_fraction,
    )
    return Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})


def accuracy(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    *,
    batch_size: int = 256,
    max_new_tokens: int = MAX_ANSWER_CHARS + 2,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int | None = 0,
    progress: bool | str = False,
) -> float:
    """Fraction of ``dataset`` rows whose generated completion earns reward 1 under :func:`arithmetic_reward`.

    Greedy decoding by default; ``do_sample=True`` samples from the full distribution at ``temperature``
    (no top-k/top-p/min-p), seeded with ``seed`` for reproducibility. Prompts are left-padded in batches of
    ``batch_size``; completions are decoded with ``skip_special_tokens=True``, as trl does. ``progress`` shows a
    progress bar over the problems on stderr (tqdm), labelled with ``progress`` when it is a string.

    Args:
        model: a causal LM (``AutoModelForCausalLM``) on any device.
        tokenizer: its tokenizer (needs a pad token).
        dataset: rows with ``prompt`` and ``answer`` (a ``datasets.Dataset`` or a list of dicts).
    """
    from trl_integration.demo.evaluation import mean_reward

    if len(dataset) == 0:
        raise ValueError("dataset is empty")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    prompts = [row["prompt"] for row in dataset]
    answers = [row["answer"] for row in dataset]
    if do_sample:  # the full distribution: no top-k / top-p / min-p truncation
        sampling = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None, min_p=None)
    else:
        sampling = dict(do_sample=False)
    return mean_reward(
        model,
        tokenizer,
        prompts,
        answers,
        arithmetic_reward,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        progress="accuracy" if progress is True else progress,
        unit="problem",
    )
