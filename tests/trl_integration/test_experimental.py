"""The experimental packages warn once at import (as ``trl.experimental``); one variable silences them.

Each check needs a fresh interpreter (a warning given once per process), and each interpreter imports trl's whole
stack (~8 CPU-seconds): one process checks all three in turn (six did at first, then two), each step starting from
the state a fresh process has for it: the stable faces first, before any experimental package is imported; then the
packages, with the once-per-process record cleared and the variable that the commands set for their own process
removed; then the variable, with the record cleared again.
"""

from __future__ import annotations

import os
import subprocess
import sys

from trl_integration.experimental import SILENCE_VARIABLE, warn_experimental

PACKAGES = ("trl_integration.lab", "trl_integration.study")


def stderr_of(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != SILENCE_VARIABLE} | env
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_the_variable_is_read_at_each_warning(monkeypatch, recwarn):
    """In this process: the variable's accepted spellings silence, anything else does not, and a package warns once."""
    monkeypatch.setattr("trl_integration.experimental._warned", set())
    for value in ("1", "true", "YES "):
        monkeypatch.setenv(SILENCE_VARIABLE, value)
        warn_experimental("some.package")
    assert not recwarn.list
    monkeypatch.setenv(SILENCE_VARIABLE, "0")
    warn_experimental("some.package")
    warn_experimental("some.package")
    assert [str(w.message).split(":")[0] for w in recwarn.list] == ["some.package is experimental"]


def test_the_stable_faces_do_not_warn_each_package_warns_once_and_the_variable_silences_them():
    """In one fresh process: the stable faces and the commands import without a warning; each experimental package
    then warns once (imported with its ``report`` module, reloaded: still once); with the variable set and the record
    cleared (a warning was due), re-importing them gives none."""
    reimport = "; ".join(
        f"importlib.reload(importlib.import_module({p!r})); importlib.import_module({p + '.report'!r}); "
        f"importlib.reload(importlib.import_module({p!r}))"
        for p in PACKAGES
    )
    code = (
        "import contextlib, importlib, io, os, sys\n"
        "import trl_integration.grpo.trainer, trl_integration.harness\n"
        "from trl_integration.commands import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['study', '--help'])\n"
        "import trl_integration.experimental as experimental\n"
        "print('-- the packages --', file=sys.stderr)\n"
        "experimental._warned.clear()\n"
        f"os.environ.pop({SILENCE_VARIABLE!r}, None)\n"
        f"{reimport}\n"
        "print('-- silenced --', file=sys.stderr)\n"
        "experimental._warned.clear()\n"
        f"os.environ[{SILENCE_VARIABLE!r}] = '1'\n"
        f"{reimport}\n"
    )
    stderr = stderr_of(code)
    stable, _, rest = stderr.partition("-- the packages --")
    warned, _, silenced = rest.partition("-- silenced --")
    assert "is experimental" not in stable and rest and warned, stderr
    for package in PACKAGES:
        assert warned.count(f"{package} is experimental") == 1, warned
    assert warned.count("ExperimentalWarning") == len(PACKAGES) and SILENCE_VARIABLE in warned
    assert "is experimental" not in silenced, silenced
