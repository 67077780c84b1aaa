"""The experimental packages warn once at import (as ``trl.experimental``); one variable silences them.

Each check needs a fresh interpreter (a warning given once per process), and each interpreter imports trl's whole
stack (~8 CPU-seconds): the two processes below check both packages at once, where six did before (the silenced
imports run in the stable faces' process, after its own check: the variable is read at each warning).
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


def test_each_experimental_package_warns_once_and_the_variable_silences_them():
    imports = "; ".join(
        f"import {package}, {package}.report; importlib.reload({package})" for package in PACKAGES
    )  # imported and reloaded: still one warning each
    warned = stderr_of(f"import importlib; {imports}")
    for package in PACKAGES:
        assert warned.count(f"{package} is experimental") == 1, warned
    assert warned.count("ExperimentalWarning") == len(PACKAGES) and SILENCE_VARIABLE in warned


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


def test_the_stable_faces_and_the_commands_do_not_warn_and_the_variable_silences_the_packages():
    """The stable faces and the commands import without a warning; then, in the same fresh process, the experimental
    packages re-imported with the variable set and the once-per-process record cleared (a warning was due) give none
    either."""
    code = (
        "import contextlib, importlib, io, os, sys\n"
        "import trl_integration.grpo.trainer, trl_integration.harness\n"
        "print('-- the commands --', file=sys.stderr)\n"
        "from trl_integration.commands import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['study', '--help'])\n"
        "print('-- silenced --', file=sys.stderr)\n"
        "import trl_integration.experimental\n"
        "trl_integration.experimental._warned.clear()\n"
        f"os.environ[{SILENCE_VARIABLE!r}] = '1'\n"
        f"for name in {PACKAGES!r}:\n"
        "    importlib.reload(importlib.import_module(name))\n"
    )
    stderr = stderr_of(code)
    assert "-- the commands --" in stderr and "-- silenced --" in stderr and "is experimental" not in stderr, stderr
