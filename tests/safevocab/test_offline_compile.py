"""``safevocab.testing.offline_compile`` and ``pytest --compile-for``: interpreted Triton launches compiled for a GPU
on a CPU. Each check runs in a fresh interpreter (the check must start before any kernel has run in its process)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from safevocab.testing.offline_compile import parse_target

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"


def _env(cache: Path) -> dict[str, str]:
    """The subprocess's environment: the fixtures importable, and Triton's kernel cache of its own (a kernel compiled
    by an earlier run would come from the cache, not the compiler)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS), str(ROOT)]), "TRITON_CACHE_DIR": str(cache)}


def _python(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**_env(cache), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)  # fmt: skip


def test_parse_target_names_the_argument():
    assert parse_target("sm_90") == ("cuda", 90) and parse_target("sm_100a") == ("cuda", 100)
    with pytest.raises(ValueError, match=r"compile target='hopper': accepted a CUDA architecture such as 'sm_90'"):
        parse_target("hopper")


def test_compiles_each_launch_for_the_gpu_and_records_what_the_compiler_rejects(tmp_path):
    # row_sums compiles (a @triton.jit helper, Triton's own tl.cdiv/tl.sum), in three dtypes, the last two after the
    # interpreter has run a helper (which leaves triton.language patched: fp16's cast then fails to compile unless the
    # check puts the language back); plus_one runs under the interpreter but is no GPU kernel: the check records it,
    # and the interpreter's values are still computed. Then, the language left patched, a new check refuses to start.
    proc = _python(
        """
        import json, torch
        import triton.language
        from safevocab.testing.offline_compile import OfflineCompile
        with OfflineCompile("sm_90") as check:
            import compile_check_kernels as k
            x = torch.arange(40.0).reshape(2, 20)
            sums = [k.row_sums(x).tolist(), k.row_sums(x.double()).tolist(), k.row_sums(x.half()).tolist(),
                    k.row_sums(x).tolist()]
            shifted = k.row_sums(torch.arange(41.0)[1:].reshape(2, 20)).tolist()  # 4 bytes off 16: not aligned
            plus_one = k.plus_one(torch.zeros(64))
        try:
            OfflineCompile("sm_90").__enter__()
            refused = ""
        except RuntimeError as err:
            refused = str(err)
        print(json.dumps({"sums": sums, "shifted": shifted, "plus_one": plus_one.sum().item(),
                          "compiled": sorted(check.compiled),
                          "failures": [[f.kernel, f.error] for f in check.failures], "report": check.report(),
                          "refused": refused}))
    """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sums"] == [[190.0, 590.0]] * 4 and out["shifted"] == [210.0, 610.0] and out["plus_one"] == 64.0
    # fp32, fp64, fp16 and the unaligned fp32 pointer: Triton's own specialisations, each compiled once
    assert [name for name, _ in out["compiled"]] == ["_row_sums_kernel"] * 4, out["compiled"]
    assert len(out["failures"]) == 1, out
    kernel, error = out["failures"][0]
    assert kernel == "_plus_one_kernel" and "_add_one" in error, error
    assert out["report"].endswith("4 specialisation(s) compiled for sm_90")
    assert out["refused"].startswith("OfflineCompile: triton.language is patched by the interpreter already"), out


@pytest.mark.slow  # ~4 CPU-s, two pytest processes; the fast guard of the check: the test above with OfflineCompile
def test_pytest_option_fails_the_session_on_a_kernel_the_compiler_rejects(tmp_path):
    # the tests themselves pass (the interpreter's values are right); the session fails and names the kernel
    (tmp_path / "test_kernels_here.py").write_text(
        textwrap.dedent("""
        import torch
        def test_interpreted_values():
            import compile_check_kernels as k
            assert k.row_sums(torch.ones(2, 20)).tolist() == [20.0, 20.0]
            assert k.plus_one(torch.zeros(64)).sum().item() == 64.0
    """)
    )
    env = _env(tmp_path / "cache")
    env.pop("TRITON_INTERPRET", None)  # the option sets it
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "offline_compile_plugin",
           "--compile-for", "sm_90", str(tmp_path / "test_kernels_here.py")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert "1 passed" in proc.stdout, proc.stdout[-3000:]
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "compiled for sm_90" in proc.stdout and "_plus_one_kernel(" in proc.stdout
    bad = subprocess.run(
        [*cmd[:9], "sm_9", cmd[-1]], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )
    assert bad.returncode == 4 and "--compile-for: compile target='sm_9'" in bad.stderr, bad.stderr[-2000:]
    # a session whose tests launched no kernel compiled nothing: that fails too (the check did not run)
    (tmp_path / "test_no_kernels.py").write_text("def test_nothing():\n    assert True\n")
    empty = subprocess.run([*cmd[:-1], str(tmp_path / "test_no_kernels.py")], capture_output=True, text=True, env=env,
                           timeout=300, cwd=tmp_path)  # fmt: skip
    assert empty.returncode == 1 and "no launch was compiled" in empty.stdout, empty.stdout[-2000:]
