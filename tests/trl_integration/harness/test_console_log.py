"""The per-step console output shows trl's own keys (issue 38 point 3); the project's ``safevocab/*`` and
``mismatch/*`` metrics stay in ``trainer.state.log_history`` (and reach the ``report_to`` callbacks), and
``safe_vocab_print_metrics=True`` prints them too."""

from __future__ import annotations

import ast

import pytest
from transformers import TrainerCallback
from trl_helpers import build_model, build_tokenizer, grpo_kwargs, prompt_dataset, vowel_reward

from trl_integration import HardenedSafeVocabGRPOTrainer, SafeVocabGRPOConfig
from trl_integration.harness.console_log import PROJECT_PREFIXES, console_keys

PROJECT = ("safevocab/", "mismatch/")


class _SeenByIntegrations(TrainerCallback):
    """Stands for a ``report_to`` integration: records every dictionary ``on_log`` hands it."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def _train(tmp_path, stock: bool = False, **overrides):
    """Two logged steps of the tiny test job; ``stock``: trl's own ``GRPOTrainer`` with the same settings."""
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = build_tokenizer()
    seen = _SeenByIntegrations()
    config, trainer_class = (GRPOConfig, GRPOTrainer) if stock else (SafeVocabGRPOConfig, HardenedSafeVocabGRPOTrainer)
    kwargs = grpo_kwargs(tmp_path, report_to="none", save_strategy="no", **overrides)
    if stock:
        kwargs = {k: v for k, v in kwargs.items() if k in GRPOConfig.__dataclass_fields__}
    args = config(**kwargs)
    trainer = trainer_class(
        model=build_model(tokenizer), reward_funcs=vowel_reward, args=args, train_dataset=prompt_dataset(),
        processing_class=tokenizer, callbacks=[seen],
    )  # fmt: skip
    trainer.train()
    return trainer, seen


def _printed_dicts(out: str) -> list[dict]:
    """The dictionaries transformers' console callback printed (one per line)."""
    return [ast.literal_eval(line[line.index("{") :]) for line in out.splitlines() if "{'" in line]


@pytest.mark.parametrize("disable_tqdm", [True, False], ids=["printer", "progress_bar"])
def test_the_console_shows_trls_keys_and_the_logs_keep_every_metric(tmp_path, capsys, disable_tqdm):
    trainer, seen = _train(tmp_path, disable_tqdm=disable_tqdm)
    printed = _printed_dicts(capsys.readouterr().out)
    steps = [logs for logs in printed if "loss" in logs]
    assert len(steps) == 2
    for logs in printed:
        assert not [key for key in logs if key.startswith(PROJECT)], sorted(logs)
    history = [logs for logs in trainer.state.log_history if "loss" in logs]
    assert any(key.startswith("safevocab/") for key in history[0])
    assert any(key.startswith("safevocab/") for key in seen.logs[0])  # the integrations get every key
    assert any(key.startswith("sampling/") for key in history[0])  # the generate path's importance ratio, logged


def test_the_console_shows_the_keys_stock_trl_shows(tmp_path, capsys):
    _train(tmp_path / "ours", disable_tqdm=True)
    ours = [logs for logs in _printed_dicts(capsys.readouterr().out) if "loss" in logs]
    _train(tmp_path / "stock", stock=True, disable_tqdm=True)
    stock = [logs for logs in _printed_dicts(capsys.readouterr().out) if "loss" in logs]
    assert len(ours) == len(stock) == 2
    assert list(ours[0]) == list(stock[0]), set(ours[0]) ^ set(stock[0])


def test_the_flag_prints_the_projects_metrics(tmp_path, capsys):
    _train(tmp_path, safe_vocab_print_metrics=True, max_steps=1)
    printed = _printed_dicts(capsys.readouterr().out)
    assert any(key.startswith("safevocab/") for key in printed[0])


def test_console_keys_drops_the_projects_metrics_also_under_eval():
    logs = {"loss": 1.0, "safevocab/safe_size_mean": 3.0, "eval_mismatch/k3_kl": 0.1, "eval_loss": 2.0, "step": 1,
            "sampling/importance_sampling_ratio/min": 1.0, "lr_base": 1e-3, "length_decay/factor": 0.5}  # fmt: skip
    assert console_keys(logs) == {
        "loss": 1.0,
        "eval_loss": 2.0,
        "step": 1,
        "sampling/importance_sampling_ratio/min": 1.0,
    }
    assert console_keys(logs, PROJECT_PREFIXES + ("sampling/",)) == {"loss": 1.0, "eval_loss": 2.0, "step": 1}
    assert "safevocab/safe_size_mean" in logs  # the shared dict is untouched
