"""Exact support replay in the trainer (``safe_vocab_support="replay"``): a ``rollout_func`` returning the engine's
kept token ids per completion token (``"sampling_mask"``), trained on with ``fused_safe_logprobs(..., support=...)``.

The rollout function samples with the tiny model itself and builds each token's kept set from the trainer's own rule
(``keep_mask`` on the sampling logits), optionally perturbed (one non-sampled id dropped), so the replayed sets
either equal the rule's or differ from them in a known way.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from trl_helpers import grpo_kwargs, prompt_dataset, vowel_reward

from safevocab import SafeSupport, fused_safe_logprobs
from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration.grpo.batch import HANDLE_KEY
from trl_integration.grpo.out_of_set_alert import OutOfSetWarning
from trl_integration.grpo.replay import (
    REPLAY_FRAC,
    SUPPORT_DISAGREEMENT,
    per_sequence_supports,
    replay_metrics,
    select_support,
)
from trl_integration.grpo.step import SafeTokenStats

RULE = "top_k=6"


def make_rollout_func(perturb: bool, with_masks: bool = True, max_new: int = 6):
    """A rollout function sampling from the policy under the trainer's rule; ``last`` keeps its latest output."""

    @torch.no_grad()
    def rollout_func(prompts, trainer):
        tokenizer, model, rule = trainer.processing_class, trainer.model, trainer.safe_vocab_rule
        generator = torch.Generator().manual_seed(len(rollout_func.last) + 1)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "sampling_mask": []}
        for prompt in prompts:
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            completion, kept = [], []
            for _ in range(max_new):
                logits = model(torch.tensor([ids + completion])).logits[0, -1].float() / trainer.temperature
                keep = rule.keep_mask(logits)
                probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
                token = int(torch.multinomial(probs, 1, generator=generator))
                row = keep.nonzero().flatten().tolist()
                if perturb and len(row) > 1:
                    row.remove(next(t for t in row if t != token))  # the engine kept one token fewer
                completion.append(token)
                kept.append(row)
                if token == tokenizer.eos_token_id:
                    break
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["sampling_mask"].append(kept)
        if not with_masks:
            del out["sampling_mask"]
        rollout_func.last.append(out)
        return out

    rollout_func.last = []
    return rollout_func


def train(model_dir, tmp_path, rollout_func, **overrides):
    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, safe_vocab_rule=RULE, safe_vocab_support="replay", **overrides))
    trainer = SafeVocabGRPOTrainer(
        model=model_dir, reward_funcs=vowel_reward, args=args, train_dataset=prompt_dataset(),
        rollout_func=rollout_func,
    )  # fmt: skip
    trainer.train()
    return trainer


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# ----------------------------------------------------------------------------------------------------------------
# config


def test_config_field_and_cli_flag(tmp_path):
    assert SafeVocabGRPOConfig(**grpo_kwargs(tmp_path)).safe_vocab_support == "rule"
    with pytest.raises(ValueError, match=r"^safe_vocab_support='exact' is not accepted: accepted one of") as info:
        SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, safe_vocab_support="exact"))
    assert "\n" not in str(info.value)
    from trl import TrlParser

    assert "--safe_vocab_support {rule,replay}" in TrlParser(SafeVocabGRPOConfig).format_help()


# ----------------------------------------------------------------------------------------------------------------
# pure pieces


def test_replay_metrics_on_hand_made_tensors():
    counted = torch.tensor([[True, True, True, False], [True, True, False, False]])
    stats = SafeTokenStats(
        in_safe=torch.ones(2, 4, dtype=torch.bool),
        log_kept_mass=torch.zeros(2, 4),
        safe_size=torch.tensor([[3, 2, 1, 0], [4, 3, 0, 0]]),  # |S_rule & R|
        replay_size=torch.tensor([[3, 2, 2, 0], [4, 3, 0, 0]]),  # |R|: row 0 pos 2 keeps a token the rule drops
        rule_safe_size=torch.tensor([[3, 3, 1, 0], [4, 3, 0, 0]]),  # row 0 pos 1: the rule keeps one more
    )
    metrics, counts = replay_metrics(stats, counted)
    assert metrics[REPLAY_FRAC].item() == 1.0 and counts[REPLAY_FRAC].item() == 5
    assert metrics[SUPPORT_DISAGREEMENT].item() == pytest.approx(2 / 5) and counts[SUPPORT_DISAGREEMENT].item() == 5
    # A pass without replay: nothing replayed, disagreement undefined (NaN is skipped by the reduction).
    plain = SafeTokenStats(stats.in_safe, stats.log_kept_mass, stats.safe_size)
    metrics, counts = replay_metrics(plain, counted)
    assert metrics[REPLAY_FRAC].item() == 0.0 and counts[REPLAY_FRAC].item() == 5
    assert torch.isnan(metrics[SUPPORT_DISAGREEMENT]) and counts[SUPPORT_DISAGREEMENT].item() == 0


def test_select_support_rows_of_scored_positions():
    supports = per_sequence_supports([[[1, 2], [3]], [[4], [5, 6], [7]]], [[9, 9], [9, 9, 9]])
    scored = torch.tensor([[False, True, True, False, False], [False, False, True, True, True]])
    support = select_support(supports, scored)
    assert support.sizes.tolist() == [2, 1, 1, 2, 1] and support.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    # A completion masked out entirely (trl's mask_truncated_completions) contributes no row.
    assert select_support(supports, torch.tensor([[False] * 5, [False, False, True, True, True]])).num_rows == 3
    with pytest.raises(ValueError, match="sequence 0 has 1 scored completion tokens"):
        select_support(supports, torch.tensor([[False, False, True, False, False], [False] * 5]))
    with pytest.raises(ValueError, match=r"sampling_mask\[1\] has 3 rows for a completion of 2 tokens"):
        per_sequence_supports([[[1], [2]], [[1], [2], [3]]], [[9, 9], [9, 9]])


# ----------------------------------------------------------------------------------------------------------------
# training


@pytest.mark.parametrize("perturb", [False, True])
def test_replay_trains_on_the_engine_sets(tiny_model_dir, tmp_path, perturb):
    rollout_func = make_rollout_func(perturb)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(tiny_model_dir, tmp_path, rollout_func)
    assert not [w for w in caught if issubclass(w.category, OutOfSetWarning)]  # replayed sets: nothing out of set
    assert logged(trainer, REPLAY_FRAC) == [1.0, 1.0]
    disagreement = logged(trainer, SUPPORT_DISAGREEMENT)
    assert len(disagreement) == 2
    if perturb:
        assert all(d > 0 for d in disagreement)
    else:
        assert disagreement == [0.0, 0.0]

    # The scoring path (trl's batching loop, two chunks, over the patched head) gives fused_safe_logprobs(...,
    # support=...) on the same hidden states; with sets from the current weights, the rule's own log-probabilities
    # exactly when the sets are the rule's.
    out = rollout_func(["abc", "hello", "1+1=", "the cat"], trainer)
    tokenizer, model, rule = trainer.processing_class, trainer.model, trainer.safe_vocab_rule
    width = max(map(len, out["prompt_ids"]))
    length = max(map(len, out["completion_ids"]))
    rows, masks = [], []
    for p, c in zip(out["prompt_ids"], out["completion_ids"]):
        pad = tokenizer.pad_token_id
        rows.append([pad] * (width - len(p)) + p + c + [pad] * (length - len(c)))
        masks.append([0] * (width - len(p)) + [1] * (len(p) + len(c)) + [0] * (length - len(c)))
    input_ids, attention_mask = torch.tensor(rows), torch.tensor(masks)
    supports = per_sequence_supports(out["sampling_mask"], out["completion_ids"])
    trainer._replay.use(supports)
    with torch.no_grad():
        logps, _, _ = trainer.score_completion_tokens(model, input_ids, attention_mask, length, batch_size=2)
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    completion_mask = attention_mask[:, width:].bool()
    h = hidden[:, width - 1 : -1][completion_mask]
    targets = input_ids[:, width:][completion_mask]
    weight = model.lm_head.weight.detach()
    kept = [row for mask in out["sampling_mask"] for row in mask]
    expected = fused_safe_logprobs(h, weight, targets, rule, temperature=trainer.temperature,
                                   support=SafeSupport.from_lists(kept))  # fmt: skip
    torch.testing.assert_close(logps[completion_mask], expected.logprobs, rtol=1e-5, atol=1e-5)
    by_rule = fused_safe_logprobs(h, weight, targets, rule, temperature=trainer.temperature).logprobs
    gap = (expected.logprobs - by_rule).abs().max().item()
    assert gap > 1e-2 if perturb else gap < 1e-5


def test_batches_without_masks_fall_back_with_one_warning(tiny_model_dir, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(tiny_model_dir, tmp_path, make_rollout_func(False, with_masks=False))
    fallback = [w for w in caught if "returned no sampling masks" in str(w.message)]
    assert len(fallback) == 1, [str(w.message) for w in fallback]
    assert not [w for w in caught if issubclass(w.category, OutOfSetWarning)]  # sampled under the rule: silent
    assert logged(trainer, REPLAY_FRAC) == [0.0, 0.0]
    assert not logged(trainer, SUPPORT_DISAGREEMENT)


def test_replayed_sets_follow_their_sequences_through_trl_shuffle(tiny_model_dir, tmp_path):
    """Off-policy (trl's old-policy pass at generation) with two shuffled micro-batches per generation: every
    micro-batch row carries the replayed support of its own completion, and the replay metrics come from the
    old-policy pass."""
    rollout_func = make_rollout_func(True)
    trainer = train(
        tiny_model_dir, tmp_path, rollout_func,
        num_iterations=2, steps_per_generation=2, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-5,
    )  # fmt: skip
    assert logged(trainer, REPLAY_FRAC) == [1.0]  # one generation batch, measured by the old-policy pass
    out = rollout_func.last[-1]
    expected = {
        tuple(c): support
        for c, support in zip(out["completion_ids"], per_sequence_supports(out["sampling_mask"], out["completion_ids"]))
    }
    rows = 0
    for micro_batch in trainer._buffered_inputs:
        supports = [row.batch.supports[row.index] for row in micro_batch[HANDLE_KEY]]  # the rows trl shuffled
        for ids, mask, support in zip(micro_batch["completion_ids"], micro_batch["completion_mask"], supports):
            want = expected[tuple(ids[mask.bool()].tolist())]
            assert torch.equal(support.token_ids, want.token_ids) and torch.equal(support.offsets, want.offsets)
            rows += 1
    assert rows == 4
