"""``GenerationBatch`` (grpo/batch.py): one trl generation batch from the rollout to its last micro-batch's loss.

Its pieces on their own (the regime's inputs, the loss forward handed back once, a batch's rows found from trl's dict),
then the regimes end to end: ``safe_vocab_scoring`` takes on-policy batches' safe sets, importance ratio and metrics
from the loss's own forward pass (no extra scoring pass), which trains as with the separate scoring pass."""

from __future__ import annotations

import math

import pytest
import torch
import trl_helpers
from trl import GRPOConfig, GRPOTrainer
from trl_helpers import grpo_kwargs, prompt_dataset

from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration.grpo.batch import (
    HANDLE_KEY,
    BatchRow,
    BatchSettings,
    GenerationBatch,
    LossReplay,
    PendingGeneration,
)


def make_trainer(model_dir, tmp_path, trainer_cls=SafeVocabGRPOTrainer, config_cls=SafeVocabGRPOConfig, **config):
    # SGD: weights follow the gradients linearly, so equal gradients give equal weights (Adam's m/sqrt(v)
    # turns float-level noise on near-zero gradient entries into updates of size lr).
    config = {"optim": "sgd", "max_steps": 3, "learning_rate": 0.1, **config}
    return trl_helpers.make_trainer(
        model_dir, tmp_path, trainer_cls, config_cls, train_dataset=prompt_dataset(16), **config
    )


def test_a_trl_batch_dict_finds_its_generation_batch_through_its_rows():
    batch = GenerationBatch(BatchSettings(), score=None, mode="train", gather=None, publish=None)
    rows = {HANDLE_KEY: [BatchRow(batch, 0), BatchRow(batch, 1)], "completion_ids": torch.zeros(2, 3)}
    assert GenerationBatch.of(rows) is batch
    assert GenerationBatch.of({"completion_ids": torch.zeros(2, 3)}) is None  # trl's own batch: nothing of ours


def test_the_loss_forward_is_handed_back_once_and_only_for_the_same_batch():
    forward = (torch.zeros(2, 3), None, None)
    kept = LossReplay((2, 7), 3, forward)
    assert kept.take((2, 7), 3) is forward
    with pytest.raises(RuntimeError, match=r"asked for log-probabilities of a \(4, 7\) batch"):
        kept.take((4, 7), 3)
    batch = GenerationBatch(BatchSettings(), score=None, mode="train", gather=None, publish=None)
    batch._loss_forward = kept
    assert batch.replayed_forward((2, 7), 3) is forward
    assert batch.replayed_forward((2, 7), 3) is None  # once


def test_a_pending_generation_is_complete_after_its_last_micro_batch():
    class Step:  # what a StepResult hands PendingGeneration
        metric_inputs, record = "row", {"k": 1}

    pending = PendingGeneration(expected=2)
    assert not pending.add(Step()) and pending.add(Step())
    assert pending.rows == ["row", "row"] and len(pending.records) == 2


def test_the_settings_measure_only_with_rollout_log_probabilities_or_zero_mismatch():
    settings = BatchSettings(importance_sampling=True, mismatch_metrics=True, rollout_logprobs=True)
    with_rollout = settings.step({"sampling_per_token_logps": torch.zeros(1, 1)})
    assert with_rollout.importance_sampling and with_rollout.mismatch_metrics
    without = settings.step({})
    assert not without.importance_sampling and not without.mismatch_metrics
    assert BatchSettings(steps_per_generation=4).micro_batches("train") == 4
    assert BatchSettings(steps_per_generation=4).micro_batches("eval") == 1


def logged_steps(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


CASES = {
    # the bundled job's setting: min_p in the sampler, token-level IS, dapo, one micro-batch per generation
    "default": {},
    # sampled tokens outside the trainer's set, two micro-batches per generation, per-sequence loss (no IS here:
    # the unpruned sampler's ratios would mask whole sequences)
    "out_of_set_grpo_accumulation": dict(
        safe_vocab_rule="top_k=3",
        safe_vocab_in_sampler=False,
        loss_type="grpo",
        gradient_accumulation_steps=2,
        vllm_importance_sampling_correction=False,
    ),
    # whole sequences dropped, batch-normalised loss
    "mask_sequence_bnpo": dict(
        safe_vocab_rule="top_k=40",
        safe_vocab_in_sampler=False,
        safe_vocab_out_of_set="mask_sequence",
        loss_type="bnpo",
        vllm_importance_sampling_correction=False,
        per_device_train_batch_size=8,
    ),
    # precision mismatch, sequence-level IS, KL to a reference model
    "bf16_rollout_sequence_is_kl": dict(
        safe_vocab_rule="min_p=0.05",
        rollout_dtype="bfloat16",
        vllm_importance_sampling_mode="sequence_mask",
        beta=0.05,
    ),
    "zero_mismatch": dict(safe_vocab_rule="top_k=5", zero_mismatch=True),
    # each micro-batch runs twice in one optimizer step (still on-policy: trl scores no old log-probs)
    "two_iterations": dict(gradient_accumulation_steps=2, steps_per_generation=1, num_iterations=2, loss_type="grpo"),
    # ... with a count-normalised loss and masked tokens: every iteration divides by the recounted tokens
    "two_iterations_dapo_out_of_set": dict(
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        num_iterations=2,
        loss_type="dapo",
        safe_vocab_rule="top_k=3",
        safe_vocab_in_sampler=False,
        vllm_importance_sampling_correction=False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_forward_trains_like_the_separate_pass(tiny_model_dir, tmp_path, case):
    runs = {}
    for scoring in ("separate", "loss_forward"):
        trainer = make_trainer(tiny_model_dir, tmp_path / scoring, safe_vocab_scoring=scoring, **CASES[case])
        initial = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        runs[scoring] = trainer
    separate, fused = (logged_steps(runs[s]) for s in ("separate", "loss_forward"))
    assert len(separate) == len(fused) == 3
    for step, (a, b) in enumerate(zip(separate, fused)):
        assert a.keys() == b.keys(), set(a) ^ set(b)
        assert "safevocab/masked_token_frac" in a
        for key in a:
            if key == "step_time":
                continue
            if a[key] is None or math.isnan(a[key]):  # undefined (e.g. no token left): undefined in both
                assert b[key] is None or math.isnan(b[key]), (step, key, b[key])
                continue
            same = a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5)
            assert same, (step, key, a[key], b[key])
        assert a["grad_norm"] > 1e-3  # the step really moved the policy
    assert any(k.startswith("mismatch/") for h in separate for k in h)
    if case in ("out_of_set_grpo_accumulation", "mask_sequence_bnpo", "two_iterations_dapo_out_of_set"):
        fracs = [h["safevocab/masked_token_frac"] for h in separate]
        assert max(fracs) > 0 and min(fracs) < 1  # masking happened, and not of everything
    moved = 0.0
    for p, q, p0 in zip(runs["separate"].model.parameters(), runs["loss_forward"].model.parameters(), initial):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
        moved = max(moved, (q - p0).abs().max().item())
    assert moved > 1e-3


class _Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize(
    "scoring, loss_type, accumulation, separate_pass",
    [
        ("auto", "dapo", 1, False),  # one micro-batch per generation: exact for every loss
        ("auto", "grpo", 2, False),  # per-micro-batch normalisation: exact
        ("auto", "dapo", 2, True),  # num_items_in_batch spans micro-batches not yet run: separate pass
        ("loss_forward", "dapo", 2, False),
        ("separate", "grpo", 1, True),
    ],
)
def test_scoring_mode_decides_the_extra_pass(tiny_model_dir, tmp_path, scoring, loss_type, accumulation, separate_pass):
    common = dict(loss_type=loss_type, gradient_accumulation_steps=accumulation, max_steps=2)
    trainer = make_trainer(tiny_model_dir, tmp_path / "ours", safe_vocab_scoring=scoring, **common)
    score_batch = trainer._score_batch
    scoring_passes = _Counter(score_batch)  # the generation batches' separate passes, not their loss forwards
    trainer._score_batch = lambda inputs, model, for_loss: (score_batch if for_loss else scoring_passes)(
        inputs, model, for_loss
    )
    forwards = trainer._safe_head.begin = _Counter(trainer._safe_head.begin)
    trainer.train()
    stock = make_trainer(tiny_model_dir, tmp_path / "stock", GRPOTrainer, GRPOConfig, min_p=0.001, **common)
    stock_forwards = stock._get_per_token_logps_and_entropies = _Counter(stock._get_per_token_logps_and_entropies)
    stock.train()

    generations = 2  # one per optimizer step (steps_per_generation = gradient_accumulation_steps)
    assert scoring_passes.calls == (generations if separate_pass else 0)
    # the loss passes are stock trl's: one forward per micro-batch, plus the scoring pass when there is one
    assert stock_forwards.calls == generations * accumulation
    assert forwards.calls == stock_forwards.calls + scoring_passes.calls


def test_loss_forward_with_a_count_normalised_loss_over_micro_batches_keeps_trls_count(
    tiny_model_dir, tmp_path, monkeypatch
):
    """loss_forward + dapo + two micro-batches per generation: the out-of-set tokens of the second micro-batch are
    unknown when the first one's loss is computed, so ``num_items_in_batch`` stays trl's count (before the
    out-of-set mask), as documented; the separate pass recounts it."""
    seen: list[tuple[float, float, float]] = []
    trl_compute_loss = GRPOTrainer._compute_loss

    def recording(self, model, inputs):
        tool_mask = inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
        seen.append(
            (
                float(inputs["num_items_in_batch"]),
                float(inputs["completion_mask"].sum()),
                float((inputs["completion_mask"] * tool_mask).sum()),
            )
        )
        return trl_compute_loss(self, model, inputs)

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", recording)
    counts = {}
    for scoring in ("separate", "loss_forward"):
        seen.clear()
        trainer = make_trainer(
            tiny_model_dir, tmp_path / scoring, safe_vocab_scoring=scoring, loss_type="dapo",
            gradient_accumulation_steps=2, safe_vocab_rule="top_k=3", safe_vocab_in_sampler=False, max_steps=2,
        )  # fmt: skip
        trainer.train()
        assert len(seen) == 4  # 2 generations x 2 micro-batches
        counts[scoring] = [(seen[i][0], seen[i][1] + seen[i + 1][1], seen[i][2] + seen[i + 1][2]) for i in (0, 2)]
    for items, completion_tokens, loss_tokens in counts["separate"]:
        assert items == loss_tokens < completion_tokens  # recounted after masking (and masking happened)
    for items, completion_tokens, loss_tokens in counts["loss_forward"]:
        assert items == completion_tokens > loss_tokens  # trl's count


def test_scoring_mode_is_validated(tmp_path):
    with pytest.raises(ValueError, match="safe_vocab_scoring='later'"):
        SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, safe_vocab_scoring="later"))
