"""What the main job shows and leaves behind (issue 18, part B, point 6): progress bars on the held-out
evaluations, a summary that keeps paths whole when stdout is not a terminal, and the training curves beside
``summary.json``."""

from __future__ import annotations

import json

import pytest

from trl_integration.commands.grpo import run
from trl_integration.commands.summary_plots import MISMATCH_KEYS, PLOT_FILE, write_training_curves

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
            row |= dict.fromkeys(MISMATCH_KEYS, 0.0001 * step)
        rows.append(row)
    return rows + [{"step": steps, "train_runtime": 1.0}]


@pytest.mark.parametrize("with_metrics", [True, False])
def test_the_curves_are_drawn_with_or_without_the_safe_set_and_mismatch_metrics(tmp_path, with_metrics):
    path = write_training_curves(_history(5, with_metrics), tmp_path)
    assert path == tmp_path / PLOT_FILE and path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_no_reward_logged_means_no_figure(tmp_path):
    assert write_training_curves([{"step": 1, "train_runtime": 1.0}], tmp_path) is None
    assert not (tmp_path / PLOT_FILE).exists()


def test_the_summary_shows_the_rule_the_run_used_when_the_sampler_composes_with_it(tmp_path, capsys):
    """--top_k 5 with the default min_p=0.001: the sampler and the trainer use 'top_k=5,min_p=0.001' (the effective
    rule); the summary said 'min_p=0.001' before."""
    out = tmp_path / "run"
    run(["--max_steps", "1", "--top_k", "5", "--eval_num_prompts", "0", "--output_dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rule"] == "min_p=0.001" and summary["effective_rule"] == "top_k=5,min_p=0.001"
    table = capsys.readouterr().out
    assert "top_k=5,min_p=0.001 (--safe_vocab_rule min_p=0.001" in " ".join(table.split())
    # One step logs one reward: said so, not printed as "first -> last" of one point (issue 31 point 9).
    assert summary["reward_points"] == 1
    assert "reward (one logged point)" in table and "first -> last" not in table


def test_few_logged_rewards_are_not_averaged_into_one(tmp_path, capsys):
    """Two logged steps: first -> last are those two rewards (the means of up to three overlapped: 'a -> a')."""
    out = tmp_path / "run"
    run(["--max_steps", "2", "--logging_steps", "1", "--eval_num_prompts", "0", "--output_dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    logged = [h["reward"] for h in json.loads((out / "log_history.json").read_text()) if "reward" in h]
    assert summary["reward_points"] == 2 and len(logged) == 2
    assert (summary["reward_first"], summary["reward_last"]) == (logged[0], logged[1])


def test_the_commands_run_as_a_module(tmp_path):
    """``python -m trl_integration.commands grpo --help``, as ``safevocab grpo --help``."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "trl_integration.commands", "grpo", "--help"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--reward_funcs" in done.stdout and "arithmetic_reward" in done.stdout


def test_the_summary_of_rule_none_names_no_composition_order(tmp_path, capsys):
    """Rule 'none' composes nothing: the summary said 'none, composed in generate's order' (issue 38 point 6)."""
    run(["--max_steps", "1", "--safe_vocab_rule", "none", "--eval_num_prompts", "0", "--output_dir", str(tmp_path)])
    table = " ".join(capsys.readouterr().out.split())
    assert "none (no pruning: the full vocabulary)" in table and "composed in" not in table
    assert "[safevocab] torch threads: " in table  # logged by the trainer, shown by the command


def test_the_summary_has_a_length_decay_row(tmp_path, capsys):
    """With length decay on: the decays applied and the final LR factor (issue 38 point 6); none without it."""
    run(["--max_steps", "2", "--length_decay", "true", "--length_decay_start", "step0", "--length_decay_period", "1",
         "--eval_num_prompts", "0", "--output_dir", str(tmp_path)])  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    decay = summary["length_decay"]
    assert decay["decays"] == 1 and decay["decay_period"] == 1 and 0 < decay["final_factor"] < 1
    table = " ".join(capsys.readouterr().out.split())
    assert (
        f"length decay: decays, final LR factor │ 1 at step {decay['decay_steps'][0]}, {decay['final_factor']:.4g}"
        in table
    )


def test_the_reward_line_says_how_noisy_it_is_and_points_to_held_out_accuracy(capsys):
    """Issue 53: a 10-step summary showed reward 0.49 -> 0.28 for every rule while held-out accuracy rose; at 8 prompts
    a step that is noise, and the line now says how much (each end's standard error) and where to look instead."""
    from trl_integration.commands.summary import _reward_noise, _reward_row

    history = [{"reward": r} for r in (0.5, 0.4, 0.6, 0.3, 0.2, 0.35)]
    noise = _reward_noise(history)
    assert noise == pytest.approx(0.14289 / 3**0.5, rel=1e-4)  # sample sd 0.143 over sqrt(3 steps)
    summary = {"reward_points": 6, "reward_first": 0.5, "reward_last": 0.283, "reward_standard_error": noise,
               "prompts_per_step": 8}  # fmt: skip
    key, value = _reward_row(summary, lambda x: f"{x:.3f}")
    assert value == "0.500 -> 0.283 (each ± 0.082 at 8 prompts a step: noisy; held-out accuracy is the measure)"
    assert _reward_noise(history[:2]) is None  # two points: no estimate
