"""``log_entropy_metrics``: the policy's entropy over the full softmax and over the safe set, per step."""

from __future__ import annotations

import pytest
import torch
from trl_helpers import build_tokenizer, grpo_kwargs, prompt_dataset, vowel_reward

from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration.grpo.entropy_metrics import ENTROPY_FULL, ENTROPY_KEPT, EntropyCapture


def train(model_dir, tmp_path, **config):
    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, log_entropy_metrics=True, **config))
    trainer = SafeVocabGRPOTrainer(
        model=model_dir, reward_funcs=vowel_reward, args=args, train_dataset=prompt_dataset(),
        processing_class=build_tokenizer(),
    )  # fmt: skip
    trainer.train()
    return [h for h in trainer.state.log_history if "entropy" in h]


def test_a_pruning_rule_logs_the_full_entropy_above_the_kept_one(tiny_model_dir, tmp_path):
    rows = train(tiny_model_dir, tmp_path, safe_vocab_rule="top_k=3")
    assert len(rows) == 2
    for row in rows:
        assert row[ENTROPY_KEPT] == pytest.approx(row["entropy"], rel=1e-6)  # trl's entropy is over S
        assert row[ENTROPY_KEPT] <= torch.log(torch.tensor(3.0)).item() + 1e-5  # at most log |S|
        assert row[ENTROPY_FULL] > row[ENTROPY_KEPT] + 1e-3  # the pruned tail adds entropy


def test_rule_none_logs_the_same_entropy_twice(tiny_model_dir, tmp_path):
    rows = train(tiny_model_dir, tmp_path, safe_vocab_rule="none", rollout_logprobs=True)
    for row in rows:
        assert row[ENTROPY_FULL] == row[ENTROPY_KEPT] == pytest.approx(row["entropy"], rel=1e-6)


def test_off_by_default(tiny_model_dir, tmp_path):
    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, safe_vocab_rule="top_k=3"))
    trainer = SafeVocabGRPOTrainer(
        model=tiny_model_dir, reward_funcs=vowel_reward, args=args, train_dataset=prompt_dataset(),
        processing_class=build_tokenizer(),
    )  # fmt: skip
    trainer.train()
    assert not any(ENTROPY_FULL in h for h in trainer.state.log_history)


def test_the_capture_averages_over_the_mask_and_the_processes():
    capture = EntropyCapture()
    kept = torch.tensor([[1.0, 2.0, 9.0]])
    full = torch.tensor([[3.0, 5.0, 9.0]])
    capture.keep(kept, full)
    metrics = {ENTROPY_KEPT: [], ENTROPY_FULL: []}
    capture.log(metrics, torch.tensor([[1, 1, 0]]), lambda t: t * 2)  # two processes with the same batch
    assert metrics == {ENTROPY_KEPT: [1.5], ENTROPY_FULL: [4.0]}
    capture.log(metrics, torch.tensor([[1, 1, 0]]), lambda t: t)  # one pass, logged once
    assert metrics[ENTROPY_KEPT] == [1.5]
