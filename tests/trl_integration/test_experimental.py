"""The experimental packages warn once at import (as ``trl.experimental``); one variable silences them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trl_integration.experimental import SILENCE_VARIABLE


def stderr_of(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != SILENCE_VARIABLE} | env
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.parametrize("package", ["trl_integration.lab", "trl_integration.study"])
def test_an_experimental_package_warns_once_and_the_variable_silences_it(package):
    warned = stderr_of(f"import {package}; import importlib, {package}.report; importlib.reload({package})")
    assert warned.count(f"{package} is experimental") == 1  # once, though imported (and reloaded) again
    assert "ExperimentalWarning" in warned and SILENCE_VARIABLE in warned
    assert "is experimental" not in stderr_of(f"import {package}", **{SILENCE_VARIABLE: "1"})


def test_the_stable_faces_and_the_commands_do_not_warn():
    assert "is experimental" not in stderr_of("import trl_integration.grpo.trainer, trl_integration.harness")
    code = (
        "import contextlib, io\n"
        "from trl_integration.commands import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['study', '--help'])\n"
    )
    assert "is experimental" not in stderr_of(code)
