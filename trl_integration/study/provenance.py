"""Which code a study ran: the git commit and whether the tree was clean, recorded where the study runs.

:func:`code_version` is taken by :func:`~trl_integration.study.run.run_study` when it starts (``results["code"]``)
and copied into every run it trains (``run["code"]``), so a study trained in pieces with ``--resume`` keeps, run by
run, the version each piece came from. :func:`check_code_versions` is what an analysis calls before combining
records: it refuses runs from different commits, or from a tree with uncommitted changes, unless told.

A record written before this existed has no ``code``; such runs count as "not recorded" (a commit of their own:
mixing them with recorded runs is refused like two different commits).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["NOT_RECORDED", "code_version", "run_code_versions", "check_code_versions", "add_code_version_flags"]

#: The commit a run without a ``code`` record counts as.
NOT_RECORDED = "not recorded"

#: The checkout this package runs from (``trl_integration/study/provenance.py`` -> the repository root).
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def code_version(root: str | Path | None = None) -> dict[str, Any]:
    """``{"commit": git rev-parse HEAD, "clean": git status --porcelain is empty, "dirty": its first lines}`` of the
    checkout at ``root`` (default: the one this package is imported from); commit and clean are ``None`` when it is
    not a git checkout (an installed package) or git is missing."""
    root = Path(root) if root is not None else _PACKAGE_ROOT
    head = _git(["rev-parse", "HEAD"], root)
    if head is None:
        return {"commit": None, "clean": None, "dirty": [], "root": str(root)}
    status = _git(["status", "--porcelain", "--untracked-files=normal"], root)
    changed = [line for line in (status or "").splitlines() if line.strip()]
    return {
        "commit": head.strip(),
        "clean": status is not None and not changed,
        "dirty": changed[:20],
        "root": str(root),
    }


def run_code_versions(results: dict, label: str = "") -> list[tuple[str, str, bool | None]]:
    """``(where, commit, clean)`` of every finished run of a study's ``results`` (``where``: ``label arm seed``)."""
    out = []
    top = results.get("code")
    for run in results.get("runs", []):
        if run.get("status") != "ok":
            continue
        code = run.get("code") or top or {}
        commit = code.get("commit") or NOT_RECORDED
        out.append((f"{label}{run['arm']} seed {run['seed']}".strip(), commit, code.get("clean")))
    return out


def check_code_versions(
    studies: Iterable[tuple[str, dict]], *, allow_mixed_commits: bool = False, allow_dirty: bool = False
) -> dict[str, Any]:
    """Check that the finished runs of ``studies`` (``(label, results)`` pairs) come from one commit and clean trees.

    Returns:
        ``{"commits": {commit: number of runs}, "dirty_runs": [where, ...], "mixed": bool}``.

    Raises:
        ValueError: one line, when the runs come from more than one commit (runs without a record count as the
            commit ``"not recorded"``) and not ``allow_mixed_commits``, or when a run's tree had uncommitted changes
            and not ``allow_dirty``.
    """
    commits: dict[str, list[str]] = {}
    dirty: list[str] = []
    for label, results in studies:
        for where, commit, clean in run_code_versions(results, f"{label}: " if label else ""):
            commits.setdefault(commit, []).append(where)
            if clean is False:
                dirty.append(where)
    if len(commits) > 1 and not allow_mixed_commits:
        listed = "; ".join(
            f"{c[:12] if c != NOT_RECORDED else c}: {len(w)} runs (e.g. {w[0]})" for c, w in commits.items()
        )
        raise ValueError(
            f"the records come from {len(commits)} code versions ({listed}): accepted one commit, or "
            "pass --allow_mixed_commits"
        )
    if dirty and not allow_dirty:
        raise ValueError(
            f"{len(dirty)} runs were trained from a tree with uncommitted changes (e.g. {dirty[0]}): "
            "accepted clean trees only, or pass --allow_dirty"
        )
    return {"commits": {c: len(w) for c, w in commits.items()}, "dirty_runs": dirty, "mixed": len(commits) > 1}


def add_code_version_flags(parser) -> None:
    """An analysis script's ``--allow_mixed_commits`` and ``--allow_dirty`` (the opt-outs of
    :func:`check_code_versions`), on its ``argparse`` parser."""
    parser.add_argument(
        "--allow_mixed_commits",
        action="store_true",
        help="analyse runs recorded from different commits (refused by default)",
    )
    parser.add_argument(
        "--allow_dirty",
        action="store_true",
        help="analyse runs trained from a tree with uncommitted changes (refused by default)",
    )
