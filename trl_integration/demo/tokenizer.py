"""The bundled model's tokenizer: one token per character, built in code (nothing is downloaded).

A ``tokenizers`` WordLevel model whose pre-tokenizer splits every character, wrapped in a
``PreTrainedTokenizerFast``: ids 0-3 are ``<pad> <bos> <eos> <unk>``, then the ten digits, ``+ - * =`` and the
space. It adds no special token when encoding (no automatic BOS), so a prompt tokenizes to exactly its
characters, the same way during training, in trl and in vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SPECIAL_TOKENS", "CHARACTERS", "build_tokenizer", "write_portable_tokenizer_class"]

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789+-*= ")


def build_tokenizer():
    """The character-level tokenizer: one token per character, ids 0-3 are ``<pad> <bos> <eos> <unk>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def write_portable_tokenizer_class(path: Path) -> None:
    """Name the generic fast-tokenizer class in ``tokenizer_config.json`` at ``path``.

    transformers 5 writes its own name for it (``TokenizersBackend``), which transformers 4 (e.g. alongside
    vLLM) cannot load; both resolve ``PreTrainedTokenizerFast``.
    """
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
