"""The benchmark's device scripts, CPU-sized: ``scripts/gpu_bench.py`` (rules, size, the GRPO ablation),
``scripts/grpo_pairs.py`` (the paired GRPO timing's schedule and interval) and ``scripts/gpu_bench.sh`` (the one call
of a device run)."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # tooling (the device run's driver), ~20 s of one core: CI's slow phase
def test_gpu_bench_script_runs_the_chosen_rules_at_the_chosen_size(tmp_path):
    # The device run's script (scripts/gpu_bench.py), CPU-sized: --n, --rules (';'-separated) and --no-naive reach
    # every rule's benchmark, whose rows land in the results file.
    from pathlib import Path

    out = tmp_path / "gpu.json"
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"
    cmd = [sys.executable, str(script), "--small", "--skip", "correctness,grpo", "--n", "48", "--no-naive",
           "--rules", "min_p=0.001;top_k=5,min_p=0.01", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["op"]
    assert [row["rule"] for row in rows] == ["min_p=0.001", "top_k=5,min_p=0.01"]
    for row in rows:
        assert row["args"]["n"] == 48 and "naive" not in row["results"] and row["results"]["fused"]["seconds"] > 0


@pytest.mark.slow
def test_gpu_bench_grpo_ablation_switches_safevocab_parts_off(tmp_path):
    # --grpo-ablation 1: stock, SafeVocab, then SafeVocab without rollout log-probs/metrics, then also without the
    # sampler rule; each a real trainer run (CPU-sized), its label naming the fields it switched off.
    pytest.importorskip("trl")
    from pathlib import Path

    out = tmp_path / "abl.json"
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"
    cmd = [sys.executable, str(script), "--small", "--skip", "correctness,op", "--grpo-ablation", "1",
           "--grpo-steps", "2", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["grpo"]
    assert [row["trainer"] for row in rows] == [
        "stock",
        "safevocab",
        "safevocab rollout_logprobs=False log_mismatch_metrics=False",
        "safevocab rollout_logprobs=False log_mismatch_metrics=False safe_vocab_in_sampler=False",
    ]
    assert all(row["steps"] == 2 and row["step_seconds"] > 0 for row in rows)


def test_gpu_bench_refuses_negative_ablation_rounds_in_one_line():
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--small", "--grpo-ablation", "-1"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--grpo-ablation must be a number of rounds >= 0, got -1")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--budget_s", "-3"], "--budget_s must be a number of seconds >= 0 (0: no limit), got -3.0"),
        (["--budget_s", "nan"], "--budget_s must be a number of seconds >= 0 (0: no limit), got nan"),
        (["--workers", "-1"], "--workers must be a number of processes >= 0 (0: none), got -1"),
    ],
)
def test_gpu_bench_refuses_a_bad_budget_or_worker_count_in_one_line(flags, message, monkeypatch, capsys):
    """In this process (the script as a module, its folder on ``sys.path`` as when it runs): the refusal comes from
    the argument checks, before anything is measured."""
    import importlib.util
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[2] / "scripts"
    monkeypatch.syspath_prepend(str(scripts))
    spec = importlib.util.spec_from_file_location("gpu_bench_under_test", scripts / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--small", *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def _grpo_pairs_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "grpo_pairs.py"
    spec = importlib.util.spec_from_file_location("grpo_pairs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_median_interval_is_the_sign_test_interval():
    # n = 30: P(Bin(30, 1/2) <= 9) = 0.0214, P(<= 10) = 0.0494, so the 95 % interval is [x_(10), x_(21)].
    pairs = _grpo_pairs_module()
    values = [float(i) for i in range(1, 31)]
    assert pairs.median_interval(values) == (10.0, 21.0)
    assert pairs.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few for 95 %: the range
    with pytest.raises(ValueError, match="values"):
        pairs.median_interval([])


def test_pairs_alternate_abba_after_one_warm_up_each():
    pairs = _grpo_pairs_module()
    assert pairs.turn_schedule(3) == ["stock", "safevocab", "stock", "safevocab", "safevocab", "stock",
                                      "stock", "safevocab"]  # fmt: skip
    times = {"stock": [9.0, 1.0, 2.0], "safevocab": [9.0, 1.5, 1.0]}
    assert pairs.pair_ratios(times, 2) == [1.5, 0.5]


@pytest.mark.slow
def test_gpu_bench_sh_runs_the_device_measurement_small(tmp_path):
    # Issue 41 point 6: scripts/gpu_bench.sh's one call, CPU-sized: every section lands in the results, the GRPO
    # pairs interleaved in the scheduled order.
    pytest.importorskip("trl")
    from pathlib import Path

    out = tmp_path / "g.json"
    root = Path(__file__).resolve().parents[2]
    cmd = ["bash", str(root / "scripts" / "gpu_bench.sh"), "--small", "--n", "128", "--grpo-pairs", "3",
           "--fuzz-examples", "10", "--tests", "tests/safevocab/test_reference_fuzz.py", "--op-timeout", "300",
           "--profile-timeout", "600", "--correctness-timeout", "600", "--budget_s", "0",  # no budget: a busy CPU
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHON": sys.executable}  # this interpreter, not whatever python3 is on PATH
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["sections"] == ["correctness", "op", "profile", "pairs"]
    assert results["correctness"]["returncode"] == 0, results["correctness"]
    assert {row["logits_profile"] for row in results["op"]} == {"synthetic", "lm"}
    assert all("error" not in row for row in results["op"]), results["op"]
    assert {(r["rule"], r["logits_profile"]) for r in results["profile"]} >= {("top_k=50", "lm"), ("none", "synthetic")}
    pairs = results["pairs"]
    assert "error" not in pairs, pairs
    assert pairs["order"] == _grpo_pairs_module().turn_schedule(3) and len(pairs["ratios"]) == 3


def test_mass_margin_rows_script_prints_its_table(capsys):
    # scripts/mass_margin_rows.py (docs/performance.md, "Host synchronisation"), tiny and in-process: a row per
    # profile, dtype and q; a flat fp32 row set at q=0.99 is all near its boundary at V 2000 (a share above zero)
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "mass_margin_rows.py"
    spec = importlib.util.spec_from_file_location("mass_margin_rows", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--n", "16", "--h", "8", "--v", "2000"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "%" in line]
    assert len(rows) == 12
    shares = {tuple(cell.strip() for cell in row.split("|")[1:4]): float(row.split("|")[4].strip(" %")) for row in rows}
    assert all(0 <= share <= 100 for share in shares.values())
    assert shares["synthetic", "float32", "0.99"] > 0
    with pytest.raises(SystemExit) as exit_info:  # a size out of range: argparse's one line, rc 2
        module.main(["--v", "0"])
    assert exit_info.value.code == 2 and "--v 0: accepted an integer >= 1" in capsys.readouterr().err
