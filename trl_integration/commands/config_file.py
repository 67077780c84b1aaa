"""The ``--config`` YAML file of ``safevocab-grpo``, read strictly before trl's parser reads it.

trl's ``TrlParser`` reads the file with ``yaml.safe_load``, which keeps the *last* value of a key written twice
(``max_steps: 2`` ... ``max_steps: 200``) without a word: the run then trains with a value the reader of the file
may not have meant. :func:`read_config` reads it with the same safe loader, refusing a repeated key (at any depth) in
one line that names the key, the file and both lines; a file that is missing or not YAML is one line too.
"""

from __future__ import annotations

import yaml

__all__ = ["read_config"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping holding a key twice (YAML 1.2 forbids it; PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        first_line: dict[object, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    raise _RepeatedKey(key, first_line[key], line)
            except TypeError:  # an unhashable key: the safe loader's own error names it
                break
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


class _RepeatedKey(Exception):
    def __init__(self, key: object, first: int, again: int):
        super().__init__(key, first, again)
        self.key, self.first, self.again = key, first, again


def read_config(path: str) -> object:
    """The content of the YAML file ``path`` (``yaml.safe_load``'s value), with every mapping's keys unique.

    Raises:
        ValueError: one line naming ``--config`` and ``path``: no such file, not readable, not YAML, or a key
            written twice (``key 'max_steps' is set twice (lines 1 and 3)``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise ValueError(f"--config {path!r}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"--config {path!r} is a directory: accepted a YAML file") from None
    except _RepeatedKey as repeated:
        raise ValueError(
            f"--config {path}: key {repeated.key!r} is set twice (lines {repeated.first} and {repeated.again}): "
            "accepted each key once (YAML keeps only the last value)"
        ) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        text = " ".join(str(err).split())
        raise ValueError(f"--config {path}: {type(err).__name__}: {text}") from None
