"""The bundled model's tokenizer: one token per character, built in code (nothing is downloaded).

A ``tokenizers`` WordLevel model whose pre-tokenizer splits every character, wrapped in a
``PreTrainedTokenizerFast``: ids 0-3 are ``<pad> <bos> <eos> <unk>``, then the ten digits, ``+ - * =`` and the
space. It adds no special token when encoding (no automatic BOS), so a prompt tokenizes to exactly its
characters, the same way during training, in trl and in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SPECIAL_TOKENS", "CHARACTERS", "build_tokenizer", "write_portable_tokenizer_class"]

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789+-*= ")


def build_tokenizer(
    *,
    specials: Sequence[str] = SPECIAL_TOKENS,
    characters: Sequence[str] = CHARACTERS,
    model_max_length: int | None = 512,
):
    """A character-level tokenizer: one token per character, after the special tokens.

    Args:
        specials: the four special tokens in id order, named ``<pad> <bos> <eos> <unk>`` whatever their order
            (default: the bundled model's, ids 0-3 in that order).
        characters: the characters, one token each, in id order after the specials (default: the bundled
            model's digits, operators and space).
        model_max_length: the tokenizer's length limit; ``None`` leaves transformers' default (no limit).

    Returns:
        A ``PreTrainedTokenizerFast``, padding on the left, adding no special token when encoding.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*specials, *characters])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    limit = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        **limit,
    )


def write_portable_tokenizer_class(path: Path) -> None:
    """Name the generic fast-tokenizer class in ``tokenizer_config.json`` at ``path``.

    transformers 5 writes its own name for it (``TokenizersBackend``), which transformers 4 (e.g. alongside
    vLLM) cannot load; both resolve ``PreTrainedTokenizerFast``.
    """
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
