"""``pytest --compile-for sm_90``: every Triton launch the tests run under the interpreter is also compiled for that GPU
(:mod:`safevocab.testing.offline_compile`); the session fails, with a line per specialisation, if the compiler rejects
one. For the kernel test files, in a process of their own::

    pytest --compile-for sm_90 -p no:randomly tests/safevocab/test_kernels.py tests/safevocab/test_threshold_select_kernel.py

The check starts before any test module imports Triton (``TRITON_INTERPRET=1`` is set here, so the kernels are
interpreted ones), and it compiles each specialisation once (a few seconds each; Triton's cache keeps them)."""

from __future__ import annotations

import os

import pytest

from safevocab.testing.offline_compile import CompileFailure, OfflineCompile, parse_target

#: Constexprs a GPU launch takes where the interpreter's differs (see OfflineCompile.overrides): the decide kernel's
#: libdevice exp/log (LIBM) and its in-kernel sort of the candidates (SORT; under the interpreter torch sorts them).
GPU_CONSTEXPRS = {"LIBM": True, "SORT": True}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compile-for",
        default=None,
        metavar="SM",
        help="also compile every interpreted Triton launch for this GPU architecture (e.g. sm_90); fail on a "
        "rejected one",
    )


def pytest_configure(config: pytest.Config) -> None:
    target = config.getoption("--compile-for")
    if not target:
        return
    try:
        parse_target(target)
    except ValueError as err:
        raise pytest.UsageError(f"--compile-for: {err}") from None
    if getattr(config.option, "numprocesses", None):
        # pytest-xdist's workers would each compile, and the controller would not see their rejections
        raise pytest.UsageError("--compile-for: accepted in one process only; drop -n/--numprocesses")
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: the launches the check sees are these
    config._offline_compile = OfflineCompile(target, overrides=GPU_CONSTEXPRS).__enter__()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    check = getattr(config, "_offline_compile", None)
    if check is not None:
        terminalreporter.section(f"compiled for {check.target}")
        terminalreporter.write_line(check.report())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    check = getattr(session.config, "_offline_compile", None)
    if check is not None:
        check.__exit__(None, None, None)
        nothing = session.testscollected > 0 and not check.compiled and not check.failures
        if nothing:  # the hook never fired (kernels compiled before the option took effect, a Triton that moved)
            check.failures.append(CompileFailure("(none)", "", "no launch was compiled: the check did not run"))
        if check.failures and session.exitstatus == 0:
            session.exitstatus = 1
