"""The docs say what is true about themselves and about installing (issue 18, part B, point 7): the page lists
of README.md and docs/index.md are mkdocs' nav, every page is in the nav, the install section names every extra,
and no install line asks the package index for safevocab (it is not on PyPI)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def _nav() -> list[str]:
    """The pages of mkdocs.yml's nav, in order."""
    pages = []
    for entry in yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]:
        pages.extend(entry.values())
    return pages


def _section(text: str, heading: str) -> str:
    """The body of a ``## heading`` section of a Markdown file."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_every_docs_page_is_in_the_nav():
    assert sorted(_nav()) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))


def test_readme_lists_the_nav_in_order():
    listed = re.findall(r"^- \[[^]]+\]\(docs/([\w.]+\.md)\)", _section((ROOT / "README.md").read_text(), "Documentation"),
                        flags=re.M)  # fmt: skip
    assert listed == _nav()


def test_the_home_page_lists_every_other_page_in_order():
    listed = re.findall(r"^\| \[[^]]+\]\(([\w.]+\.md)\)", _section((ROOT / "docs/index.md").read_text(), "Pages"),
                        flags=re.M)  # fmt: skip
    assert listed == [page for page in _nav() if page != "index.md"]


def test_the_install_section_names_every_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = _section((ROOT / "README.md").read_text(), "Install")
    assert [name for name in extras if f"`{name}`" not in install] == []


def test_no_install_line_asks_the_index_for_safevocab():
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    asks = [f"{p.name}: {line.strip()}" for p in pages for line in p.read_text().splitlines()
            if re.search(r"pip install\s+['\"]?safevocab\b", line)]  # fmt: skip
    assert asks == []


#: Modules docs/api.md renders whole: every name of their ``__all__`` is stable.
API_WHOLE_MODULES = {"safevocab.bounds"}
#: Internal names that must never appear on the stable page (they were rendered there before issue 55).
INTERNAL_NAMES = ("SafeHeadState", "finite_floor", "print_order", "ShiftedLogits", "MetricRow", "SafeTokenStats")


def _api_blocks() -> dict[str, list[str] | None]:
    """``{module: its listed members (None: the whole module)}`` of docs/api.md's ``:::`` blocks."""
    blocks: dict[str, list[str] | None] = {}
    module = None
    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        if line.startswith("::: "):
            module = line[4:].strip()
            blocks[module] = None
        elif module and (match := re.match(r"^ {8}- (\w+)$", line)):
            blocks[module] = [*(blocks[module] or []), match.group(1)]
    return blocks


def test_the_api_page_renders_stable_names_only():
    """Every module on docs/api.md lists the stable names it shows (or is whole-module stable); each listed name
    exists; the exceptions a run raises or warns are on it; the internals are not."""
    import importlib

    blocks = _api_blocks()
    assert {m for m, names in blocks.items() if names is None} == API_WHOLE_MODULES
    for module, names in blocks.items():
        for name in names or []:
            assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    listed = {name for names in blocks.values() for name in names or []}
    assert {"OutOfSetWarning", "NothingToTrainError", "HardenedSafeVocabGRPOTrainer"} <= listed
    assert not listed & set(INTERNAL_NAMES)
