"""The Python API's training data (issue 37, N11): what trl cannot train on is refused when the trainer is built, in one
line naming the column or the row (the command line checks its own data; these are the trainer's checks)."""

from __future__ import annotations

import pytest
from datasets import Dataset
from trl_helpers import build_tokenizer, grpo_kwargs, vowel_reward

from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer


def build(model_dir, tmp_path, dataset) -> str:
    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, report_to="none", save_strategy="no"))
    with pytest.raises(ValueError) as info:
        SafeVocabGRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                             processing_class=build_tokenizer())  # fmt: skip
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_dataset_without_a_prompt_column_is_named(tiny_model_dir, tmp_path):
    """Old code: built, then KeyError: 'prompt' inside trl's first generation step."""
    message = build(tiny_model_dir, tmp_path, Dataset.from_dict({"question": ["abc"] * 8, "answer": ["x"] * 8}))
    assert message == (
        "train_dataset has no 'prompt' column, which GRPO generates from: it has ['question', 'answer']; rename the "
        "column holding the prompts (dataset.rename_column('question', 'prompt'))"
    )


@pytest.mark.parametrize("empty", ["", []], ids=["text", "messages"])
def test_an_empty_prompt_is_named_by_its_row(tiny_model_dir, tmp_path, empty):
    """Old code (text): IndexError inside transformers' generate (a prompt of no tokens)."""
    prompts = ["abc", "hello", empty, "xyz"] if empty == "" else [[{"role": "user", "content": "hi"}], empty]
    message = build(tiny_model_dir, tmp_path, Dataset.from_dict({"prompt": prompts}))
    assert message.startswith(f"train_dataset row 2: prompt={empty!r} is empty: accepted a non-empty prompt"
                              if empty == "" else "train_dataset row 1: prompt=[] is empty: ")  # fmt: skip


@pytest.mark.parametrize(("prompts", "row", "shown"), [([7, 8], 0, "int 7"), (["abc", "de", None], 2, "NoneType None")],
                         ids=["int", "none"])  # fmt: skip
def test_a_prompt_that_is_not_text_is_named_by_its_column_and_row(tiny_model_dir, tmp_path, prompts, row, shown):
    """Issue 57: before, the tokenizer's message, naming neither the column nor the row."""
    message = build(tiny_model_dir, tmp_path, Dataset.from_dict({"prompt": prompts}))
    assert message == (f"train_dataset row {row}: column 'prompt' holds {shown}: accepted a string, or a list of chat "
                       "messages")  # fmt: skip


def test_an_empty_dataset_is_refused(tiny_model_dir, tmp_path):
    """Old code: trained 0 steps without a word (exit 0)."""
    message = build(tiny_model_dir, tmp_path, Dataset.from_dict({"prompt": []}))
    assert message == (
        "train_dataset has no rows (Dataset of length 0): accepted a dataset with at least one row, with a 'prompt' "
        "column"
    )
