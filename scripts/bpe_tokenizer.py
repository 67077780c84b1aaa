"""The testbed's tokenizer: a byte-level BPE trained with HF ``tokenizers`` on the stdlib text, digits split.

- **Vocabulary**: exactly ``vocab_size`` ids (4096 for the testbed): ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, then
  the 256 byte symbols of GPT-2's byte-level alphabet, then the merges ``BpeTrainer`` learns (most frequent pair
  first; ``min_frequency=2``) until the vocabulary is full.
- **Pre-tokenization**: every digit is its own pre-token (``Digits(individual_digits=True)``), so no merge ever
  joins two digits or a digit and anything else: a number is spelled digit by digit. The rest is GPT-2's
  byte-level split (letters, spaces before words, punctuation runs), without an added prefix space.
- **Round trip**: byte level, so every string (any Unicode) encodes without an unknown token and decodes back to
  itself exactly.
- **GRPO**: wrapped as a ``PreTrainedTokenizerFast`` with EOS ``<eos>``, a distinct pad token ``<pad>`` and left
  padding; it adds **no** special token when encoding (no automatic BOS), so a prompt is exactly its text in trl,
  vLLM and ``generate`` alike.

A module of ``scripts/train_testbed_model.py``, not of the package (the script puts ``scripts/`` on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SPECIAL_TOKENS", "MODEL_MAX_LENGTH", "train_bpe_tokenizer"]

#: ids 0, 1, 2.
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]

#: The longest sequence the tokenizer reports (RoPE has no learned positions; this bounds engines' context).
MODEL_MAX_LENGTH = 512


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """Train the byte-level BPE on ``texts``; returns it wrapped as a ``PreTrainedTokenizerFast`` (module docstring).

    Args:
        texts: the training texts (deterministic order: the merges depend on pair counts only, ties broken by
            ``tokenizers`` deterministically).
        vocab_size: the size of the vocabulary, special tokens included; at least 259 (3 special tokens and 256
            bytes). The result has exactly this size when the texts offer enough pairs seen twice.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = len(SPECIAL_TOKENS) + 256
    if not (isinstance(vocab_size, int) and vocab_size >= minimum):
        raise ValueError(f"vocab_size={vocab_size!r} is not accepted: accepted an integer >= {minimum}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="left",
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
