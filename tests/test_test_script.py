"""``scripts/test.sh`` (issue 31 points 1 and 5): pytest on one thread unless the user chose, a line per step, and
pytest's progress as a count. The real script runs against a stand-in venv whose ``python`` and ``mkdocs`` only report
how they were called, so nothing is installed and no suite runs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
if [[ "$1" == "-V" ]]; then echo "Python 3.11.0"; exit 0; fi
if [[ "$1 $2" == "-m pytest" ]]; then echo "pytest OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} ARGS=$*"; fi
exit 0
"""


@pytest.fixture
def fake_venv(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, text in (("python", FAKE_PYTHON), ("mkdocs", "#!/usr/bin/env bash\necho mkdocs $*\n")):
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    return venv


#: The caller's choices that the script reads: a test sets the ones it means.
CHOICES = ("OMP_NUM_THREADS", "SAFEVOCAB_SKIP_DOCS", "SAFEVOCAB_TEST_WORKERS", "SAFEVOCAB_CPU_SAMPLES")


def _run(venv: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in CHOICES}
    base |= {"SAFEVOCAB_VENV": str(venv), "SAFEVOCAB_TORCH": "skip", "PATH": "/usr/bin:/bin", **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), "-x"], env=base, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip


def test_pytest_runs_on_one_thread_with_a_step_line_each_and_a_count(fake_venv):
    result = _run(fake_venv, SAFEVOCAB_TEST_WORKERS="1")
    assert "pytest OMP_NUM_THREADS=1 ARGS=-m pytest -m not slow -o console_output_style=count -x" in result.stdout
    steps = [line for line in result.stderr.splitlines() if line.startswith("[test] step ")]
    assert [line[:18] for line in steps] == ["[test] step 1/3: s", "[test] step 2/3: t", "[test] step 3/3: t"]
    assert "OMP_NUM_THREADS=1 (the default here; set it to choose)" in steps[1]
    assert "mkdocs build --strict" in result.stdout


def test_the_users_thread_count_wins(fake_venv):
    result = _run(fake_venv, OMP_NUM_THREADS="2", SAFEVOCAB_SKIP_DOCS="1")
    assert "pytest OMP_NUM_THREADS=2 " in result.stdout
    assert "OMP_NUM_THREADS=2 (yours)" in result.stderr
    assert "[test] step 3/3: the docs: skipped (SAFEVOCAB_SKIP_DOCS=1)" in result.stderr


def _pytest_args(workers: int) -> str:
    """What the script passes pytest for ``workers`` workers (1: no xdist)."""
    return "-m not slow -o" if workers == 1 else f"-m not slow -n {workers} --dist loadfile -o"


def _memory_cap() -> int:
    """The script's cap: one worker per 3 GiB of available memory."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // (3 * 1024 * 1024)
    raise AssertionError("no MemAvailable in /proc/meminfo")


@pytest.mark.parametrize("busy_share, per_core", [(0.1, 1), (0.45, 1), (0.5, 3), (1.0, 3)])
def test_the_tests_run_in_one_worker_per_core_three_when_busy(fake_venv, tmp_path, busy_share, per_core):
    """One worker per core while other work keeps under half of the cores busy, three per core from half on, read from
    /proc/stat's aggregate "cpu" line (user nice system idle iowait ...) one second apart."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy, idle = round(1000 * busy_share), 1000 - round(1000 * busy_share)
    samples = tmp_path / "stat"
    samples.write_text(f"cpu  500 0 500 9000 100 0 0 0\ncpu  {500 + busy} 0 500 {9000 + idle} 100 0 0 0\n")
    result = _run(fake_venv, SAFEVOCAB_SKIP_DOCS="1", SAFEVOCAB_CPU_SAMPLES=str(samples))
    workers = max(1, min(per_core * cores, _memory_cap()))
    assert _pytest_args(workers) in result.stdout, result.stdout
    # the step line says why, whatever the memory cap made of the count
    why = f"{'three' if per_core == 3 else 'one'} per core: the cores were {round(100 * busy_share)} % busy"
    assert why in result.stderr, result.stderr


@pytest.mark.parametrize("samples", [None, "", "cpu  1 2 3 4 5 6 7 8\ncpu  1 2 3 4 5 6 7 8\n", "garbage\n"])
def test_unreadable_samples_mean_one_worker_per_core(fake_venv, tmp_path, samples):
    """A missing or empty samples file, two equal samples (no time passed) or no "cpu" line: no measure, so the idle
    machine's count, and the run goes on."""
    path = tmp_path / "stat"
    if samples is not None:
        path.write_text(samples)
    result = _run(fake_venv, SAFEVOCAB_SKIP_DOCS="1", SAFEVOCAB_CPU_SAMPLES=str(path))
    assert "one per core: the cores were unknown % busy" in result.stderr, result.stderr


def test_the_busy_measure_reads_this_machine(fake_venv):
    """Without samples given, the script measures /proc/stat itself (here: this test's machine) and picks one of the
    two counts."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    result = _run(fake_venv, SAFEVOCAB_SKIP_DOCS="1")
    counts = {max(1, min(k * cores, _memory_cap())) for k in (1, 3)}
    assert any(_pytest_args(n) in result.stdout for n in counts), result.stdout
    assert re.search(r"(one|three) per core: the cores were \d+ % busy", result.stderr), result.stderr


def test_a_chosen_worker_count_wins(fake_venv):
    chosen = _run(fake_venv, SAFEVOCAB_TEST_WORKERS="3", SAFEVOCAB_SKIP_DOCS="1")
    assert "ARGS=-m pytest -m not slow -n 3 --dist loadfile -o console_output_style=count -x" in chosen.stdout


def test_a_bad_worker_count_is_refused_in_one_line(fake_venv):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SAFEVOCAB_SKIP_DOCS")}
    base |= {"SAFEVOCAB_VENV": str(fake_venv), "SAFEVOCAB_TORCH": "skip", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh")], env={**base, "SAFEVOCAB_TEST_WORKERS": "two"},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "[test] SAFEVOCAB_TEST_WORKERS=two must be a whole number >= 1"
