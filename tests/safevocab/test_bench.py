"""The benchmark runs end to end at a tiny size, and its memory tracker counts what it should."""

import json
import os
import subprocess
import sys

import pytest
import torch

from safevocab.bench_measure import LiveTensorBytes


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


def _bench_args(**overrides):
    from safevocab.bench import make_parser

    return make_parser().parse_args(
        ["--device", "cpu", "--n", "64", "--h", "16", "--v", "300", *[f"--{k}={v}" for k, v in overrides.items()]]
    )


def test_inputs_are_built_once_per_process_and_each_variant_gets_its_own_leaves():
    # On an H200 the GPU preset's setup took ~55 s per variant (CPU draws, rebuilt per variant) for a 0.06 s step:
    # the per-rule time limit ran out before any figure. One set of inputs, fresh leaves (own .grad) per variant.
    from safevocab.bench import _inputs

    args = _bench_args()
    first, second = _inputs(args, torch.device("cpu")), _inputs(args, torch.device("cpu"))
    for a, b in zip(first, second):
        assert a.data_ptr() == b.data_ptr()  # the same storage: built once
    first[1].sum().backward()
    assert first[1].grad is not None and second[1].grad is None  # own gradients: peak memory still counts them
    other = _inputs(_bench_args(rule="top_k=3"), torch.device("cpu"))
    assert other[0].data_ptr() != first[0].data_ptr()


def test_targets_are_draws_from_the_pruned_softmax():
    # Gumbel-max on the device against the exact pruned distribution (independent: softmax of the kept logits).
    from safevocab.bench import _sample_targets

    torch.manual_seed(0)
    weight = torch.randn(6, 4) * 2
    hidden = torch.randn(1, 4).expand(20000, 4).contiguous()
    gen = torch.Generator().manual_seed(1)
    draws = _sample_targets(hidden, weight, "top_k=3", gen)
    z = hidden[0] @ weight.t()
    kept = z.topk(3).indices
    expected = torch.zeros(6).index_put_((kept,), torch.softmax(z[kept], -1))
    observed = torch.bincount(draws, minlength=6).float() / draws.numel()
    assert set(draws.unique().tolist()) <= set(kept.tolist())
    assert torch.allclose(observed, expected, atol=0.015), (observed, expected)


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


def test_lm_logits_profile_keeps_tens_to_hundreds_of_tokens_where_the_synthetic_one_keeps_thousands():
    # Issue 41 point 5: the bench's LM-like profile (a Zipf prior plus a context term) at the GPU bench's vocabulary.
    from safevocab.bench_inputs import draw_logit_factors, kept_set_sizes

    sizes = {}
    for profile in ("synthetic", "lm"):
        gen = torch.Generator().manual_seed(0)
        hidden, weight = draw_logit_factors(256, 64, 151936, profile=profile, generator=gen, device="cpu")
        sizes[profile] = {rule: kept_set_sizes(hidden, weight, rule) for rule in ("min_p=0.01", "top_p=0.9")}
    for rule in ("min_p=0.01", "top_p=0.9"):
        assert 5 <= sizes["lm"][rule]["median"] <= 100 and sizes["lm"][rule]["p99"] <= 1000, sizes["lm"]
        assert sizes["synthetic"][rule]["median"] > 10 * sizes["lm"][rule]["median"], sizes
    with pytest.raises(ValueError, match="profile='zipf'"):
        draw_logit_factors(2, 4, 8, profile="zipf", generator=torch.Generator(), device="cpu")


def test_bench_reports_the_kept_sets_of_the_timed_rows(tmp_path):
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "safevocab.bench", "--device", "cpu", "--n", "64", "--h", "16", "--v", "2000",
           "--repeats", "1", "--variants", "floor,fused", "--rule", "top_k=7", "--logits-profile", "lm",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "logits=lm" in proc.stdout and "kept set |S|: median 7" in proc.stdout
    data = json.loads(out.read_text())
    assert data["kept_set"]["median"] == 7 and set(data["results"]) == {"floor", "fused"}


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
           "--profile-timeout", "600", "--correctness-timeout", "600", "--out", str(out)]  # fmt: skip
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
