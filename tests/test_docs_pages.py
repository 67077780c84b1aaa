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
