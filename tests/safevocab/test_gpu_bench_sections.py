"""The device plan's sections of ``scripts/gpu_bench.py`` (issue 56, point 6; ``scripts/gpu_plan.py``), CPU-sized:
``--small`` runs them under Triton's interpreter at N = 16, H = 8, V = 192, and every section must record its fields,
every fused row the backward that ran (and the forced one where one was forced); ``--budget_s`` skips what it cuts
and says so; Liger is optional and its row says which of its functions ran."""

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_bench.py"


def _script_module(name: str):
    """``scripts/<name>.py``, loaded once (registered under its name: gpu_plan's dataclass needs the module)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _plan_module():
    return _script_module("gpu_plan")


def _bench(tmp_path, *flags: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.exists(), proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _check_compact_and_trace(results: dict, out_dir: Path) -> None:
    compact = results["compact"]
    for key in ("fold_none_ms", "fold_min_p_ms", "fold_min_p_pool_ms", "pack_ms", "compact_block1024_ms",
                "compact_block8192_ms"):  # fmt: skip
        assert compact[key] > 0, (key, compact)
    assert compact["rows"] == 16 and compact["kept_mean"] > 0
    assert set(results["trace"]) == {"minp01_lm", "topp09_lm", "none_synthetic"}
    for res in results["trace"].values():
        assert "error" not in res, res
        assert set(res["idle"]) == {"kernels", "span_us", "busy_us", "idle_us", "gaps"}
        assert res["idle"]["kernels"] == 0  # a CPU: no device kernels, the fields at zero
        assert res["top"] and res["backward"]
        assert (out_dir / res["trace_file"]).exists()


@pytest.mark.slow  # ~20 CPU-s: every plan section under the interpreter
def test_plan_sections_small_record_each_sections_fields_and_the_backward_that_ran(tmp_path):
    plan = _plan_module()
    proc, results = _bench(tmp_path, "--sections", "gate,topk_sweep,lm_table,compact,trace,fallback")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "problems" not in results, results["problems"]
    for name in plan.PLAN_SECTIONS:
        assert plan.section_problems(name, results[name]) == [], name
    env = results["environment"]
    assert {"torch", "triton", "trl", "liger-kernel", "python"} <= set(env)
    assert "gpu_bench.py --small --sections gate,topk_sweep,lm_table,compact,trace,fallback" in results["command"]

    def fused(section):
        return [r for r in results[section] if r["variant"] in ("fused", "fused_replay")]

    for section in ("gate", "topk_sweep", "lm_table"):
        for r in fused(section):
            assert r["ms"] > 0 and r["backward"] and "kept" in r, r
            assert r["reread_fallback_chunks_per_step"] == 0 and r["dense_fallback_chunks_per_step"] == 0, r
            if r["forced"] in ("per-id", "union"):
                assert r["backward"] == r["forced"], r  # forcing reaches the backward
            if r["forced"] == "dense":
                assert r["backward"] == plan.NOTHING_STORED, r
            if r["forced"] == "dense-stored":
                assert r["backward"] == "dense", r
    gate = results["gate"]
    assert {(r["rule"], r["forced"]) for r in fused("gate")} == {
        (rule, backward) for rule in plan.GATE_RULES for backward in plan.GATE_BACKWARDS
    }
    refs = {r["variant"]: r for r in gate if "forced" not in r}
    assert refs["floor"]["ms"] > 0 and refs["trl"]["ms"] > 0 and refs["recompute_floor"]["ms"] > 0
    liger = refs["liger"]
    assert liger.get("skipped", "").startswith("liger_kernel not installed") or liger["implementation"]
    sweep = {(r["profile"], r["rule"], r["forced"]) for r in fused("topk_sweep")}
    assert sweep == {(p, f"top_k={k}", b) for p in ("lm", "synthetic") for k in (4, 16) for b in plan.SWEEP_BACKWARDS}
    lm = {(r["rule"], r["variant"]) for r in results["lm_table"]}
    assert {(rule, "fused") for rule in plan.LM_RULES} | {(plan.REPLAY_RULE, "fused_replay")} <= lm
    assert {(rule, "fused_kept") for rule in plan.KEPT_RULES} <= lm  # the kept-logits rows, timed
    assert {"floor", "recompute_floor", "trl", "liger"} <= {variant for _, variant in lm}
    _check_compact_and_trace(results, tmp_path)
    assert {(r["profile"], r["rule"]) for r in results["fallback"]} == {
        (profile, rule) for profile in plan.FALLBACK_PROFILES for rule in plan.FALLBACK_RULES
    }
    for r in results["fallback"]:
        assert min(r["read_ms"], r["no_read_ms"], r["batch_ms"]) > 0 and r["batch_rows"] == 1, r
        assert 0 <= r["undecided_max"] <= r["flagged_max"], r
    table = (tmp_path / "plan.md").read_text()
    assert "- fallback lm top_p=0.9: read " in table
    assert "| gate | synthetic | top_k=50 | fused | union | union |" in table
    assert "| lm_table | lm | top_k=64 | fused_replay | gate |" in table
    assert "| lm_table | lm | none | fused_kept | gate |" in table


@pytest.mark.slow  # ~9 CPU-s; the fast guards: the section checks and the budget's skip below
def test_compact_and_trace_sections_small(tmp_path):
    # the micro-benchmark's times and the traces' idle fields (zero on a CPU), the traces written beside
    proc, results = _bench(tmp_path, "--sections", "compact,trace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_compact_and_trace(results, tmp_path)


def test_budget_skips_the_remaining_sections_and_says_so(tmp_path):
    proc, results = _bench(tmp_path, "--sections", "compact,trace", "--budget_s", "0.001")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(results["skipped"]) == {"compact", "trace"} and "compact" not in results
    assert all("--budget_s" in note for note in results["skipped"].values())
    assert "- compact: skipped, --budget_s" in (tmp_path / "plan.md").read_text()


def test_kernel_tests_are_skipped_off_cuda_with_a_note(tmp_path):
    # without --small the correctness section is the device's: on a CPU it says so instead of running the kernels'
    # test files (--tests kernels) interpreted for minutes
    if torch.cuda.is_available():
        pytest.skip("a CUDA device runs them")
    out = tmp_path / "k.json"
    cmd = [sys.executable, str(SCRIPT), "--sections", "correctness", "--tests", "kernels", "--workers", "8", "--out",
           str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["correctness"]
    assert result["skipped"].startswith("no CUDA device")
    assert result["files"][:4] == ["tests/safevocab/test_kernels.py", "tests/safevocab/test_sparse_backward_kernel.py",
                                   "tests/safevocab/test_threshold_select_kernel.py",
                                   "tests/safevocab/test_kept_entries_kernel.py"]  # fmt: skip


def test_section_problems_name_a_section_that_recorded_nothing():
    plan = _plan_module()
    timed = {"section": "gate", "profile": "synthetic", "rule": "top_k=50", "variant": "fused", "forced": "union"}
    assert plan.section_problems("gate", [{**timed, "ms": 1.0, "backward": "union"}]) == []
    assert plan.section_problems("gate", []) == ["gate: no rows"]
    assert plan.section_problems("topk_sweep", None) == ["topk_sweep: no rows"]
    assert "does not say which backward ran" in plan.section_problems("gate", [{**timed, "ms": 1.0}])[0]
    assert "neither ran nor says why" in plan.section_problems("lm_table", [timed])[0]
    assert plan.section_problems("lm_table", [{**timed, "error": "boom"}]) == ["lm_table: no fused row was timed"]
    assert plan.section_problems("gate", [{**timed, "skipped": "budget"}]) == []  # cut by the budget, and says so
    assert plan.section_problems("compact", {"fold_none_ms": 1.0}) != []
    assert plan.section_problems("trace", {}) == ["trace: no traces"]
    assert plan.section_problems("fallback", []) == ["fallback: no rows"]
    priced = {
        "read_ms": 2.0,
        "no_read_ms": 1.0,
        "batch_ms": 1.5,
        "flagged_max": 0,
        "batch_rows": 16,
        "undecided_max": 0,
    }
    assert plan.section_problems("fallback", [priced, {"error": "boom"}]) == []
    unpriced = {k: v for k, v in priced.items() if k != "batch_ms"}
    assert "lacks ['batch_ms']" in plan.section_problems("fallback", [unpriced])[0]
    assert plan.section_problems("trace", {"t": {"top": [1], "backward": "union", "idle": {"kernels": 0}}}) != []


def _bench_module():
    _plan_module()  # gpu_bench imports gpu_plan from its folder
    return _script_module("gpu_bench")


def test_trl_rows_run_where_trl_trainer_utils_does_not_import(monkeypatch):
    # the GPU machine has no pandas/datasets, which trl.trainer.utils imports and trl's ChunkedLogProbFunction.backward
    # imports at call time: the bench's stand-in lets trl's kernel run its backward there (without it, every trl row
    # of the plan was an error in a venv of the device's packages: "No module named 'pandas'")
    pytest.importorskip("trl")
    bench = _bench_module()
    # whatever the stand-in leaves in sys.modules is undone after the test (setitem records the key's state, absent
    # or trl's module), then the key is cleared so that the import is tried, and fails on pandas
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", sys.modules.get("trl.trainer.utils"))
    del sys.modules["trl.trainer.utils"]
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` fails, as on the device
    assert bench.trl_backward_context().startswith("stand-in (trl.trainer.utils needs pandas, absent)")
    from trl.kernels import ChunkedLogProbFunction

    torch.manual_seed(0)
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    y = torch.randint(0, 20, (6,))
    ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 4, None, 1.0, ())[0].sum().backward()  # the bench's call
    expected = torch.func.grad(lambda w_: (h.detach() @ w_.t()).log_softmax(-1).gather(1, y[:, None]).sum())(w.detach())
    torch.testing.assert_close(w.grad, expected, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    from trl.trainer.utils import selective_log_softmax  # noqa: F401 - trl's own module again, not the stand-in


def test_paths_name_the_backward_taken_and_the_fallbacks_per_step():
    plan = _plan_module()
    before = {"taken per-id": 0, "taken union": 2, "taken dense": 0, "reread_fallback_chunks": 1,
              "dense_fallback_chunks": 0, "mass_batch_redo_chunks": 0}  # fmt: skip
    after = {**before, "taken union": 5, "reread_fallback_chunks": 4, "mass_batch_redo_chunks": 6}
    assert plan.paths(before, after, 3) == {"backward": "union", "reread_fallback_chunks_per_step": 1.0,
                                            "dense_fallback_chunks_per_step": 0.0,
                                            "mass_batch_redo_chunks_per_step": 2.0}  # fmt: skip
    assert plan.paths(before, {**after, "taken union": 3, "taken dense": 4}, 5)["backward"] == "union 1/5, dense 4/5"
    assert plan.paths(before, before, 2)["backward"] == plan.NOTHING_STORED
    # a gate module without its counts
    no_taken = {"reread_fallback_chunks": 0, "dense_fallback_chunks": 0, "mass_batch_redo_chunks": 0}
    assert plan.paths(no_taken, no_taken, 2)["backward"].startswith("unknown")


def test_idle_gaps_sum_the_gaps_between_kernels_and_name_the_host_ops_inside():
    plan = _plan_module()
    events = [
        {"cat": "kernel", "name": "a", "ts": 0.0, "dur": 100.0},
        {"cat": "kernel", "name": "b", "ts": 50.0, "dur": 100.0},  # overlaps a: busy 0-150
        {"cat": "kernel", "name": "c", "ts": 350.0, "dur": 50.0},  # 200 us idle before it
        {"cat": "gpu_memset", "name": "m", "ts": 420.0, "dur": 10.0},  # 20 us idle: under min_us
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 160.0, "dur": 150.0},
        {"cat": "cpu_op", "name": "aten::item", "ts": 600.0, "dur": 5.0},  # outside every gap
    ]
    idle = plan.idle_gaps(events)
    assert idle == {"kernels": 4, "span_us": 430.0, "busy_us": 210.0, "idle_us": 220.0,
                    "gaps": [{"us": 200.0, "at_us": 150.0, "host": ["cudaStreamSynchronize"]}]}  # fmt: skip
    assert plan.idle_gaps([]) == {"kernels": 0, "span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}


def test_liger_step_says_not_installed_or_runs_the_triton_path_off_hopper(monkeypatch):
    plan = _plan_module()
    h, w = torch.randn(4, 3), torch.randn(5, 3)
    y, g = torch.tensor([0, 1, 2, 4]), torch.randn(4)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails, as where it is not installed
    assert plan.liger_step(h, w, y, g).startswith("liger_kernel not installed")

    calls = []

    class FakeFLCE(torch.autograd.Function):  # stands in for Liger's Triton fused linear cross-entropy
        @staticmethod
        def forward(ctx, x, weight, target, bias, ce_weight, ignore_index, lse_sq, smoothing, reduction):
            calls.append(reduction)
            ctx.save_for_backward(x, weight)
            return -(x @ weight.t()).log_softmax(-1).gather(1, target[:, None])[:, 0], None

        @staticmethod
        def backward(ctx, grad, _):
            x, weight = ctx.saved_tensors
            return torch.zeros_like(x), torch.zeros_like(weight), *[None] * 7

    package = types.ModuleType("liger_kernel")
    ops = types.ModuleType("liger_kernel.ops")
    ops.LigerFusedLinearScaledCrossEntropyFunction = object()  # present, but this is no CUDA device
    flce = types.ModuleType("liger_kernel.ops.fused_linear_cross_entropy")
    flce.LigerFusedLinearCrossEntropyFunction = FakeFLCE
    for name, module in (("liger_kernel", package), ("liger_kernel.ops", ops),
                         ("liger_kernel.ops.fused_linear_cross_entropy", flce)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    step = plan.liger_step(h, w, y, g)
    step()
    assert calls == ["none"]  # per token
    assert step.label.startswith("LigerFusedLinearCrossEntropyFunction (Triton, reduction='none'")
