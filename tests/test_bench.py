"""The benchmark runs end to end at a tiny size, and its memory tracker counts what it should."""

import json
import subprocess
import sys

import torch

from safevocab.bench import LiveTensorBytes


def test_live_tensor_bytes_counts_only_concurrently_live_storage():
    outside = torch.randn(256, 256)  # allocated before: not counted
    with LiveTensorBytes() as tracker:
        a = outside * 2  # 256 KiB
        b = a + 1  # 512 KiB live
        del a
        c = b * 3  # b and c: 512 KiB live
        c.add_(1)  # in place: no new storage
        view = c[:10]  # a view: same storage
    assert tracker.peak == 2 * 256 * 256 * 4
    assert view.shape == (10, 256)


def test_live_tensor_bytes_sees_backward_allocations():
    w = torch.randn(100, 50, requires_grad=True)
    h = torch.randn(200, 50, requires_grad=True)
    with LiveTensorBytes() as tracker:
        (h @ w.t()).sum().backward()
    assert tracker.peak >= 200 * 100 * 4 + w.numel() * 4  # the logits and at least one gradient


def test_bench_prints_ratios_at_tiny_size(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "safevocab.bench", "--n", "64", "--h", "16", "--v", "300", "--repeats", "1",
           "--variants", "floor,fused,naive", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| fused / floor |" in proc.stdout and "| fused / naive |" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"floor", "fused", "naive"}
    assert all(r["seconds"] > 0 and r["peak_bytes"] > 0 for r in results.values())
    assert results["fused"]["peak_bytes"] < results["naive"]["peak_bytes"]


def test_bench_runs_several_rules_and_thread_counts_in_one_run(tmp_path):
    out = tmp_path / "matrix.json"
    cmd = [sys.executable, "-m", "safevocab.bench", "--n", "64", "--h", "16", "--v", "300", "--repeats", "1",
           "--rules", "none;top_k=5,min_p=0.01", "--threads", "1,2", "--busy-cores", "1", "--replay", "top_k=5",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "busy cores: 1 spinning process(es)" in proc.stdout and "load average at start" in proc.stdout
    assert proc.stdout.count("| `top_k=5,min_p=0.01` |") == 2 and "threads=1:" in proc.stdout and "threads=2:" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"1", "2"} and data["machine"]["busy_cores"] == 1
    for res in data["results"].values():
        assert {"floor", "fused[none]", "fused[top_k=5,min_p=0.01]", "fused_replay[top_k=5]"} <= set(res)
        assert all(r["seconds"] > 0 for r in res.values())
