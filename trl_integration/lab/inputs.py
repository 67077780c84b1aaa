"""Inputs of the mismatch lab: the precisions to compare and the default texts to score.

- ``DTYPES`` / :func:`parse_compare`: ``"float32:bfloat16"`` -> (training dtype, rollout dtype);
- :func:`default_texts`: problems of the bundled arithmetic task with their answers (``"37+48=85"``), the texts
  ``safevocab diagnose`` scores when given none.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DEFAULT_TEXTS", "parse_compare", "default_texts"]

#: Accepted names of the ``--compare`` precisions.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}

#: A few plain sentences, for a model of your own that does not do arithmetic (``--prompts``/``--input``).
DEFAULT_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning fine-tunes a language model with rewards.",
    "1+1=2, 2+2=4, 3+3=6, 4+4=8.",
    "The training engine and the inference engine disagree in the tail.",
    "Once upon a time there was a small model that liked to count.",
    "Safe vocabularies drop the extreme tail of the next-token distribution.",
)


def parse_compare(spec: str) -> tuple[torch.dtype, torch.dtype]:
    """``"float32:bfloat16"`` -> ``(torch.float32, torch.bfloat16)`` (training side, rollout side).

    Raises:
        ValueError: on a malformed spec or an unknown dtype name.
    """
    parts = [s.strip().lower() for s in str(spec).split(":")]
    if len(parts) != 2 or any(p not in DTYPES for p in parts):
        raise ValueError(
            f"--compare {spec!r} is not accepted: accepted TRAIN:ROLLOUT with each one of "
            f"{sorted(set(DTYPES))}, e.g. float32:bfloat16"
        )
    return DTYPES[parts[0]], DTYPES[parts[1]]


def default_texts(n: int = 64) -> list[str]:
    """The default inputs: ``n`` test-split arithmetic problems with their answers (``"37+48=85"``).

    `DEFAULT_TEXTS` are the texts for a model of your own that does not do arithmetic (``--prompts``/``--input``).
    """
    import random

    from trl_integration.demo.arithmetic import sample_problems

    return [p + a for p, a in sample_problems(n, random.Random("safevocab-diagnose"), "test")]

