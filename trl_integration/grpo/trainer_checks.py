"""The checks the trainer makes once trl has built it, each a one-line error: the tokenizer, the training data, the
chat template, ZeRO-3 with fp32 rollouts (:func:`check_built_trainer` runs them in order).

**Training data** (:func:`check_train_dataset`, when the trainer is built): trl reads each row's ``prompt``; a
dataset without that column failed with a bare ``KeyError: 'prompt'`` in the first generation step, an empty-string
prompt with an ``IndexError`` inside ``generate`` (a prompt of no tokens), and an empty dataset trained 0 steps without
a word. Each is one line naming the column (and the dataset's columns) or the row.

**Tokenizer** (:func:`check_tokenizer`, when the trainer is built): what trl repairs itself is accepted; what it
cannot repair, which would otherwise fail deep inside the first generation step (a ``None`` id in a tensor) or train
on garbage, is refused:

- an **EOS token**: completions end at it and trl cuts the completion mask after it. A tokenizer without one
  (``eos_token_id is None``) is refused.
- a **pad token**: batches are padded with it. trl borrows the EOS token when it is missing, so the pad token
  is required only where there is no EOS token either, and the EOS check covers it.
- **left padding** for a processor (vision-language models), whose ``padding=True`` call trl leaves to the
  tokenizer: right padding there puts pad tokens between the prompt and the completion. trl left-pads text
  prompts itself whatever the tokenizer's ``padding_side``, so a text tokenizer's side is not checked.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_tokenizer", "check_chat_template", "first_example", "check_train_dataset", "check_zero3_rollout_dtype",
           "check_built_trainer"]  # fmt: skip


def check_tokenizer(processing_class: Any) -> None:
    """Raise ``ValueError`` (one line: the attribute, its value, what is accepted) if ``processing_class`` (a
    tokenizer, or a processor holding one as ``.tokenizer``) cannot serve GRPO; ``None`` (trl will load one) passes.
    """
    if processing_class is None:
        return
    tokenizer = getattr(processing_class, "tokenizer", None)
    is_processor = tokenizer is not None
    tokenizer = tokenizer if is_processor else processing_class
    name = type(tokenizer).__name__
    if tokenizer.eos_token_id is None:
        pad = "" if tokenizer.pad_token_id is None else f" (pad token {tokenizer.pad_token!r} alone does not do)"
        raise ValueError(
            f"tokenizer.eos_token_id=None ({name}) is not accepted: GRPO ends completions at the EOS token and pads "
            f"with it when there is no pad token{pad}; accepted a token of the vocabulary, set before building the "
            "trainer: tokenizer.eos_token = '<eos>'"
        )
    if is_processor and tokenizer.padding_side != "left":
        raise ValueError(
            f"processing_class.tokenizer.padding_side={tokenizer.padding_side!r} ({name}) is not accepted: a "
            "processor's prompts must be left-padded for generation; accepted 'left' (load the processor with "
            "padding_side='left')"
        )


# ----------------------------------------------------------------------------------------------------
# logging integrations


def first_example(dataset: Any) -> dict | None:
    if dataset is None or isinstance(dataset, dict):  # no dataset, or several eval sets: nothing to look at
        return None
    if hasattr(dataset, "__len__"):
        return dataset[0] if len(dataset) else None
    return next(iter(dataset), None)  # an IterableDataset: its first row (it is read again from the start later)


def check_chat_template(processing_class: Any, dataset: Any, tokenizer_of: str = "the tokenizer") -> None:
    """Raise ``ValueError`` (one line) when ``dataset``'s prompts are conversational (lists of messages, trl's
    ``is_conversational``) and ``processing_class`` has no chat template to render them with: transformers would
    refuse it only in the first generation step ("tokenizer.chat_template is not set")."""
    example = first_example(dataset)
    if processing_class is None or not isinstance(example, dict):
        return
    from trl.data_utils import is_conversational

    if not is_conversational(example):
        return
    tokenizer = getattr(processing_class, "tokenizer", None) or processing_class
    if getattr(processing_class, "chat_template", None) is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the 'prompt' column is conversational (a list of messages), but {tokenizer_of} "
            f"({type(tokenizer).__name__}) has no chat_template: accepted plain-text prompts, or a tokenizer with a "
            "chat template (an instruct model's, or set tokenizer.chat_template and save_pretrained)"
        )


def check_train_dataset(dataset: Any, environments: bool = False) -> None:
    """Raise ``ValueError`` (one line) when trl cannot train on ``dataset``: no rows, no ``prompt`` column (naming the
    columns it has), a prompt that is not a string or a list of messages (an int, ``None``), or an empty prompt (an
    empty string or an empty list of messages); naming the first such row.
    ``None`` (no dataset) and datasets without a length or columns (an ``IterableDataset``: its first row only) are
    checked as far as they can be without reading them whole. With ``environments`` (trl's ``environment_factory``,
    whose ``reset()`` may supply the prompt) only the rows are required."""
    if dataset is None:
        return
    sized = hasattr(dataset, "__len__")
    if sized and len(dataset) == 0:
        raise ValueError(f"train_dataset has no rows ({type(dataset).__name__} of length 0): accepted a dataset with at "
                         "least one row, with a 'prompt' column")  # fmt: skip
    if environments:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        example = first_example(dataset)
        columns = list(example) if isinstance(example, dict) else None
    if columns is not None and "prompt" not in columns:
        raise ValueError(f"train_dataset has no 'prompt' column, which GRPO generates from: it has {list(columns)}; "
                         "rename the column holding the prompts (dataset.rename_column('question', 'prompt'))")  # fmt: skip
    if columns is None:
        return
    prompts = dataset["prompt"] if sized and hasattr(dataset, "column_names") else [first_example(dataset)["prompt"]]
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, list)):  # an int or None reached the tokenizer, whose message named no row
            raise ValueError(f"train_dataset row {index}: column 'prompt' holds {type(prompt).__name__} {prompt!r}: "
                             "accepted a string, or a list of chat messages")  # fmt: skip
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise ValueError(f"train_dataset row {index}: prompt={prompt!r} is empty: accepted a non-empty prompt "
                             "(text, or a list of messages); drop or fill the empty rows "
                             "(dataset.filter(lambda row: len(row['prompt']) > 0))")  # fmt: skip


def check_zero3_rollout_dtype(args, model) -> None:
    """DeepSpeed ZeRO-3: the safe head gathers the partitioned LM-head weight around its forward and,
    through ``fused_safe_logprobs``' ``weight_gather`` hook, again around its backward
    (:mod:`trl_integration.grpo.head`). What cannot work on partitioned parameters is the in-place upcast of a
    ``rollout_dtype="float32"`` rollout over lower-precision weights (``model``'s), refused here."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled() or args.rollout_dtype != "float32":
        return
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError(
            "rollout_dtype='float32' upcasts lower-precision parameters in place for the rollout, which DeepSpeed "
            "ZeRO-3's partitioned parameters do not allow: use rollout_dtype='auto' under ZeRO-3, load the model "
            "in float32, or use ZeRO-2 / FSDP2 for fp32 rollouts"
        )


def check_built_trainer(trainer) -> None:
    """The checks that need what trl built, in one line each: the tokenizer it loaded, the train dataset's rows and
    prompts, a chat template for conversational prompts, ZeRO-3 with fp32 rollouts."""
    check_tokenizer(trainer.processing_class)  # the one trl loaded, when none was given
    check_train_dataset(trainer.train_dataset, trainer.environment_factories is not None)
    check_chat_template(trainer.processing_class, trainer.train_dataset)  # not at the first generation step
    check_zero3_rollout_dtype(trainer.args, trainer.model)  # fp32 rollouts upcast in place: not on ZeRO-3
