"""``safevocab study --resume``: run a long study in pieces, on one output folder.

A resumed study reads the ``results.json`` its folder already holds and keeps every run there whose status is
``ok``; only the other (arm, seed) runs of its plan are trained. It refuses, in one line naming the first setting
that differs, to mix runs trained under different settings:

- every setting must equal the recorded one (older files lack newer settings: those count as their defaults),
  except :data:`FREE_SETTINGS`: ``arms`` and ``seeds`` (a resumed study may add arms and seeds, but must keep every
  finished run in its plan, so that no finished run is dropped), and ``smooth``, ``threads`` and ``output_dir``,
  which change how a study runs or is drawn, not what a run does;
- an arm's ``SafeVocabGRPOConfig`` overrides must equal those its finished runs were trained with (a Python
  caller's ``arm_configs``).

Without a ``results.json`` in the folder, a resumed study is a new one.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trl_integration.study.arms import StudySettings

__all__ = ["FREE_SETTINGS", "finished_runs"]

#: Settings that may differ between the pieces of one study.
FREE_SETTINGS = ("arms", "seeds", "smooth", "threads", "output_dir")


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from ``results.json`` (tuples become lists, ...)."""
    return json.loads(json.dumps(value))


def finished_runs(
    path: str | Path, settings: StudySettings, arms: dict[str, dict[str, Any]], task_name: str
) -> dict[tuple[str, int], dict]:
    """The ``ok`` runs of the study recorded in ``path``, keyed by ``(arm, seed)``, after checking that they were
    trained under ``settings`` (resolved as the new study runs them) and ``arms`` (the overrides per arm).

    Raises:
        ValueError: one line, when a setting, the task or an arm's overrides differ, or a finished run is not in
            the new plan (``settings.arms`` x ``settings.seeds``).
    """
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        recorded = {**asdict(StudySettings()), **old["settings"]}
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--resume: {path} is not the results.json of a study ({type(err).__name__}: {err})") from err
    for name, value in _as_json(asdict(settings)).items():
        if name not in FREE_SETTINGS and recorded.get(name) != value:
            raise ValueError(
                f"--resume: --{name} is {value!r} but the runs in {path} were trained with {recorded.get(name)!r}: "
                "pass the same value, or another --output_dir"
            )
    old_task = (old.get("task") or {}).get("name", "arithmetic")
    if old_task != task_name:
        raise ValueError(f"--resume: the task is {task_name!r} but the runs in {path} were trained on {old_task!r}")
    runs = {}
    for run in old.get("runs", []):
        if run.get("status") != "ok":
            continue
        arm, seed = run["arm"], run["seed"]
        if arm not in settings.arms or seed not in settings.seeds:
            raise ValueError(
                f"--resume: {path} holds the finished run of arm {arm!r} seed {seed}, which --arms/--seeds leave out: "
                "pass a superset of the recorded arms and seeds"
            )
        if _as_json(arms[arm]) != old["arms"].get(arm):
            raise ValueError(
                f"--resume: arm {arm!r} is configured as {arms[arm]} but its runs in {path} were trained with "
                f"{old['arms'].get(arm)}"
            )
        runs[(arm, seed)] = run
    return runs
