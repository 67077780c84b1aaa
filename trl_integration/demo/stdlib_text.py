"""The held-out split of the standard-library texts: which docstrings and comments the testbed never saw.

The testbed model (:mod:`trl_integration.demo.testbed`) is pretrained on the docstrings and comments of the
interpreter's standard library (read by ``scripts/stdlib_corpus.py`` when ``scripts/train_testbed_model.py``
builds it) except the held-out ones; the free-text task (:mod:`trl_integration.demo.freetext`) draws its held-out
prompts from the held-out texts only and its training prompts from the others.

The held-out split
    A text is *held out* iff the first 8 bytes of its SHA-256, read as a big-endian integer, fall in the first
    :data:`HELD_OUT_FRACTION` of their range: a property of the text itself, independent of the Python version,
    the order or any seed. Held-out texts are never pretrained on; the free-text task's held-out prompts come
    from them and its training prompts from the rest.
"""

from __future__ import annotations

import hashlib

__all__ = ["HELD_OUT_FRACTION", "is_held_out"]

#: Fraction of the texts held out from pretraining (and used for the free-text task's held-out prompts).
HELD_OUT_FRACTION = 0.05

_HASH_RANGE = 2**64


def is_held_out(text: str, fraction: float = HELD_OUT_FRACTION) -> bool:
    """Whether ``text`` is in the held-out split (a hash of the text; see the module docstring)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * _HASH_RANGE
