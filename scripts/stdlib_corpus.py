"""Free English text every Python has: the docstrings and comments of the interpreter's own standard library.

The testbed model (``scripts/train_testbed_model.py``) is pretrained on it and the free-text task
(:mod:`trl_integration.demo.freetext`) draws its prompts from it (the build writes the task's texts next to the
model), so nothing is downloaded. A module of the build script, not of the package (the script puts ``scripts/``
on ``sys.path``); the held-out split, which the task also needs at run time, is
:func:`trl_integration.demo.stdlib_text.is_held_out`.

What counts as a text
    The ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` are read in sorted order of their relative path,
    skipping every folder named ``test``, ``tests`` or ``idle_test`` (test suites), ``encodings`` (codec tables,
    whose comments are thousands of Unicode character names) and ``site-packages`` / ``dist-packages``
    (third-party code where the stdlib folder holds it). From each file, in this order:

    - **docstrings**: ``ast.get_docstring(node, clean=True)`` of the module and of every class and function
      (``ast.walk`` order);
    - **comments** (``tokenize``): a run of comments that each stand alone on consecutive lines is one text (its
      lines joined by a space); a comment after code on the same line is a text of its own. The leading ``#``
      characters and surrounding whitespace are stripped.

    A text is kept if it has at least :data:`MIN_WORDS` whitespace-separated words; repeats are dropped (the first
    occurrence keeps its place). Files that do not parse (a few grammar test inputs) are skipped.

Another Python version has another standard library, hence another corpus: :func:`corpus_sha256` identifies it
(the build records it in ``build_info.json``).
"""

from __future__ import annotations

import ast
import hashlib
import io
import sysconfig
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["MIN_WORDS", "SKIPPED_FOLDERS", "stdlib_dir", "stdlib_files", "file_texts", "stdlib_texts", "corpus_sha256"]

#: A text needs at least this many whitespace-separated words (drops ``"noqa"``, ``"XXX"``, ``"type: ignore"``).
MIN_WORDS = 3

#: Folders whose files are not read: test suites, codec tables (their comments are Unicode character names) and
#: third-party packages installed inside the stdlib folder.
SKIPPED_FOLDERS = frozenset({"test", "tests", "idle_test", "encodings", "site-packages", "dist-packages"})

_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_dir() -> Path:
    """The running interpreter's standard-library folder (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The ``.py`` files under ``root`` (default: :func:`stdlib_dir`), sorted, outside :data:`SKIPPED_FOLDERS`."""
    root = stdlib_dir() if root is None else Path(root)
    files = (p for p in root.rglob("*.py") if p.is_file())
    return sorted(
        (p for p in files if not SKIPPED_FOLDERS & set(p.relative_to(root).parts[:-1])),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def _docstrings(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def _comments(source: bytes) -> Iterator[str]:
    block: list[str] = []
    last_line = -2
    for token in tokenize.tokenize(io.BytesIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        text = token.string.lstrip("#").strip()
        own_line = not token.line[: token.start[1]].strip()
        if own_line and block and token.start[0] == last_line + 1:
            block.append(text)
        else:
            if block:
                yield " ".join(block)
            block = [text]
        last_line = token.start[0] if own_line else -2  # a trailing comment starts no block
        if not own_line:
            yield " ".join(block)
            block = []
    if block:
        yield " ".join(block)


def file_texts(source: bytes) -> list[str]:
    """The docstrings, then the comments, of one Python source file (``[]`` if it does not parse)."""
    try:
        tree = ast.parse(source)
        return [*_docstrings(tree), *_comments(source)]
    except (SyntaxError, ValueError, tokenize.TokenError):
        return []


def _keep(texts: Iterable[str]) -> list[str]:
    kept = (t.strip() for t in texts)
    return list(dict.fromkeys(t for t in kept if len(t.split()) >= MIN_WORDS))


def stdlib_texts(root: Path | None = None, *, max_files: int | None = None, progress: bool = False) -> list[str]:
    """All texts of the standard library at ``root`` (default: the running interpreter's), deduplicated.

    Args:
        root: the folder to read (default :func:`stdlib_dir`).
        max_files: read only the first ``max_files`` files of :func:`stdlib_files` (for quick tests).
        progress: show a progress bar over the files (tqdm, stderr).

    Returns:
        The texts in a deterministic order (file order, then docstrings before comments), each kept once.
    """
    from tqdm.auto import tqdm

    files = stdlib_files(root)[:max_files]
    texts: list[str] = []
    for path in tqdm(files, desc="reading the stdlib", unit="file", disable=not progress, dynamic_ncols=True):
        texts.extend(file_texts(path.read_bytes()))
    return _keep(texts)


def corpus_sha256(texts: Iterable[str]) -> str:
    """SHA-256 (hex) of the texts in order, each UTF-8 encoded and followed by a NUL byte."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()
