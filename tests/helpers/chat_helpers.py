"""A tool-calling chat tokenizer built in code, for the trl conformance tests (tools, environments, multi-turn).

Character-level like ``trl_helpers.build_tokenizer``, plus the Qwen3 special tokens (``<|im_start|>``,
``<|im_end|>``, ``<tool_call>``, ...) and trl's own Qwen3 chat template, so that trl recognises the template,
renders tools into prompts and parses ``<tool_call>`` JSON from completions (``trl.chat_template_utils``). Nothing is
downloaded.
"""

from __future__ import annotations

import string

CHAT_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
CHAT_CHARS = sorted(set(string.printable) - set("\x0b\x0c\r"))


def build_chat_tokenizer():
    """A ``PreTrainedTokenizerFast`` with trl's Qwen3 chat template: one token per character or special token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    vocab = {tok: i for i, tok in enumerate(["<unk>", *CHAT_SPECIALS, *CHAT_CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # newlines too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.chat_template = qwen3_chat_template
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
