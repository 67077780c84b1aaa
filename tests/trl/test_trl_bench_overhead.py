"""The step-time overhead benchmark runs end to end (its timings are printed, never asserted)."""

from __future__ import annotations

from trl_integration import bench_overhead


def test_bench_overhead_pairs_steps_on_identical_batches(capsys):
    result = bench_overhead.main(["--steps", "3", "--skip", "1"])
    out = capsys.readouterr().out
    assert result["n_pairs"] == 2
    # a frozen policy and per-step seeds: both trainers sampled the very same completions
    assert result["same_completions"]
    assert result["stock_median_s"] > 0 and result["safevocab_median_s"] > 0
    assert "overhead of SafeVocabGRPOTrainer" in out and "| stock GRPOTrainer |" in out
    assert result["safevocab_logged_mismatch_metrics"]  # the default: the trainer as users run it


def test_bench_overhead_can_measure_the_trainer_without_its_mismatch_metrics(capsys):
    result = bench_overhead.main(["--steps", "2", "--skip", "1", "--log_mismatch_metrics", "false"])
    assert not result["safevocab_logged_mismatch_metrics"] and result["same_completions"]
    assert "log_mismatch_metrics=False" in capsys.readouterr().out
