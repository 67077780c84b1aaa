"""``safevocab.bench.run``: the benchmark runs end to end at a tiny size (``python -m safevocab.bench``), one worker or
the matrix of rules and thread counts, and its report and JSON hold what they should."""

import json
import subprocess
import sys

import pytest


def test_bench_prints_ratios_and_the_kept_sets_at_tiny_size(tmp_path):
    """One run (a fresh interpreter costs ~3 CPU-seconds; two did before, issue 53): the ratio rows, every variant's
    time and peak, and the kept sets of the timed rows on LM-like logits."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "safevocab.bench", "--device", "cpu", "--n", "64", "--h", "16", "--v", "2000",
           "--repeats", "1", "--variants", "floor,fused,naive", "--rule", "top_k=7", "--logits-profile", "lm",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| fused / floor |" in proc.stdout and "| fused / naive |" in proc.stdout
    assert "logits=lm" in proc.stdout and "kept set |S|: median 7" in proc.stdout
    data = json.loads(out.read_text())
    results = data["results"]
    assert set(results) == {"floor", "fused", "naive"}
    assert all(r["seconds"] > 0 and r["peak_bytes"] > 0 for r in results.values())
    assert results["fused"]["peak_bytes"] < results["naive"]["peak_bytes"]
    assert data["kept_set"]["median"] == 7


# Slow tier (issue 53): it keeps a core busy on purpose (--busy-cores 1); the command's and the matrix's fast
# guard is test_bench_prints_ratios_and_the_kept_sets_at_tiny_size.
@pytest.mark.slow
def test_bench_runs_several_rules_and_thread_counts_in_one_run(tmp_path):
    out = tmp_path / "matrix.json"
    cmd = [sys.executable, "-m", "safevocab.bench", "--n", "64", "--h", "16", "--v", "300", "--repeats", "1",
           "--rules", "none;top_k=5,min_p=0.01", "--threads", "1,2", "--busy-cores", "1", "--replay", "top_k=5",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "busy cores: 1 spinning process(es)" in proc.stdout and "load average at start" in proc.stdout
    assert (
        proc.stdout.count("| `top_k=5,min_p=0.01` |") == 2
        and "threads=1:" in proc.stdout
        and "threads=2:" in proc.stdout
    )
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"1", "2"} and data["machine"]["busy_cores"] == 1
    for res in data["results"].values():
        assert {"floor", "fused[none]", "fused[top_k=5,min_p=0.01]", "fused_replay[top_k=5]"} <= set(res)
        assert all(r["seconds"] > 0 for r in res.values())
