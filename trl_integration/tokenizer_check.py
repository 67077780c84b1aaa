"""The tokenizer requirements of GRPO, checked at trainer construction with a one-line ``ValueError``.

What trl repairs itself is accepted; what it cannot repair, which would otherwise fail deep inside the first
generation step (a ``None`` id in a tensor) or train on garbage, is refused:

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

__all__ = ["check_tokenizer"]


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
