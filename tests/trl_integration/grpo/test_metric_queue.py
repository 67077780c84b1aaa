"""The metric queue: rows computed for a stack of generation batches equal the rows computed batch by batch, and a
trainer that queues its metrics logs the values of one that computes them every step."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from trl_helpers import build_tokenizer, grpo_kwargs, make_trainer, prompt_dataset, vowel_reward

from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration.grpo.metric_queue import MetricQueue, queue_capacity, step_metric_rows
from trl_integration.grpo.step import SafeTokenStats, StepSettings, safe_vocabulary_step

IS_MODES = ["sequence_mask", "token_truncate", "sequence_truncate", "token_mask"]


def random_batch(g: torch.Generator, rows: int, width: int, case: int):
    """One batch's step inputs, of ``width`` completion positions, with the awkward cases mixed in: completions of
    every length, an empty batch, NaN rollout log-probabilities, tokens outside the safe set, a loss-only mask."""
    completion = (torch.arange(width) < torch.randint(0, width + 1, (rows, 1), generator=g)).long()
    if case % 7 == 3:
        completion.zero_()  # nothing counts
    train = -torch.rand(rows, width, generator=g) * (6.0 if case % 2 else 0.5)
    rollout = train + torch.randn(rows, width, generator=g) * (0.5 if case % 3 else 1e-3)
    if case % 4 == 1:
        rollout[torch.rand(rows, width, generator=g) < 0.2] = float("nan")
    batch = {"completion_mask": completion, "sampling_per_token_logps": rollout}
    if case % 5 == 2:
        batch["tool_mask"] = (torch.rand(rows, width, generator=g) < 0.9).long()
    stats = SafeTokenStats(
        in_safe=torch.rand(rows, width, generator=g) < 0.9,
        log_kept_mass=-torch.rand(rows, width, generator=g) * 1e-2,
        safe_size=torch.randint(1, 30, (rows, width), generator=g),
    )
    return batch, train, stats


@pytest.mark.parametrize(
    "settings",
    [
        StepSettings(importance_sampling=True, mismatch_metrics=True, is_mode=mode, is_clip_min=clip, out_of_set=oos)
        for mode, clip, oos in zip(IS_MODES, [None, 0.5, None, 0.5], ["mask_token", "mask_sequence"] * 2)
    ]
    + [
        StepSettings(mismatch_metrics=True, mismatch_buckets=(0.01, 0.3)),  # no ratio, other buckets
        StepSettings(importance_sampling=True, sampling_metrics=False),
        StepSettings(importance_sampling=True, mismatch_metrics=True, zero_mismatch=True),  # mismatch/removed/*
        StepSettings(),  # safe-set statistics only
    ],
    ids=lambda s: f"is={s.importance_sampling}-{s.is_mode}-mm={s.mismatch_metrics}-zero={s.zero_mismatch}",
)
def test_stacked_rows_equal_the_rows_of_each_batch(settings):
    g = torch.Generator().manual_seed(0)
    results = []
    for case in range(12):  # twelve batches of 5 rows and 1 to 9 positions: padded to 9 when stacked
        batch, train, stats = random_batch(g, rows=5, width=1 + case % 9, case=case)
        results.append(safe_vocabulary_step(batch, train, stats, settings))
    inputs = [r.metric_inputs for r in results]
    stacked = step_metric_rows(inputs)
    for item, row in zip(inputs, stacked):
        alone = item.row()  # the batch's row computed on its own [B, T] tensors (the pre-queue computation)
        assert row.names == alone.names
        torch.testing.assert_close(row.counts, alone.counts, rtol=0, atol=0)
        torch.testing.assert_close(row.values, alone.values, rtol=2e-6, atol=1e-7, equal_nan=True)


def test_the_queue_appends_what_an_immediate_reduction_appends_in_batch_order():
    g = torch.Generator().manual_seed(1)
    settings = StepSettings(importance_sampling=True, mismatch_metrics=True)
    queued, immediate = MetricQueue(capacity=4), MetricQueue(capacity=1)
    stores = {"queued": defaultdict(lambda: defaultdict(list)), "immediate": defaultdict(lambda: defaultdict(list))}
    for step in range(4):
        batch, train, stats = random_batch(g, rows=4, width=3 + step, case=step)
        mode = "eval" if step == 2 else "train"
        inputs = safe_vocabulary_step(batch, train, stats, settings).metric_inputs
        if immediate.add(mode, [inputs]):
            immediate.flush(stores["immediate"], lambda t: t, torch.device("cpu"))
        full = queued.add(mode, [inputs])
        assert full == (step == 3) and len(queued) == step + 1  # nothing computed before the queue is full
    queued.flush(stores["queued"], lambda t: t, torch.device("cpu"))
    assert len(queued) == 0
    for mode in ("train", "eval"):
        got, want = stores["queued"][mode], stores["immediate"][mode]
        # one value per batch of the mode (batch 3 counts no token: its token metrics are left out)
        assert list(got) == list(want) and len(got["safevocab/seq_kl_estimate"]) == (1 if mode == "eval" else 3)
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=2e-6, abs=1e-7, nan_ok=True), name


def test_queue_capacity_keeps_large_batches_to_a_flush_per_step():
    assert queue_capacity(64, 8) == 16  # the bundled job: 16 batches, 0.5 MB of inputs
    assert queue_capacity(256, 4096) == 1  # 64 MiB per batch: no queue
    with pytest.raises(ValueError, match="capacity=0"):
        MetricQueue(capacity=0)


def test_a_trainer_that_queues_its_metrics_logs_what_one_without_a_queue_logs(tiny_model_dir, tmp_path):
    """Four steps logged every second step, rollouts in bf16 (a mismatch to measure): the logged values with the
    queue (rows of two steps computed at each log) equal those of a trainer that computes every step's row at once."""
    logs = {}
    for capacity in (16, 1):
        trainer = make_trainer(tiny_model_dir, tmp_path / str(capacity), max_steps=4, logging_steps=2,
                               rollout_dtype="bfloat16", seed=3)  # fmt: skip
        trainer._metric_queue.capacity = capacity
        trainer.train()
        logs[capacity] = [h for h in trainer.state.log_history if "mismatch/kl" in h]
    assert len(logs[16]) == len(logs[1]) == 2
    for with_queue, without in zip(logs[16], logs[1]):
        assert set(with_queue) == set(without)
        for name, value in without.items():
            if name.startswith(("mismatch/", "safevocab/", "sampling/")):
                assert with_queue[name] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), name
    assert any(not math.isclose(h["mismatch/kl"], 0.0) for h in logs[1])  # a mismatch was measured


def test_an_unbounded_completion_length_builds_a_trainer_without_a_queue(tiny_model_dir, tmp_path):
    """trl accepts max_completion_length=None; the queue's size cannot be bounded then (it raised a TypeError)."""
    assert queue_capacity(64, None) == 1
    trainer = make_trainer(tiny_model_dir, tmp_path, max_completion_length=None)
    assert trainer._metric_queue.capacity == 1


def test_rows_of_a_batch_where_nothing_counts_stay_on_the_batch_device():
    """On an accelerator, an undefined share (nothing counts) was a CPU NaN beside the device's counts, and joining
    the rows failed. The meta device stands in for a GPU here."""
    from safevocab.mismatch import MetricRow
    from trl_integration.grpo.replay import replay_metrics
    from trl_integration.grpo.step import ROLLOUT_LOGPROBS_FRAC, rollout_logprobs_coverage

    completion = torch.zeros(2, 3, dtype=torch.long, device="meta")
    frac, n, _ = rollout_logprobs_coverage(torch.zeros(2, 3, device="meta"), completion, None)
    assert frac.device.type == "meta"
    coverage = MetricRow((ROLLOUT_LOGPROBS_FRAC,), frac.float().reshape(1), n.double().reshape(1))
    sizes = torch.zeros(2, 3, dtype=torch.long, device="meta")
    stats = SafeTokenStats(
        *(torch.zeros(2, 3, device="meta") for _ in range(3)), replay_size=sizes, rule_safe_size=sizes
    )
    replay = MetricRow.from_dicts(*replay_metrics(stats, completion.bool()))
    assert {replay.values.device.type, replay.counts.device.type} == {"meta"}
    assert MetricRow.cat([coverage, replay]).values.device.type == "meta"


def test_a_rollout_func_keeps_handing_trl_its_own_log_probabilities(tiny_model_dir, tmp_path):
    """The recorded tensor replaces trl's lists only for trl's own single-turn generation, not under a rollout_func
    (which may call trl's generation and hand over log-probabilities of its own)."""
    plain = make_trainer(tiny_model_dir, tmp_path / "plain")
    assert plain._rollout_logprobs_as_tensor()
    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path / "func"))
    custom = SafeVocabGRPOTrainer(
        model=tiny_model_dir, reward_funcs=vowel_reward, args=args, train_dataset=prompt_dataset(),
        processing_class=build_tokenizer(), rollout_func=lambda prompts, trainer: None,
    )  # fmt: skip
    assert not custom._rollout_logprobs_as_tensor()
