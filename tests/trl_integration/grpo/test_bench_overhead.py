"""examples/bench_overhead.py, the step-time overhead benchmark, runs end to end (its timings are printed, never
asserted)."""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "bench_overhead.py"


@pytest.fixture(scope="module")
def bench_overhead():
    spec = importlib.util.spec_from_file_location("bench_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_overhead_runs_as_the_documented_command(monkeypatch, capsys):
    """``python examples/bench_overhead.py`` (README.md, docs/performance.md) runs as a script: its ``__main__`` block
    (run here with the path it puts on ``sys.path``, in this process: a fresh interpreter cost 7 CPU-s)."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends this checkout
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python examples/bench_overhead.py") and "--log_mismatch_metrics" in out
    assert sys.path[0] == str(SCRIPT.parents[1])


def test_bench_overhead_pairs_steps_on_identical_batches(bench_overhead, capsys):
    result = bench_overhead.main(["--steps", "3", "--skip", "1"])
    out = capsys.readouterr().out
    assert result["n_pairs"] == 2
    # a frozen policy and per-step seeds: both trainers sampled the very same completions
    assert result["same_completions"]
    assert result["stock_median_s"] > 0 and result["safevocab_median_s"] > 0
    assert "overhead of SafeVocabGRPOTrainer" in out and "| stock GRPOTrainer |" in out
    assert result["safevocab_logged_mismatch_metrics"]  # the default: the trainer as users run it


def test_bench_overhead_can_measure_the_trainer_without_its_mismatch_metrics(bench_overhead, capsys):
    result = bench_overhead.main(["--steps", "2", "--skip", "1", "--log_mismatch_metrics", "false"])
    assert not result["safevocab_logged_mismatch_metrics"] and result["same_completions"]
    assert "log_mismatch_metrics=False" in capsys.readouterr().out


def test_bench_overhead_steps_may_exceed_one_epoch_of_its_dataset(bench_overhead, tmp_path):
    """--steps 300 ran out of batches (StopIteration) with the bundled 2,048 prompts at 8 per step: the batches
    restart epoch after epoch, as the Trainer's do."""
    from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
    from trl_integration.demo.arithmetic import arithmetic_reward, make_dataset
    from trl_integration.demo.model import tiny_model_path

    dataset = make_dataset(16, seed=0, split="train")  # two steps' worth of prompts
    trainer, batches = bench_overhead._make_trainer(
        SafeVocabGRPOTrainer, SafeVocabGRPOConfig, str(tiny_model_path()), dataset, arithmetic_reward,
        str(tmp_path), 5, {"learning_rate": 0.0},
    )  # fmt: skip
    for step in range(5):  # 2.5 epochs
        bench_overhead._timed_step(trainer, batches, seed=step)
