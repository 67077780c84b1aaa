"""Inputs of the mismatch lab: the precisions to compare and the default texts to score.

- ``DTYPES`` / :func:`parse_compare`: ``"float32:bfloat16"`` -> (training dtype, rollout dtype);
- :func:`default_texts`: problems of the bundled arithmetic task with their answers (``"37+48=85"``), the texts
  ``safevocab diagnose`` scores when given none;
- :func:`stdlib_texts`: free English text every Python install carries (standard-library docstrings), the
  tail diagnostic's free-text prompts when given no ``--input``.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DEFAULT_TEXTS", "STDLIB_TEXT_MODULES", "parse_compare", "default_texts", "stdlib_texts"]

#: Standard-library modules whose docstrings `stdlib_texts` reads, in order.
STDLIB_TEXT_MODULES: tuple[str, ...] = (
    "argparse", "json", "re", "textwrap", "collections", "functools", "itertools", "pathlib", "string", "random",
    "statistics", "csv", "datetime", "decimal", "difflib", "fractions", "heapq", "logging", "pickle", "shutil",
    "subprocess", "tempfile", "threading", "unittest", "zipfile", "email", "sqlite3", "typing", "inspect", "abc",
)  # fmt: skip

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


def stdlib_texts(n: int = 64, max_chars: int = 300) -> list[str]:
    """Up to ``n`` paragraphs of English prose from the docstrings of :data:`STDLIB_TEXT_MODULES` (whitespace
    folded, code examples and lists skipped, each cut to ``max_chars`` characters), in a fixed order: free text
    for the tail diagnostic that needs no download and no file."""
    import importlib
    import inspect

    texts: list[str] = []
    for name in STDLIB_TEXT_MODULES:
        try:
            doc = inspect.getdoc(importlib.import_module(name)) or ""
        except ImportError:  # a Python built without it (e.g. no sqlite3)
            continue
        for paragraph in doc.split("\n\n"):
            text = " ".join(paragraph.split())
            words = text.split()
            code = " = " in text or "#" in text or ">>>" in text or text[:1] in tuple(">-*=.:|+")
            if len(words) < 8 or code or sum(w.isalpha() for w in words) < 0.6 * len(words):
                continue  # code, tables and lists are not prose
            texts.append(text[:max_chars])
            if len(texts) == n:
                return texts
    return texts
