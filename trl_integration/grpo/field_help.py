"""Each config field's ``--help`` text, read from the class docstring: one description per field, not two copies.

trl documents a config's fields in its docstring (``name (`type`, defaults to ...):`` then an indented description,
grouped under ``> Parameters that control ...`` lines), and repeats each description in the field's
``metadata["help"]`` for the command line. ``SafeVocabGRPOConfig`` writes its descriptions once, in the docstring
(which the API reference renders); :func:`fill_field_help` gives each field the help text of its entry, and refuses a
field the docstring does not describe. ``safevocab-grpo``'s early checks read the same entries from the source
(:func:`docstring_help`), before anything heavy is imported. Pure Python: no torch, no trl.
"""

from __future__ import annotations

import dataclasses
import re
from types import MappingProxyType

__all__ = ["docstring_help", "fill_field_help"]

# `name (`type`, defaults to ...):` at the entries' indentation; the description follows, indented deeper.
_ENTRY = re.compile(r"^(?P<indent>\s*)(?P<name>[A-Za-z_]\w*) \((?P<spec>.*)\):\s*$")
# Sphinx roles (:func:`~a.b.c`, :mod:`x`) read as their last name on a terminal.
_ROLE = re.compile(r":\w+:`~?(?:[\w.]*\.)?([\w]+)`")


def docstring_help(doc: str) -> dict[str, str]:
    """``{field: description}`` of the trl-style field entries of ``doc`` (descriptions joined into one line, Sphinx
    roles reduced to their names)."""
    entries: dict[str, list[str]] = {}
    name, indent = None, 0
    for line in doc.splitlines():
        match = _ENTRY.match(line)
        if match and (name is None or len(match["indent"]) <= indent):
            name, indent = match["name"], len(match["indent"])
            entries[name] = []
            continue
        stripped = line.strip()
        if name is None:
            continue
        if not stripped or stripped.startswith(">") or len(line) - len(line.lstrip()) <= indent:
            name = None  # a blank line, a group line or a dedent ends the entry
            continue
        entries[name].append(stripped)
    return {key: _ROLE.sub(r"\1", " ".join(lines)) for key, lines in entries.items() if lines}


def fill_field_help(cls: type) -> type:
    """Give each field ``cls`` itself declares the help text of its docstring entry (``metadata["help"]``, which
    transformers' ``HfArgumentParser`` shows in ``--help``). ``TypeError`` naming a field the docstring lacks."""
    described = docstring_help(cls.__doc__ or "")
    own = cls.__dict__.get("__annotations__", {})
    missing = [f.name for f in dataclasses.fields(cls) if f.name in own and f.init and f.name not in described]
    if missing:
        raise TypeError(f"{cls.__name__}: fields {missing} have no entry in the class docstring (accepted: every field "
                        "documented there, as 'name (`type`, defaults to ...):' and an indented description)")  # fmt: skip
    for f in dataclasses.fields(cls):
        if f.name in own and "help" not in f.metadata:
            f.metadata = MappingProxyType({**f.metadata, "help": described[f.name]})
    return cls
