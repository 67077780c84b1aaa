"""Torch threads chosen when the trainer is built (issue 31 point 1): one thread for a small model or a busy machine,
the user's ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` kept, one line saying which and why."""

from __future__ import annotations

import os

import psutil
import pytest
import torch
from trl_helpers import build_model, build_tokenizer, prompt_dataset, vowel_reward

from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration.grpo import threads
from trl_integration.grpo.threads import choose_threads

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
        (dict(environ={"OMP_NUM_THREADS": ""}, parameters=10), 1, "0.00M parameters"),  # empty = unset, as torch reads it
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


@pytest.fixture
def torch_threads(monkeypatch):
    """Restores torch's count and the module's memory after the test; no thread variable set during it."""
    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_chosen", None)
    yield
    torch.set_num_threads(before)


def _build(tmp_path):
    tokenizer = build_tokenizer()
    args = SafeVocabGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1, per_device_train_batch_size=4,
                               num_generations=4, max_completion_length=4, save_strategy="no", use_cpu=True, bf16=False)  # fmt: skip
    return SafeVocabGRPOTrainer(model=build_model(tokenizer), reward_funcs=vowel_reward, args=args,
                                train_dataset=prompt_dataset(), processing_class=tokenizer)  # fmt: skip


@pytest.mark.skipif(TORCH_DEFAULT < 2, reason="one core: torch already runs one thread")
def test_the_trainer_runs_a_small_model_on_one_thread(tmp_path, torch_threads, capsys):
    torch.set_num_threads(TORCH_DEFAULT)  # as torch starts without a thread variable
    _build(tmp_path)
    assert torch.get_num_threads() == 1
    out = capsys.readouterr().out
    assert f"[safevocab] torch threads: {TORCH_DEFAULT} -> 1: the model has 0.0" in out and "(< 1M)" in out


def test_the_users_variable_wins(tmp_path, torch_threads, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    _build(tmp_path)
    assert torch.get_num_threads() == 2
    assert "[safevocab] torch threads: 2 (kept): OMP_NUM_THREADS=2 is set" in capsys.readouterr().out


def test_the_users_set_num_threads_wins(tmp_path, torch_threads, capsys):
    torch.set_num_threads(TORCH_DEFAULT + 1)
    _build(tmp_path)
    assert torch.get_num_threads() == TORCH_DEFAULT + 1
    assert f"torch.set_num_threads({TORCH_DEFAULT + 1}) was called" in capsys.readouterr().out
