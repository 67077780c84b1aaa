"""The built-in free-text task: continue a docstring or comment of the standard library, rewarded by word overlap.

A free-text task keeps a policy in the tail of its distribution (many plausible next words), which is where the
training–inference mismatch lives; an arithmetic answer is peaked. This task is made for the testbed model
(:mod:`trl_integration.demo.testbed`) and shipped with it.

Texts and splits
    The texts are the stdlib docstrings and comments (read by ``scripts/stdlib_corpus.py``) with at least
    ``PROMPT_WORDS + MIN_CONTINUATION_WORDS`` = 12 whitespace-separated words, written by the testbed build into
    ``assets/testbed/`` (:data:`TASK_TEXTS_FILE`), so the task is the same on every Python version. A text is
    *held out* iff :func:`~trl_integration.demo.stdlib_text.is_held_out` (a hash of the text, 5%): held-out texts
    were never pretrained on and are the only source of held-out prompts; training prompts come from the other
    texts, except those that start with the same six words as a held-out text, so that no prompt is in both
    splits (and the held-out prompts are distinct). Held-out rows are in the order of the texts' SHA-256 (a fixed
    pseudo-random order): ``held_out_dataset(n)`` is the first ``n`` of them. ``train_dataset(n, seed)`` walks
    seeded permutations of the training texts (a larger ``n`` extends a smaller one).

Prompt and continuation
    The prompt is the text up to the end of its ``PROMPT_WORDS`` = 6th whitespace-separated word (original
    spacing kept, no trailing space); the ``continuation`` column is the rest of the text up to the end of its
    ``CONTINUATION_WORDS`` = 16th word (or the text's end). Example: ``"Return a random int in the"`` ->
    ``" range [0,n).  Defined for n > 0."``.

Reward (ROUGE-1 F1)
    ``words(s)`` is the list of ``\\w+`` runs of ``s.lower()`` (letters, digits, underscore; punctuation and spaces
    separate words). With ``c`` the completion's words, ``r`` the continuation's, ``#_c(w)`` the count of ``w`` in
    ``c`` and ``overlap = sum_w min(#_c(w), #_r(w))`` (clipped counts: repeating a word earns it at most as often as
    the continuation has it), precision ``P = overlap / |c|``, recall ``R = overlap / |r|`` and

        reward = F1 = 2 P R / (P + R) = 2 overlap / (|c| + |r|)   in [0, 1],   0 when overlap = 0.

    It is verifiable (a pure function of the two strings) and dense (every shared word counts), so GRPO's groups
    get differing rewards from the first step; a too-long completion loses precision, a too-short one recall.

Held-out metric
    The mean reward of one completion per held-out prompt, **sampled** at temperature 1 from the full distribution
    (no top-k/top-p/min-p) with a fixed seed (``torch.manual_seed(0)`` before the first batch; torch's global RNG
    state is saved before and restored after, so evaluating does not change a run), at most
    :data:`MAX_COMPLETION_LENGTH` new tokens, decoded with ``skip_special_tokens=True`` as trl does. Sampled, not
    greedy, because it is what GRPO optimises: in two 300-step GRPO runs from the testbed (``docs/testbed.md``) the
    sampled held-out reward rose at every evaluation (0.05 to 0.10) while the greedy one moved little after step 50
    (the greedy completions of a model this small fall into repetitions). ``do_sample=False`` is greedy.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trl_integration.demo.arithmetic import completion_text
from trl_integration.demo.stdlib_text import is_held_out
from trl_integration.demo.testbed import TESTBED_DIR

__all__ = [
    "PROMPT_WORDS",
    "CONTINUATION_WORDS",
    "MIN_CONTINUATION_WORDS",
    "MAX_COMPLETION_LENGTH",
    "HELD_OUT_PROMPTS",
    "TASK_TEXTS_FILE",
    "words",
    "unigram_f1",
    "split_text",
    "freetext_reward",
    "save_task_texts",
    "load_task_texts",
    "train_dataset",
    "held_out_dataset",
    "held_out_reward",
    "freetext_task",
]

PROMPT_WORDS = 6
CONTINUATION_WORDS = 16
MIN_CONTINUATION_WORDS = 6

#: Completion length (tokens) of the task: 16 words are about 29 tokens of the testbed's BPE (1.8 tokens a word).
MAX_COMPLETION_LENGTH = 32

#: Held-out prompts the task's metric uses by default.
HELD_OUT_PROMPTS = 256

#: The task's texts in the testbed folder: gzipped JSON ``{"held_out": [...], "train": [...]}``.
TASK_TEXTS_FILE = "freetext_texts.json.gz"

_WORD = re.compile(r"\w+")
_CHUNK = re.compile(r"\S+")


def words(text: str) -> list[str]:
    """The words the reward compares: ``\\w+`` runs of the lower-cased text."""
    return _WORD.findall(text.lower())


def unigram_f1(completion: str, reference: str) -> float:
    """ROUGE-1 F1 of ``completion`` against ``reference`` with clipped counts (see the module docstring)."""
    c, r = Counter(words(completion)), Counter(words(reference))
    overlap = sum((c & r).values())
    return 0.0 if overlap == 0 else 2.0 * overlap / (sum(c.values()) + sum(r.values()))


def split_text(text: str) -> tuple[str, str] | None:
    """``(prompt, continuation)`` of a text, or ``None`` if it has fewer than 12 words (module docstring)."""
    chunks = list(_CHUNK.finditer(text))
    if len(chunks) < PROMPT_WORDS + MIN_CONTINUATION_WORDS:
        return None
    cut = chunks[PROMPT_WORDS - 1].end()
    end = chunks[min(len(chunks), PROMPT_WORDS + CONTINUATION_WORDS) - 1].end()
    return text[:cut], text[cut:end]


def freetext_reward(
    prompts: Sequence[Any], completions: Sequence[Any], continuation: Sequence[str], **kwargs: Any
) -> list[float]:
    """trl reward function: the ROUGE-1 F1 of each completion against its row's ``continuation``.

    Args:
        prompts: the prompts (unused; part of trl's reward signature).
        completions: generated texts, ``str`` or conversational messages, one per row.
        continuation: the dataset's ``continuation`` column, one per row.
    """
    if len(completions) != len(continuation):
        raise ValueError(
            f"completions and continuation must have the same length, got {len(completions)} and {len(continuation)}"
        )
    return [unigram_f1(completion_text(c), ref) for c, ref in zip(completions, continuation)]


def save_task_texts(folder: Path, texts: Sequence[str]) -> int:
    """Write :data:`TASK_TEXTS_FILE` into ``folder`` from the corpus ``texts``; returns its size in bytes.

    Keeps the texts :func:`split_text` accepts: held-out ones sorted by SHA-256, one per prompt (the first), and
    training ones in corpus order, except those whose prompt is a held-out prompt (different texts can start with
    the same six words), so that no training prompt is a held-out prompt. The gzip header carries no time stamp:
    the same texts give the same bytes.
    """
    eligible = [t for t in texts if split_text(t) is not None]
    held_out, held_out_prompts = [], set()
    for text in sorted((t for t in eligible if is_held_out(t)), key=lambda t: hashlib.sha256(t.encode()).hexdigest()):
        prompt = split_text(text)[0]
        if prompt not in held_out_prompts:
            held_out.append(text)
            held_out_prompts.add(prompt)
    train = [t for t in eligible if not is_held_out(t) and split_text(t)[0] not in held_out_prompts]
    data = {"held_out": held_out, "train": train}
    path = Path(folder) / TASK_TEXTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    path.write_bytes(gzip.compress(payload, compresslevel=9, mtime=0))
    return path.stat().st_size


@functools.lru_cache(maxsize=4)
def load_task_texts(folder: Path | None = None) -> dict[str, tuple[str, ...]]:
    """The task's texts ``{"held_out": (...), "train": (...)}`` (default: the bundled testbed's)."""
    path = Path(TESTBED_DIR if folder is None else folder) / TASK_TEXTS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"the free-text task's texts are missing: {path} (rebuild with "
            "`python scripts/train_testbed_model.py`; see docs/testbed.md)"
        )
    data = json.loads(gzip.decompress(path.read_bytes()).decode("utf-8"))
    return {"held_out": tuple(data["held_out"]), "train": tuple(data["train"])}


def _dataset(texts: Sequence[str]):
    from datasets import Dataset

    rows = [split_text(t) for t in texts]
    return Dataset.from_dict({"prompt": [p for p, _ in rows], "continuation": [c for _, c in rows]})


def train_dataset(num_prompts: int, seed: int = 0, *, folder: Path | None = None):
    """``num_prompts`` training rows (``prompt``, ``continuation``): seeded permutations of the training texts,
    one after the other (a larger ``num_prompts`` extends a smaller one)."""
    if not (isinstance(num_prompts, int) and num_prompts >= 1):
        raise ValueError(f"num_prompts={num_prompts!r} is not accepted: accepted an integer >= 1")
    pool = load_task_texts(folder)["train"]
    chosen: list[str] = []
    epoch = 0
    while len(chosen) < num_prompts:
        order = list(pool)
        random.Random(f"freetext-train-{seed}-{epoch}").shuffle(order)
        chosen.extend(order[: num_prompts - len(chosen)])
        epoch += 1
    return _dataset(chosen)


def held_out_dataset(num_prompts: int = HELD_OUT_PROMPTS, *, folder: Path | None = None):
    """The first ``num_prompts`` held-out rows (``prompt``, ``continuation``), a fixed set (module docstring)."""
    pool = load_task_texts(folder)["held_out"]
    if not (isinstance(num_prompts, int) and 1 <= num_prompts <= len(pool)):
        raise ValueError(f"num_prompts={num_prompts!r} is not accepted: accepted an integer in [1, {len(pool)}]")
    return _dataset(pool[:num_prompts])


def held_out_reward(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    *,
    do_sample: bool = True,
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int = MAX_COMPLETION_LENGTH,
    min_p: float | None = None,
    top_p: float | None = None,
) -> float:
    """Mean :func:`freetext_reward` of one completion per row of ``dataset``: sampled at temperature 1 from the full
    distribution, seeded with ``seed`` (``do_sample=False``: greedy). Torch's global RNG state is restored.

    ``min_p`` (in (0, 1]) samples from the safe vocabulary of the rule ``min_p=<min_p>`` instead of the full
    distribution (tokens with p ≥ min_p · p_max, renormalised: transformers' ``min_p``), as a policy trained with
    that rule would be deployed; ``1.0`` keeps only the most probable token (greedy, ties aside). ``top_p`` (in
    (0, 1]) samples from the nucleus of mass ``top_p`` instead (transformers' ``top_p``). Either needs
    ``do_sample=True``; at most one of them is given.

    Raises:
        ValueError: one line naming the argument: an empty ``dataset``, a ``min_p`` or ``top_p`` outside (0, 1] (NaN
            included), both of them, or either with ``do_sample=False``. The model is not touched then.
        TypeError: ``min_p`` or ``top_p`` is not a real number (a string, a bool).
    """
    from safevocab.validation import real
    from trl_integration.demo.evaluation import mean_reward

    if len(dataset) == 0:
        raise ValueError("dataset is empty")
    if min_p is not None and top_p is not None:
        raise ValueError(f"min_p={min_p!r} and top_p={top_p!r}: accepted at most one of them")
    for name, value in (("min_p", min_p), ("top_p", top_p)):
        if value is not None:
            value = real(name, value, lambda x: 0.0 < x <= 1.0, "a float in (0, 1] or None")
            if not do_sample:
                raise ValueError(
                    f"{name}={value!r} needs do_sample=True: a greedy completion has no support to restrict"
                )
    min_p = None if min_p is None else float(min_p)
    top_p = None if top_p is None else float(top_p)
    prompts, references = list(dataset["prompt"]), list(dataset["continuation"])
    sampling = (
        dict(do_sample=True, temperature=1.0, top_k=None, top_p=top_p, min_p=min_p)
        if do_sample
        else dict(do_sample=False)
    )
    return mean_reward(
        model,
        tokenizer,
        prompts,
        references,
        freetext_reward,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
    )


def freetext_task():
    """The free-text task as a :class:`~trl_integration.task.StudyTask` for the bundled testbed model."""
    from trl_integration.demo.testbed import testbed_model_path
    from trl_integration.task import StudyTask

    return StudyTask(
        name="freetext",
        model_path=str(testbed_model_path()),
        train_dataset=train_dataset,
        held_out_dataset=held_out_dataset,
        reward_funcs=(freetext_reward,),
        held_out_metric=held_out_reward,
        metric_name="reward",
        max_completion_length=MAX_COMPLETION_LENGTH,
        description="continue a held-out stdlib docstring or comment; reward: ROUGE-1 F1 with the true continuation",
        metric_keywords=("seed", "min_p", "top_p"),
    )
