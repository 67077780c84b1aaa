"""Checkpoints (issue 28, D10/D10b): real SIGKILLs during a save, resuming from the newest complete checkpoint, and
checkpoints without their optimizer, scheduler, length-decay or RNG state refused by name (or accepted, named).

The killed runs are new interpreters (``kill_during_save.py``; never forks of the test process, whose OpenMP pool
would hang them; the fast suite's three are forks of one new interpreter, made before any torch op runs) that SIGKILL
themselves at a chosen point of the save of step 3; the test process then resumes with ``resume_from_checkpoint=True`` and compares the
resumed run with an uninterrupted one: the same parameters and losses, bit for bit (one thread, CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from kill_during_save import RUN, make_trainer
from transformers import TrainerCallback

HELPERS = Path(__file__).resolve().parents[2] / "helpers"  # kill_during_save.py
KILLED_STEP = 3

#: Kill points of the save of step 3 (kill_during_save.py) and the checkpoint a resumed run must start from.
POINTS = {
    "model.safetensors:half": "checkpoint-2",  # the weights cut short (the old code: SafetensorError)
    "optimizer.pt:half": "checkpoint-2",  # (the old code: FileNotFoundError trainer_state.json)
    "rng_state.pth:after": "checkpoint-2",  # every file but trainer_state.json
    "trainer_state.json:half": "checkpoint-2",  # (the old code: JSONDecodeError)
    "trainer_state.json:after": "checkpoint-2",  # every file written, not yet published
    "published": "checkpoint-3",  # renamed into place, before the rotation and the clean-up
}
# The fast suite kills at one point of each outcome (issue 53): a half-written file (resumes from checkpoint-2) and a
# published checkpoint (resumes from checkpoint-3); the other four points, in the slow tier, end like the first.
DEFAULT_POINTS = ("optimizer.pt:half", "published")


def kill_in_fresh_interpreter(model_dir, output_dir, point, stock=False) -> int:
    """Run the killed training in a new interpreter (never a fork of this one: a child forked after torch's
    OpenMP pool has run with 2 threads hangs in it, as every kill test did on CI for 300 s each)."""
    argv = [sys.executable, str(HELPERS / "kill_during_save.py"), model_dir, str(output_dir), str(KILLED_STEP), point]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(argv + (["--stock"] if stock else []), env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    return result.returncode


@pytest.fixture(scope="module")
def killed(tiny_model_dir, tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """The fast suite's killed runs (``(point, stock)`` -> output folder), from one fresh interpreter that imports the
    stack once and forks a child per run (kill_during_save.py ``--batch``): ~5 CPU-seconds an interpreter saved."""
    runs = [(point, False) for point in DEFAULT_POINTS] + [("optimizer.pt:half", True)]
    root = tmp_path_factory.mktemp("killed")
    outs = {run: root / f"{i}" / "run" for i, run in enumerate(runs)}
    jobs = json.dumps([[str(outs[run]), *run] for run in runs])
    argv = [sys.executable, str(HELPERS / "kill_during_save.py"), tiny_model_dir, "--batch", str(KILLED_STEP), jobs]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [-signal.SIGKILL] * len(runs), result.stderr[-3000:]
    return outs


def parameters(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


class StepsTrained(TrainerCallback):
    """The optimizer steps a ``train()`` call ran (``trainer.state.log_history`` also holds the checkpoint's)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def steps_trained(trainer) -> list[int]:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepsTrained)).steps


def resume_latest(model_dir, output_dir, **overrides):
    """Resume with ``resume_from_checkpoint=True``; the trainer and the warnings that name ``output_dir``."""
    trainer = make_trainer(model_dir, output_dir, **overrides)
    trainer.add_callback(StepsTrained())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=True)
    return trainer, [str(w.message) for w in caught if str(output_dir) in str(w.message)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The killed runs train in interpreters with OMP_NUM_THREADS=1; bit-equal results need this process on one
    thread too (the suite's default is two, whose reductions round differently)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    trainer = make_trainer(tiny_model_dir, tmp_path_factory.mktemp("uninterrupted"))
    trainer.train()
    return parameters(trainer), losses(trainer)


def check_resumed(model_dir, out, expected: str, uninterrupted, skipped: str) -> None:
    """Resume ``out``: from ``expected`` with one warning naming ``skipped``, ending where the uninterrupted run ends."""
    trainer, messages = resume_latest(model_dir, out)
    assert len(messages) == 1, messages
    assert skipped in messages[0] and messages[0].endswith(f"resuming from {out / expected}"), messages[0]
    start = int(expected.split("-")[1])
    params, reference_losses = uninterrupted
    assert steps_trained(trainer) == list(range(start + 1, RUN["max_steps"] + 1))
    assert losses(trainer) == reference_losses  # the checkpoint's logged steps and the steps trained after it
    assert all(torch.equal(a, b) for a, b in zip(parameters(trainer), params))
    # The completed saves removed what the killed one left; save_total_limit=1 keeps the last checkpoint only.
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"checkpoint-{RUN['max_steps']}"]


# ----------------------------------------------------------------------------------------------------------------
# D10: a kill during a save


@pytest.mark.parametrize(
    "point", [p if p in DEFAULT_POINTS else pytest.param(p, marks=pytest.mark.slow) for p in POINTS]
)
def test_kill_during_a_save_resumes_from_the_newest_complete_checkpoint(tiny_model_dir, tmp_path, uninterrupted,
                                                                        point, request):  # fmt: skip
    if point in DEFAULT_POINTS:
        out = request.getfixturevalue("killed")[point, False]
    else:
        out = tmp_path / "run"
        kill_in_fresh_interpreter(tiny_model_dir, out, point)
    # The earlier checkpoint survived the kill (save_total_limit=1 rotates only after a save is complete), and no
    # checkpoint-3 exists unless it is complete.
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    check_resumed(tiny_model_dir, out, POINTS[point], uninterrupted, skipped=f"{out}/_incomplete-checkpoint-3")


def test_half_written_checkpoint_of_plain_trl_is_skipped(tiny_model_dir, tmp_path, killed):
    """Plain trl writes checkpoint-3 in place; killed while writing optimizer.pt, it leaves a checkpoint-3 without
    trainer_state.json. Resuming skips it, with one warning naming it, and resumes from plain trl's checkpoint-2
    (a complete checkpoint of plain trl) as plain trl's uninterrupted run continues: rule "none" is stock trl."""
    out = killed["optimizer.pt:half", True]
    assert (out / "checkpoint-3").is_dir() and not (out / "checkpoint-3" / "trainer_state.json").exists()
    reference = make_trainer(tiny_model_dir, tmp_path / "reference", stock=True)
    reference.train()
    uninterrupted = (parameters(reference), losses(reference))
    trainer, messages = resume_latest(tiny_model_dir, out, safe_vocab_rule="none")
    assert messages == [
        f"resume_from_checkpoint=True: skipped incomplete {out / 'checkpoint-3'} (trainer_state.json is missing); "
        f"resuming from {out / 'checkpoint-2'}",
        f"resuming from {out / 'checkpoint-2'}, which has no safevocab_settings.json (written by plain trl or an "
        "earlier release): its rule, learning-rate schedule and model cannot be checked against this run's",
    ]  # plain trl's checkpoint resumes, with one warning that its settings cannot be checked (issue 37, N6)
    assert steps_trained(trainer) == [3, 4] and losses(trainer) == uninterrupted[1]
    assert all(torch.equal(a, b) for a, b in zip(parameters(trainer), uninterrupted[0]))


@pytest.mark.slow
def test_two_processes_kill_resume_and_refuse(tiny_model_dir, tmp_path):
    """2 gloo processes (torchrun): process 1 is killed right after writing its rng_state_1.pth of step 3 (process 0
    is then ended by torchrun); resuming with both skips the staged save with one warning (process 0's), and the
    saves that follow hold both processes' RNG; a checkpoint without rng_state_1.pth is refused by both, by name."""
    import socket

    def torchrun(*args: str) -> subprocess.CompletedProcess:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                str(HELPERS / "kill_during_save.py"), tiny_model_dir, str(out), *args]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)

    out = tmp_path / "run"
    killed = torchrun(str(KILLED_STEP), "rng_state_1.pth:after")
    assert killed.returncode != 0 and "Signal 9" in killed.stdout + killed.stderr, killed.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["_incomplete-checkpoint-3", "checkpoint-2"]

    resumed = torchrun("--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warned = [line for line in resumed.stderr.splitlines() if "resume_from_checkpoint=True: skipped" in line]
    assert len(warned) == 1 and warned[0].endswith(f"resuming from {out / 'checkpoint-2'}"), warned
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-4"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (out / "checkpoint-4").iterdir()}

    os.remove(out / "checkpoint-4" / "rng_state_1.pth")
    refused = torchrun("--resume", str(out / "checkpoint-4"))
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if "ValueError: resume_from_checkpoint=" in line]
    assert len(errors) == 2, refused.stderr[-3000:]  # each process refuses ("[rank<r>]: ValueError: ...")
    assert all(f"'{out / 'checkpoint-4'}' lacks rng_state_1.pth: " in line for line in errors)


# ----------------------------------------------------------------------------------------------------------------
# what a resumed run needs


@pytest.fixture(scope="module")
def saved_run(tiny_model_dir, tmp_path_factory):
    """A run that saved checkpoint-2 (every file), kept for copies."""
    out = tmp_path_factory.mktemp("saved")
    make_trainer(tiny_model_dir, out, max_steps=2).train()
    return out


def copy_checkpoint(saved_run, tmp_path, remove=()) -> Path:
    target = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(saved_run / "checkpoint-2", target)
    for name in remove:
        os.remove(target / name)
    return target


@pytest.mark.parametrize("missing", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
@pytest.mark.parametrize("named", [True, False])
def test_checkpoint_without_its_state_is_refused_by_name(tiny_model_dir, tmp_path, saved_run, missing, named):
    """Named explicitly or chosen by ``True``, a checkpoint without optimizer, scheduler or RNG state is refused in one
    line naming the file and the checkpoint (transformers would resume with a fresh one, exit 0)."""
    checkpoint = copy_checkpoint(saved_run, tmp_path, remove=[missing])
    trainer = make_trainer(tiny_model_dir, tmp_path / "run")
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(checkpoint) if named else True)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"resume_from_checkpoint='{checkpoint}' lacks {missing}: resuming would silently ")
    assert "resume_allow_missing_state=True" in message
    assert trainer.state.global_step == 0  # refused before anything was loaded or trained


def test_the_opt_out_resumes_and_names_what_starts_fresh(tiny_model_dir, tmp_path, saved_run):
    checkpoint = copy_checkpoint(saved_run, tmp_path, remove=["optimizer.pt", "rng_state.pth"])
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", resume_allow_missing_state=True)
    with pytest.warns(UserWarning) as caught:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    ours = [str(w.message) for w in caught if str(checkpoint) in str(w.message)]
    assert ours[0] == (
        f"resuming from {checkpoint} without optimizer.pt, rng_state.pth (resume_allow_missing_state=True): the "
        "optimizer state and the learning-rate schedule (transformers loads the two only together); the "
        "random-number generators start fresh"
    )
    # saved with max_steps=2, resumed with 4: the linear schedule's horizon changes, said once (issue 37, N6)
    assert len(ours) == 2 and ours[1].startswith(f"resuming from {checkpoint} with changed settings: max_steps 2 -> 4 ")
    assert trainer.state.global_step == 4 and sorted(losses(trainer)) == [1, 2, 3, 4]  # resumed after step 2


def test_length_decay_needs_its_state_in_the_scheduler(tiny_model_dir, tmp_path, saved_run):
    """A length-decay run resuming from a checkpoint whose scheduler.pt holds another schedule (the surge detector's
    decision would silently restart) or none is refused by name."""
    decay = dict(length_decay=True, length_decay_period="2")
    checkpoint = copy_checkpoint(saved_run, tmp_path)  # saved without length decay: a LambdaLR state
    with pytest.raises(ValueError, match=r"lacks the length-decay state in scheduler\.pt: .*surge detector"):
        make_trainer(tiny_model_dir, tmp_path / "run", **decay).train(resume_from_checkpoint=str(checkpoint))
    os.remove(checkpoint / "scheduler.pt")
    with pytest.raises(ValueError, match=r"lacks scheduler\.pt: .*, and with it the length-decay state"):
        make_trainer(tiny_model_dir, tmp_path / "run", **decay).train(resume_from_checkpoint=str(checkpoint))


def test_a_length_decay_checkpoint_resumes(tiny_model_dir, tmp_path):
    decay = dict(length_decay=True, length_decay_period="2")
    first = make_trainer(tiny_model_dir, tmp_path / "a", save_total_limit=None, **decay)
    first.train()
    resumed = make_trainer(tiny_model_dir, tmp_path / "b", **decay)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert resumed.lr_scheduler.state_dict() == first.lr_scheduler.state_dict()  # the same detector and decision


@pytest.mark.parametrize(
    "damage, problem",
    [
        ("trainer_state.json", "trainer_state.json is missing"),
        ("model.safetensors", "model.safetensors is cut short"),
        ("scheduler.pt", "scheduler.pt is cut short"),
    ],
)
def test_incomplete_checkpoint_named_explicitly_is_refused(tiny_model_dir, tmp_path, saved_run, damage, problem):
    checkpoint = copy_checkpoint(saved_run, tmp_path)
    if damage == "trainer_state.json":
        os.remove(checkpoint / damage)
    else:
        os.truncate(checkpoint / damage, (checkpoint / damage).stat().st_size - 1)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run")
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(err.value).startswith(f"resume_from_checkpoint='{checkpoint}' is not a complete checkpoint: {problem};")


def test_jit_save_marker_makes_a_checkpoint_incomplete(tiny_model_dir, tmp_path, saved_run):
    """transformers' JIT save marks checkpoint-N with checkpoint-is-incomplete.txt until it is done."""
    copy_checkpoint(saved_run, tmp_path)
    shutil.copytree(tmp_path / "run" / "checkpoint-2", tmp_path / "run" / "checkpoint-3")
    (tmp_path / "run" / "checkpoint-3" / "checkpoint-is-incomplete.txt").write_text("in progress")
    out = tmp_path / "run"
    trainer, messages = resume_latest(tiny_model_dir, out)
    messages = [
        m for m in messages if "max_steps 2 -> 4" not in m
    ]  # saved_run trained 2 steps: said, not asserted here
    assert messages == [
        f"resume_from_checkpoint=True: skipped incomplete {out / 'checkpoint-3'} (checkpoint-is-incomplete.txt: "
        f"transformers' JIT save did not finish); resuming from {out / 'checkpoint-2'}"
    ]
    assert steps_trained(trainer) == [3, 4]


def test_no_complete_checkpoint_is_one_line(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-1").mkdir(parents=True)
    with pytest.raises(ValueError) as err:
        make_trainer(tiny_model_dir, out).train(resume_from_checkpoint=True)
    assert str(err.value) == (
        f"resume_from_checkpoint=True: no complete checkpoint in {out} (passed over: {out / 'checkpoint-1'} "
        "(trainer_state.json is missing))"
    )


def test_the_opt_out_is_a_bool(tmp_path):
    from trl_helpers import grpo_kwargs

    from trl_integration import SafeVocabGRPOConfig

    # a string is parsed as the command line parses it (Reliability IV, C1), anything else refused in one line
    assert SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, resume_allow_missing_state="yes")).resume_allow_missing_state
    with pytest.raises(TypeError, match="^resume_allow_missing_state='perhaps' is not accepted: accepted True, False"):
        SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, resume_allow_missing_state="perhaps"))


def test_cli_refuses_and_accepts_with_the_flag(tiny_model_dir, tmp_path, saved_run, capsys):
    from trl_integration.commands.grpo import main

    checkpoint = copy_checkpoint(saved_run, tmp_path, remove=["rng_state.pth"])
    argv = [
        "--model_name_or_path", tiny_model_dir, "--dataset_name", "synthetic", "--output_dir", str(tmp_path / "run"),
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
        "--max_steps", "3", "--report_to", "none", "--save_strategy", "no", "--use_cpu", "true", "--bf16", "false",
        "--no_gradient_checkpointing", "--disable_tqdm", "true", "--resume_from_checkpoint", str(checkpoint),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"safevocab-grpo: error: resume_from_checkpoint='{checkpoint}' lacks rng_state.pth: ")
    with pytest.warns(UserWarning, match="without rng_state.pth .*: the random-number generators start fresh"):
        assert main(argv + ["--resume_allow_missing_state", "true"]) == 0


# ----------------------------------------------------------------------------------------------------------------
# what a save writes


def test_best_model_checkpoint_names_the_published_checkpoint(tiny_model_dir, tmp_path):
    """transformers records the best checkpoint where it wrote it; the staged save records where it ends up."""
    import json

    from trl_helpers import prompt_dataset

    trainer = make_trainer(tiny_model_dir, tmp_path / "run", eval_dataset=prompt_dataset(4), eval_strategy="steps",
                           eval_steps=1, per_device_eval_batch_size=4, metric_for_best_model="reward",
                           greater_is_better=True, load_best_model_at_end=True, max_steps=3)  # fmt: skip
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and Path(best).parent == tmp_path / "run" and Path(best).is_dir()
    recorded = json.loads((Path(best) / "trainer_state.json").read_text())["best_model_checkpoint"]
    assert Path(recorded).parent == tmp_path / "run"
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith("_")]


def test_jit_save_replaces_its_marked_folder(tiny_model_dir, tmp_path):
    """transformers' JIT save creates checkpoint-N with its marker, then saves: the published checkpoint replaces it."""
    from transformers.trainer_jit_checkpoint import CheckpointManager

    out = tmp_path / "run"
    trainer = make_trainer(tiny_model_dir, out, max_steps=2, save_strategy="no")
    trainer.train()
    CheckpointManager(trainer).execute_jit_checkpoint()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-2"]
    assert not (out / "checkpoint-2" / "checkpoint-is-incomplete.txt").exists()
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
