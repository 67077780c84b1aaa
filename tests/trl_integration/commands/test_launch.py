"""``safevocab-grpo --num_processes N`` / ``--accelerate_config``: the processes are really launched, as `trl grpo`
launches them, and the command's own checks run first.

The end-to-end tests count the processes from inside the run: the reward function (a module written into the test's
folder) records, in every process, the rank and world size of torch.distributed and of accelerate's state (what the
Trainer trains with), so one process running twice, or two processes that joined a group the Trainer does not use
(seen: without ``ACCELERATE_USE_CPU`` each CPU process trained alone), cannot pass.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trl_integration.commands import grpo
from trl_integration.commands.launch import launcher_flags

TINY_RUN = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
            "--max_completion_length", "4", "--eval_num_prompts", "0", "--report_to", "none"]  # fmt: skip


def _refuse(message: str) -> None:
    raise ValueError(message)


def test_num_processes_selects_a_multi_process_launcher():
    """accelerate's plain launcher would start one process for --num_processes 2 on a machine without GPUs."""
    flags = launcher_flags(["--num_processes", "2"], _refuse)
    assert flags[0] == "--multi_gpu" and flags[1:3] == ["--num_processes", "2"]
    assert launcher_flags(["--num_processes", "1"], _refuse)[:2] == ["--num_processes", "1"]


def test_accelerate_config_names_resolve_to_trls_files():
    import importlib.resources as resources

    flags = launcher_flags(["--accelerate_config", "zero2"], _refuse)
    assert flags[:2] == ["--config_file", str(resources.files("trl.accelerate_configs").joinpath("zero2.yaml"))]
    assert "--multi_gpu" not in flags  # the config file chooses the distribution


def test_a_config_file_path_is_taken_as_is(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    assert launcher_flags(["--accelerate_config", str(config)], _refuse)[:2] == ["--config_file", str(config)]


@pytest.mark.parametrize("leftover, name", [
    (["--max_stepz", "3"], "--max_stepz"), (["--num_proc", "2"], "--num_proc"), (["stray"], "stray"),
    (["--accelerate_config", "zero9"], "zero9"),
])  # fmt: skip
def test_flags_nobody_knows_are_refused_by_name(leftover, name):
    with pytest.raises(ValueError, match=name):
        launcher_flags(leftover, _refuse)


def test_launcher_keys_in_the_yaml_launch_too(tmp_path, monkeypatch, capsys):
    """`num_processes: 2` in the --config YAML is a launcher flag (trl's CLI treats leftover YAML keys so); the
    checks run first, then the launch (replaced here by a recorder: the real launch is the next test)."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: {_tiny()}\ndataset_name: synthetic\nnum_processes: 2\n")
    seen = []
    monkeypatch.setattr(grpo, "launch", lambda flags, argv, prog: seen.append((flags, argv)) or 0)
    assert grpo.run(["--config", str(config), "--output_dir", str(tmp_path / "out")]) is None
    ((flags, argv),) = seen
    assert flags[:3] == ["--multi_gpu", "--num_processes", "2"]
    assert argv == ["--config", str(config), "--output_dir", str(tmp_path / "out")]


def _tiny() -> str:
    from trl_integration.demo.model import tiny_model_path

    return str(tiny_model_path())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_recording_reward(folder: Path) -> str:
    """A reward module that writes ``rank-<r>.json`` (rank and world size, from torch.distributed) in each process."""
    (folder / "rank_reward.py").write_text(
        textwrap.dedent(f"""
        import json, os
        import torch.distributed as dist
        from accelerate import PartialState

        def reward(completions, **kwargs):
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            state = PartialState()  # what the Trainer trains with: a process group torch joined is not enough
            with open(os.path.join({str(folder)!r}, f"rank-{{rank}}.json"), "w") as f:
                json.dump({{"rank": rank, "world_size": world, "pid": os.getpid(),
                            "trainer_processes": state.num_processes, "trainer_rank": state.process_index}}, f)
            return [float(len(c)) for c in completions]
    """)
    )
    return "rank_reward.reward"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The command in a process group of its own: on a timeout the launched ranks are killed with it (a rank left
    waiting in a collective would otherwise outlive the test)."""
    import os
    import signal

    cmd = [sys.executable, "-m", "trl_integration.commands.grpo", *argv]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after 600 s:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _ranks(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]


def test_two_processes_train_as_one_group(tmp_path):
    reward = _rank_recording_reward(tmp_path)
    argv = ["--model_name_or_path", _tiny(), "--dataset_name", "synthetic", "--reward_funcs", reward, *TINY_RUN,
            "--num_processes", "2", "--main_process_port", str(_free_port()), "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = _run(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}, ranks
    assert len({r["pid"] for r in ranks}) == 2
    assert [(r["trainer_rank"], r["trainer_processes"]) for r in ranks] == [(0, 2), (1, 2)], ranks
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert proc.stdout.count("safevocab-grpo summary") == 1  # the main process prints it
    assert "processes" in proc.stdout and "2 (each step:" in proc.stdout  # the summary says two processes trained
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["keep_logits_bytes"] == 0


@pytest.mark.slow
def test_a_failing_process_fails_the_command_in_one_line(tmp_path):
    (tmp_path / "bad_reward.py").write_text("def reward(completions, **kwargs):\n    raise RuntimeError('boom')\n")
    argv = ["--model_name_or_path", _tiny(), "--dataset_name", "synthetic", "--reward_funcs", "bad_reward.reward",
            *TINY_RUN, "--num_processes", "2", "--main_process_port", str(_free_port()), "--output_dir",
            str(tmp_path / "out")]  # fmt: skip
    proc = _run(argv, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("safevocab-grpo: error: ") and "processes failed" in last, proc.stderr[-3000:]
    assert "boom" in proc.stderr  # each process's own one-line error is shown


@pytest.mark.slow
def test_an_accelerate_config_file_launches_its_processes(tmp_path):
    """The DDP recipe (examples/recipes/ddp.yaml: MULTI_GPU, 8 processes, bf16) with --num_processes 2 overriding
    its count; on a CPU the processes join a gloo group."""
    recipe = Path(__file__).resolve().parents[3] / "examples" / "recipes" / "ddp.yaml"
    reward = _rank_recording_reward(tmp_path)
    argv = ["--model_name_or_path", _tiny(), "--dataset_name", "synthetic", "--reward_funcs", reward, *TINY_RUN,
            "--accelerate_config", str(recipe), "--num_processes", "2", "--mixed_precision", "no",
            "--main_process_port", str(_free_port()), "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = _run(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(r["trainer_rank"], r["trainer_processes"]) for r in _ranks(tmp_path)] == [(0, 2), (1, 2)]


def test_without_launcher_flags_the_command_trains_in_this_process():
    assert launcher_flags([], _refuse) == []


@pytest.mark.slow
def test_accelerate_launch_of_a_gpu_recipe_on_cpu_runs_one_distributed_job(tmp_path):
    """Issue 31: `accelerate launch --config_file examples/recipes/ddp.yaml --num_processes 2 -m
    trl_integration.commands.grpo` (accelerate's own launcher, not this command's) on a CPU started two processes that
    never joined one group: two trainings into one folder. They now join one gloo group, and one summary is printed."""
    import os

    recipe = Path(__file__).resolve().parents[3] / "examples" / "recipes" / "ddp.yaml"
    reward = _rank_recording_reward(tmp_path)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(recipe), "--num_processes", "2",
           "--main_process_port", str(_free_port()), "-m", "trl_integration.commands.grpo", "--model_name_or_path",
           _tiny(), "--dataset_name", "synthetic", "--reward_funcs", reward, *TINY_RUN, "--output_dir",
           str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(r["trainer_rank"], r["trainer_processes"]) for r in _ranks(tmp_path)] == [(0, 2), (1, 2)]
    assert proc.stdout.count("safevocab-grpo summary") == 1
    assert proc.stdout.count("settings that differ from trl's") == 1  # notices once per command, not per process


def test_processes_that_did_not_join_are_refused_in_one_line():
    from trl_integration.commands.launch import check_joined

    check_joined(1, 1)
    check_joined(2, 2)
    with pytest.raises(ValueError, match="WORLD_SIZE=2 .* did not join one process group .* same --output_dir"):
        check_joined(2, 1)


@pytest.mark.parametrize("main", [True, False])
def test_only_the_main_process_runs_the_held_out_evaluation(main):
    """Under ``accelerate launch`` both processes evaluated the same weights (issue 38 point 6); only the main one
    prints the summary, so only it evaluates."""
    from types import SimpleNamespace

    import torch

    from trl_integration.commands.grpo import ARITHMETIC_DATASET_NAME, SafeVocabScriptArguments, _arithmetic_evaluator

    script_args = SafeVocabScriptArguments(dataset_name=ARITHMETIC_DATASET_NAME, eval_num_prompts=4)
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(is_main_process=main, unwrap_model=lambda model: model), model=torch.nn.Linear(1, 1),
        processing_class=None, args=SimpleNamespace(disable_tqdm=True),
    )  # fmt: skip
    evaluate = _arithmetic_evaluator(script_args, trainer)
    assert (evaluate is not None) == main
