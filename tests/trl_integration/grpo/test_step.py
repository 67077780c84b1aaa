"""The trainer's safe-vocabulary step as pure functions: hand-made tensors, values worked out by hand, no trainer."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from safevocab.mismatch import reduce_gathered
from trl_integration.grpo.batch import HANDLE_KEY, BatchSettings, GenerationBatch, LossReplay, PendingGeneration
from trl_integration.grpo.step import (
    MASKED_TOKEN_FRAC,
    SafeTokenStats,
    StepSettings,
    concat_records,
    metric_rows,
    old_policy_stats,
    out_of_set_masks,
    rollout_logprobs_coverage,
    safe_vocabulary_step,
    score_in_loss,
)

T, F = True, False

# Two sequences of four tokens: row 0 has three completion tokens (the second one outside S), row 1 has two (both
# in S). The fourth token of row 0 and the last two of row 1 are padding, whose in_safe values must not matter.
COMPLETION = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
IN_SAFE = torch.tensor([[T, F, T, F], [T, T, F, F]])


def stats(in_safe=IN_SAFE) -> SafeTokenStats:
    return SafeTokenStats(
        in_safe=in_safe,
        log_kept_mass=torch.full(in_safe.shape, math.log(0.9)),
        safe_size=torch.full(in_safe.shape, 7, dtype=torch.int64),
    )


# ---------------------------------------------------------------------------------------------- out-of-set masks


def test_token_wise_mask_drops_the_out_of_set_token_only():
    masks = out_of_set_masks(COMPLETION, None, IN_SAFE, "mask_token")
    assert masks.keep.tolist() == [[T, F, T, T], [T, T, T, T]]  # padding is "kept": it is not counted anyway
    assert masks.tool_mask.tolist() == [[1, 0, 1, 1], [1, 1, 1, 1]]
    assert masks.loss_mask.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]
    assert masks.counted.tolist() == COMPLETION.bool().tolist()
    assert masks.tool_mask.dtype == COMPLETION.dtype


def test_sequence_wise_mask_drops_the_whole_sequence():
    masks = out_of_set_masks(COMPLETION, None, IN_SAFE, "mask_sequence")
    assert masks.keep.tolist() == [[F, F, F, F], [T, T, T, T]]
    assert masks.loss_mask.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]


def test_a_token_trl_already_left_out_of_the_loss_does_not_drop_its_sequence():
    tool_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])  # e.g. a tool-call token: not in the loss
    masks = out_of_set_masks(COMPLETION, tool_mask, IN_SAFE, "mask_sequence")
    assert masks.loss_mask.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]
    assert masks.tool_mask.tolist() == tool_mask.tolist()
    token_wise = out_of_set_masks(COMPLETION, tool_mask, torch.tensor([[F, T, T, T], [T, T, T, T]]), "mask_token")
    assert token_wise.tool_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]  # trl's zeros stay zeros


def test_unknown_out_of_set_mode_is_refused():
    with pytest.raises(ValueError, match="mode='drop'"):
        out_of_set_masks(COMPLETION, None, IN_SAFE, "drop")
    with pytest.raises(ValueError, match="out_of_set='drop'"):
        StepSettings(out_of_set="drop")


# ---------------------------------------------------------------------------------------------- importance ratio

TRAIN = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -0.3, 0.0, 0.0]])
# log(pi_train / pi_rollout) = [[0.4, 5.0 (out of set), -0.3, pad], [0.1, 0.2, pad, pad]]
ROLLOUT = TRAIN - torch.tensor([[0.4, 5.0, -0.3, 9.0], [0.1, 0.2, 9.0, 9.0]])


def is_step(mode, clip_min=None, clip_max=1.3, out_of_set="mask_token"):
    batch = {"completion_mask": COMPLETION, "sampling_per_token_logps": ROLLOUT}
    settings = StepSettings(
        out_of_set=out_of_set, importance_sampling=True, is_mode=mode, is_clip_min=clip_min, is_clip_max=clip_max
    )
    return safe_vocabulary_step(batch, TRAIN, stats(), settings)


@pytest.mark.parametrize(
    "mode, expected",
    [
        # token modes: exp(log-ratio) on the loss tokens, 1 elsewhere (log-ratio 0), then truncated / masked at 1.3
        ("token_truncate", [[1.3, 1.0, math.exp(-0.3), 1.0],
                            [math.exp(0.1), math.exp(0.2), 1.0, 1.0]]),
        ("token_mask", [[0.0, 1.0, math.exp(-0.3), 1.0], [math.exp(0.1), math.exp(0.2), 1.0, 1.0]]),
        # sequence modes: exp of the log-ratios summed over the loss tokens: 0.4 - 0.3 = 0.1 (not 5.1) and 0.3
        ("sequence_truncate", [[math.exp(0.1)], [1.3]]),
        ("sequence_mask", [[math.exp(0.1)], [0.0]]),
    ],
)  # fmt: skip
def test_importance_ratio_per_mode_over_the_final_mask(mode, expected):
    result = is_step(mode)
    ratio = result.entries["importance_sampling_ratio"]
    torch.testing.assert_close(ratio, torch.tensor(expected), rtol=1e-6, atol=0)
    # the out-of-set token's log-ratio of 5 is outside the support: it never enters the ratio or its raw value
    assert result.record["log_raw_ratio"].abs().max() < 1.0


def test_sequence_mode_support_drops_a_masked_sequence():
    result = is_step("sequence_truncate", clip_max=10.0, out_of_set="mask_sequence")
    # row 0 left the loss: its log-ratio sums over no token (ratio 1); row 1 keeps 0.1 + 0.2
    torch.testing.assert_close(result.entries["importance_sampling_ratio"], torch.tensor([[1.0], [math.exp(0.3)]]))


def test_without_importance_sampling_no_ratio_is_set():
    batch = {"completion_mask": COMPLETION, "sampling_per_token_logps": ROLLOUT}
    result = safe_vocabulary_step(batch, TRAIN, stats(), StepSettings(mismatch_metrics=True))
    assert "importance_sampling_ratio" not in result.entries and result.record["importance_sampling_ratio"] is None
    assert not any(k.startswith(("mismatch/is_", "sampling/")) for k in result.metrics)
    assert set(batch) == {"completion_mask", "sampling_per_token_logps"}  # the step leaves the batch alone


# ---------------------------------------------------------------------------------------------- metric rows


def test_metric_row_against_values_computed_by_hand():
    batch = {"completion_mask": COMPLETION, "sampling_per_token_logps": ROLLOUT}
    settings = StepSettings(importance_sampling=True, mismatch_metrics=True, is_mode="token_truncate", is_clip_max=2.0)
    result = safe_vocabulary_step(batch, TRAIN, stats(), settings)
    m, c = result.metrics, result.counts

    # safe-set statistics over the 5 counted tokens (before the masking): one of them is outside S
    assert float(m["safevocab/out_of_set_frac"]) == pytest.approx(1 / 5)
    assert float(m[MASKED_TOKEN_FRAC]) == pytest.approx(1 / 5) and float(c[MASKED_TOKEN_FRAC]) == 5
    assert float(m["safevocab/pruned_mass_mean"]) == pytest.approx(0.1, rel=1e-6)
    assert float(m["safevocab/safe_size_mean"]) == 7
    # mismatch and ratio metrics over the 4 loss tokens: |log-ratios| 0.4, 0.3, 0.1, 0.2
    assert float(m["mismatch/abs_logp_diff_mean"]) == pytest.approx(0.25, rel=1e-6)
    assert float(m["mismatch/abs_logp_diff_max"]) == pytest.approx(0.4, rel=1e-6)
    assert float(c["mismatch/abs_logp_diff_mean"]) == 4
    ratios = [math.exp(0.4), math.exp(-0.3), math.exp(0.1), math.exp(0.2)]
    assert float(m["mismatch/is_mean"]) == pytest.approx(sum(ratios) / 4, rel=1e-6)
    assert float(m["mismatch/is_max"]) == pytest.approx(max(ratios), rel=1e-6)
    # trl's sampling/* metrics (generate path), over the same tokens
    assert float(m["sampling/sampling_logp_difference/mean"]) == pytest.approx(0.25, rel=1e-6)
    assert float(m["sampling/importance_sampling_ratio/min"]) == pytest.approx(math.exp(-0.3), rel=1e-6)
    assert c["sampling/importance_sampling_ratio/min"] == 4.0
    # bucket metrics: one per bucket edge pair, each with counts
    assert any(k.startswith("mismatch/abs_diff/p=") for k in m) and set(m) == set(c)

    vllm = safe_vocabulary_step(batch, TRAIN, stats(), StepSettings(importance_sampling=True, sampling_metrics=False))
    assert not any(k.startswith("sampling/") for k in vllm.metrics)  # trl logs them itself on vLLM


def test_zero_mismatch_replaces_the_rollout_and_logs_the_removed_gap():
    batch = {"completion_mask": COMPLETION, "sampling_per_token_logps": ROLLOUT}
    settings = StepSettings(importance_sampling=True, mismatch_metrics=True, zero_mismatch=True, is_mode="token_mask")
    result = safe_vocabulary_step(batch, TRAIN, stats(), settings)
    assert torch.equal(result.entries["sampling_per_token_logps"], TRAIN)
    assert result.entries["importance_sampling_ratio"].eq(1.0).all()
    assert float(result.metrics["mismatch/abs_logp_diff_max"]) == 0.0
    assert float(result.metrics["mismatch/removed/abs_logp_diff_max"]) == pytest.approx(0.4, rel=1e-6)
    assert torch.equal(result.record["measured_rollout_logps"], ROLLOUT)


def test_masks_and_ratio_without_measuring():
    batch = {"completion_mask": COMPLETION, "sampling_per_token_logps": ROLLOUT}
    result = safe_vocabulary_step(batch, TRAIN, stats(), StepSettings(importance_sampling=True), measure=False)
    assert result.metrics == {} and result.counts == {}
    assert set(result.entries) == {"tool_mask", "importance_sampling_ratio"}
    assert result.loss_mask.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]


def test_metric_rows_reduce_to_the_value_of_the_whole_batch():
    # micro-batch A: 2 tokens, 1 masked; B: 8 tokens, 2 masked, and a metric A lacks
    rows = [
        ({MASKED_TOKEN_FRAC: torch.tensor(0.5)}, {MASKED_TOKEN_FRAC: torch.tensor(2)}),
        ({MASKED_TOKEN_FRAC: torch.tensor(0.25), "mismatch/is_max": 3.0}, {MASKED_TOKEN_FRAC: 8.0}),
        ({MASKED_TOKEN_FRAC: 1.0}, {MASKED_TOKEN_FRAC: 0.0}),  # no token: left out
    ]
    names, table = metric_rows(rows)
    assert names == [MASKED_TOKEN_FRAC, "mismatch/is_max"]
    assert table.shape == (3, 2, 2) and table.dtype == torch.float64
    assert math.isnan(table[0, 0, 1]) and table[1, 1, 1] == 1.0  # missing value: NaN; missing count: 1
    reduced = reduce_gathered(names, table[:, 0], table[:, 1])
    assert reduced == {MASKED_TOKEN_FRAC: pytest.approx(3 / 10), "mismatch/is_max": 3.0}  # 3 of 10, not 0.375


# ---------------------------------------------------------------------------------------------- batch state


def test_old_policy_pass_is_found_by_value():
    policy, reference = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    first, second = stats(torch.tensor([[T, T]])), stats(torch.tensor([[T, F]]))
    captured = [(policy.clone(), first), (reference, second), (policy.clone(), second)]
    assert old_policy_stats(captured, policy) is first  # the first pass with equal values
    assert old_policy_stats(captured, torch.tensor([[-1.0, -2.5]])) is None
    assert old_policy_stats(captured, torch.tensor([[-1.0], [-2.0]])) is None  # same values, other shape


def _generation_batch(published: list, **settings) -> GenerationBatch:
    def score(inputs, model, for_loss):
        raise AssertionError("no extra pass expected")

    return GenerationBatch(
        BatchSettings(**settings), score, mode="train", gather=lambda t: t.reshape(-1),
        publish=lambda mode, rows, record: published.append((mode, rows, record)),
    )  # fmt: skip


def test_generation_batch_keeps_scoring_passes_only_while_trl_builds_it():
    """The passes trl runs while it builds the batch are kept (one is trl's old-policy pass, found by value); the
    batch's step then reads its safe sets from it and trl's batch gets one key of ours, a row handle per completion."""
    published: list = []
    batch = _generation_batch(published)
    old = TRAIN.clone()
    batch.keep_pass(old, stats())  # outside trl's build: not kept

    def trl_generate_and_score(inputs):
        batch.keep_pass(old.clone(), stats())  # trl's old-policy pass, then the reference pass
        batch.keep_pass(old - 1.0, stats(torch.ones_like(IN_SAFE)))
        return {"completion_ids": torch.zeros_like(COMPLETION), "completion_mask": COMPLETION,
                "old_per_token_logps": old, "num_items_in_batch": torch.tensor(99)}  # fmt: skip

    class TrlTrainer:  # trl's ratio switch is off on the generate path
        use_vllm = False

    output = batch.generate(trl_generate_and_score, [], TrlTrainer())
    assert batch.regime == "old_policy"
    assert [key for key in output if key.startswith("safevocab")] == [HANDLE_KEY]
    assert GenerationBatch.of(output) is batch and [row.index for row in output[HANDLE_KEY]] == [0, 1]
    expected = safe_vocabulary_step({"completion_mask": COMPLETION}, TRAIN, stats(), StepSettings())
    assert torch.equal(output["tool_mask"], expected.entries["tool_mask"])
    assert output["num_items_in_batch"].item() == expected.loss_mask.sum().item()  # recounted after the masking
    assert len(published) == 1 and published[0][2]["in_safe"] is not None
    batch.keep_pass(old, stats())  # after the build: not kept
    assert batch._captured is None


def test_loss_replay_refuses_another_batch():
    replay = LossReplay((2, 7), 3, ("logps", None, None))
    assert replay.take((2, 7), 3) == ("logps", None, None)
    with pytest.raises(RuntimeError, match=r"\(2, 8\) batch \(keep 3\).*scored \(2, 7\) \(keep 3\)"):
        replay.take((2, 8), 3)


def test_pending_generation_completes_and_concatenates_its_micro_batches():
    pending = PendingGeneration(expected=2)
    batch = {"completion_mask": COMPLETION}
    halves = [
        safe_vocabulary_step({"completion_mask": COMPLETION[i : i + 1]}, TRAIN[i : i + 1], stats(IN_SAFE[i : i + 1]),
                             StepSettings())
        for i in range(2)
    ]  # fmt: skip
    assert not pending.add(halves[0]) and pending.add(halves[1])
    whole = safe_vocabulary_step(batch, TRAIN, stats(), StepSettings()).record
    joined = concat_records(pending.records)
    for key, value in whole.items():
        assert (value is None and joined[key] is None) or torch.equal(value, joined[key]), key
    assert concat_records(pending.records[:1]) is pending.records[0]


def test_rollout_logprobs_coverage():
    rollout = torch.tensor([[-1.0, math.nan, -0.5, math.nan], [-0.2, -0.3, math.nan, math.nan]])
    frac, n, gap = rollout_logprobs_coverage(rollout, COMPLETION, None)
    assert (float(frac), int(n), bool(gap)) == (pytest.approx(4 / 5), 5, True)
    tool_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])  # the unrecorded token is not in the loss
    frac, n, gap = rollout_logprobs_coverage(rollout, COMPLETION, tool_mask)
    assert (float(frac), int(n), bool(gap)) == (1.0, 4, False)


@pytest.mark.parametrize(
    "choice, micro_batches, loss_type, expected",
    [
        ("auto", 1, "dapo", True),
        ("auto", 2, "grpo", True),
        ("auto", 2, "dapo", False),
        ("auto", 2, "vespo", False),
        ("loss_forward", 2, "dapo", True),
        ("separate", 1, "grpo", False),
    ],
)
def test_score_in_loss(choice, micro_batches, loss_type, expected):
    assert score_in_loss(choice, micro_batches, loss_type) is expected


def test_whole_vocabulary_stats():
    s = SafeTokenStats.whole_vocabulary(torch.zeros(2, 3), vocab_size=11)
    assert s.in_safe.all() and not s.log_kept_mass.any() and s.safe_size.eq(11).all()


# ---------------------------------------------------------------------------------------------- module boundaries


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_step_module_imports_neither_trl_nor_transformers():
    loaded = _modules_after_import("trl_integration.grpo.step")
    assert "trl" not in loaded and "transformers" not in loaded
