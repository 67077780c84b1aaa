"""What the main job shows and leaves behind (issue 18, part B, point 6): progress bars on the held-out
evaluations, a summary that keeps paths whole when stdout is not a terminal, and the training curves beside
``summary.json``."""

from __future__ import annotations

import json

import pytest

from trl_integration.commands.grpo import run
from trl_integration.summary_plots import MISMATCH_KEYS, PLOT_FILE, write_training_curves

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_main_job_shows_progress_keeps_paths_whole_and_writes_the_curves(tmp_path, capsys):
    out = tmp_path / ("a-run-directory-with-a-long-name-" * 3) / "tiny-arith"  # paths over 80 columns
    assert len(str(out)) > 100
    run(["--max_steps", "2", "--logging_steps", "1", "--eval_num_prompts", "16", "--arithmetic_num_prompts", "128",
         "--output_dir", str(out)])  # fmt: skip
    captured = capsys.readouterr()  # stdout is a pipe here, not a terminal
    assert captured.err.count("held-out accuracy") >= 2 and "16/16" in captured.err  # before and after training
    lines = captured.out.splitlines()
    summary = json.loads((out / "summary.json").read_text())
    for path in (summary["output_dir"], summary["log_history"], summary["plots"]):
        assert any(path in line for line in lines), f"{path} is wrapped or missing in:\n{captured.out}"
    assert summary["plots"] == str(out.resolve() / PLOT_FILE)
    assert (out / PLOT_FILE).read_bytes()[:8] == PNG


def _history(steps: int, with_metrics: bool) -> list[dict]:
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "reward": 0.1 * step, "reward_std": 0.05, "loss": 0.0}
        if with_metrics:
            row |= {"safevocab/safe_size_mean": 4.0 + step, "safevocab/pruned_mass_mean": 1e-3}
            row |= {key: 1e-4 * step for key in MISMATCH_KEYS}
        rows.append(row)
    return rows + [{"step": steps, "train_runtime": 1.0}]


@pytest.mark.parametrize("with_metrics", [True, False])
def test_the_curves_are_drawn_with_or_without_the_safe_set_and_mismatch_metrics(tmp_path, with_metrics):
    path = write_training_curves(_history(5, with_metrics), tmp_path)
    assert path == tmp_path / PLOT_FILE and path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_no_reward_logged_means_no_figure(tmp_path):
    assert write_training_curves([{"step": 1, "train_runtime": 1.0}], tmp_path) is None
    assert not (tmp_path / PLOT_FILE).exists()
