"""SafeVocabGRPOTrainer end to end on a tiny CPU model: steps, masking, stock equivalence, IS and mismatch."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl_helpers import PROMPTS, build_tokenizer, grpo_kwargs, make_trainer, prompt_dataset, vowel_reward

from safevocab import TopK, safe_log_softmax
from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer

REQUIRED_METRICS = [
    "safevocab/out_of_set_frac",
    "safevocab/pruned_mass_mean",
    "safevocab/pruned_mass_max",
    "safevocab/safe_size_mean",
    "safevocab/seq_tv_estimate",
    "mismatch/log_ppl_abs_diff",
    "mismatch/k3_kl",
    "mismatch/chi2_token",
    "mismatch/chi2_seq",
    "mismatch/is_raw_mean",
    "mismatch/is_raw_max",
    "mismatch/is_clipped_frac",
]


def generate_batch(trainer, n_prompts: int = 2):
    """One generation batch through the trainer's own pipeline (rollout, scoring, masking, metrics), no update.

    The batch is scored by the separate pass (``safe_vocab_scoring="separate"``), so that its masks, ratio and
    metrics can be inspected before any loss pass; test_batch.py shows the loss-forward path equals it."""
    trainer.args.safe_vocab_scoring = "separate"
    trainer._batch_settings = replace(trainer._batch_settings, scoring="separate")  # built once, from the config
    trainer.model.train()
    g = trainer.num_generations
    inputs = [{"prompt": PROMPTS[i]} for i in range(n_prompts) for _ in range(g)]
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(inputs)
    trainer.flush_metrics()  # the trainer computes its metrics when trl logs: now
    return output


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


RULES = [
    ("min_p=0.05", {}),
    ("top_k=5", {}),
    ("top_p=0.9", {}),
    ("top_k=10,min_p=0.05", {}),
    ("none", {"rollout_logprobs": True}),  # rule "none" records (and measures) only when switched on
    # the sampler does not prune: with mask_sequence every sequence can be masked, which stops a run by default
    ("min_prob=0.02", {"safe_vocab_in_sampler": False, "safe_vocab_empty_step": "warn"}),
]


STEP_CASES = [(rule, extra, "mask_token") for rule, extra in RULES] + [
    (rule, extra, "mask_sequence")
    for rule, extra in RULES
    if rule in ("min_p=0.05", "top_k=10,min_p=0.05", "min_prob=0.02")
]


@pytest.mark.parametrize("rule, extra, out_of_set", STEP_CASES, ids=[f"{r}-{m}" for r, _, m in STEP_CASES])
def test_grpo_steps(tiny_model_dir, tmp_path, rule, extra, out_of_set):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, safe_vocab_rule=rule, safe_vocab_out_of_set=out_of_set, max_steps=2, **extra
    )
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])
        # mismatch/* are measured on the tokens left in the loss: none when every sequence was masked
        required = REQUIRED_METRICS if h["safevocab/masked_token_frac"] < 1.0 else REQUIRED_METRICS[:5]
        for key in required:
            assert key in h and h[key] is not None and math.isfinite(h[key]), key
        assert 0.0 <= h["safevocab/seq_tv_estimate"] <= 1.0
    assert any(k.startswith("mismatch/abs_diff/p=") for h in steps for k in h)
    if rule == "none":
        assert all(h["safevocab/pruned_mass_max"] == 0.0 for h in steps)
    else:
        assert any(h["safevocab/pruned_mass_max"] > 0.0 for h in steps)
    if rule == "min_prob=0.02":  # the sampler does not prune: sampled tokens fall outside S
        assert any(h["safevocab/out_of_set_frac"] > 0.0 for h in steps)


@pytest.mark.parametrize("out_of_set", ["mask_token", "mask_sequence"])
def test_out_of_set_tokens_are_masked(tiny_model_dir, tmp_path, out_of_set):
    # The sampler keeps every token but the trainer's set is the top 3: many sampled tokens fall outside it.
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        safe_vocab_rule="top_k=3",
        safe_vocab_in_sampler=False,
        safe_vocab_out_of_set=out_of_set,
        vllm_importance_sampling_correction=False,
    )
    out = generate_batch(trainer)
    g = trainer.last_generation
    completion = out["completion_mask"].bool()
    outside = completion & ~g["in_safe"].bool()
    assert outside.any() and not outside.all()
    loss_mask = (out["completion_mask"] * out["tool_mask"]).bool()
    if out_of_set == "mask_token":
        assert torch.equal(loss_mask, completion & g["in_safe"].bool())
    else:
        bad_rows = outside.any(dim=-1)
        assert not loss_mask[bad_rows].any()
        assert torch.equal(loss_mask[~bad_rows], completion[~bad_rows])
    assert out["num_items_in_batch"].item() == loss_mask.sum().item()
    frac = trainer.metric_store["train"]["safevocab/out_of_set_frac"][-1]
    assert frac == pytest.approx(outside.sum().item() / completion.sum().item())
    # the attention mask (completion_mask) is untouched: only the loss mask changed
    assert torch.equal(out["completion_mask"].bool(), completion)
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, out)
    assert torch.isfinite(loss)


def test_rule_none_matches_stock_grpo(tiny_model_dir, tmp_path):
    """Rule 'none' with default settings is stock trl: in fp32, the same logged loss and rewards and weights equal to
    1e-6 relative as GRPOTrainer on the same seed, for 6 steps (issue 14). Nothing else is set: no IS switch-off, no
    sampler setting."""
    common = dict(beta=0.04, max_steps=6, temperature=0.8)
    stock = make_trainer(tiny_model_dir, tmp_path / "stock", trainer_cls=GRPOTrainer, config_cls=GRPOConfig, **common)
    stock.train()
    ours = make_trainer(tiny_model_dir, tmp_path / "ours", safe_vocab_rule="none", **common)
    ours.train()
    for key in ("loss", "grad_norm", "kl", "entropy", "reward", "reward_std"):
        a, b = logged(stock, key), logged(ours, key)
        assert len(a) == len(b) == 6, key
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9), key
    assert logged(stock, "kl")[-1] > 0.01  # the comparison is not vacuous: the policy moved
    worst = 0.0
    for (_name, p), q in zip(stock.model.named_parameters(), ours.model.parameters(), strict=True):
        worst = max(worst, float((p - q).abs().max() / p.abs().max()))
    assert worst <= 1e-6, worst
    # and no project extra ran: nothing recorded, no IS, no safevocab/mismatch metric
    assert not any(k.startswith(("safevocab/", "mismatch/")) for h in ours.state.log_history for k in h)


def test_fp32_rollout_ratio_is_one_and_stock_trl_is_offset(tiny_model_dir, tmp_path):
    """Sampler top_k=5, fp32 rollout: our ratio pi_S/mu is 1; trl's temperature-only log-probs are off by
    log(kept mass), the trl issue 6789 offset."""
    ours = make_trainer(
        tiny_model_dir,
        tmp_path / "ours",
        safe_vocab_rule="top_k=5",
        rollout_dtype="float32",
        vllm_importance_sampling_mode="token_truncate",
        temperature=0.9,
    )
    out = generate_batch(ours)
    g = ours.last_generation
    mask = g["loss_mask"].bool()
    log_r = (g["train_logps"] - g["rollout_logps"])[mask]
    assert log_r.abs().max().item() < 1e-4
    ratio = out["importance_sampling_ratio"][mask]
    assert ratio.mean().item() == pytest.approx(1.0, abs=1e-4)
    assert ours.metric_store["train"]["mismatch/is_raw_mean"][-1] == pytest.approx(1.0, abs=1e-4)

    # Stock trl's training log-probabilities on the very same tokens (its own fused head, temperature only).
    stock = make_trainer(
        tiny_model_dir, tmp_path / "stock", trainer_cls=GRPOTrainer, config_cls=GRPOConfig, top_k=5, temperature=0.9
    )
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    with torch.no_grad():
        keep = out["completion_ids"].size(1)
        trl_logps, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, attn, keep)
    stock_log_r = (trl_logps - g["rollout_logps"])[mask]
    log_kept = g["log_kept_mass"][mask]
    torch.testing.assert_close(stock_log_r, log_kept, atol=1e-4, rtol=1e-4)
    assert torch.exp(stock_log_r).mean().item() < 0.99  # stock trl's ratio is biased low
    assert log_kept.max().item() < 0


def test_stock_semantics_reproduced_with_sampler_mismatch(tiny_model_dir, tmp_path):
    """rule 'none' + sampler top_k (trl's vLLM setting): the ratio's log equals the sampler's log kept mass."""
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        safe_vocab_rule="none",
        safe_vocab_in_sampler=False,
        top_k=5,
        vllm_importance_sampling_mode="token_truncate",
    )
    out = generate_batch(trainer)
    g = trainer.last_generation
    mask = g["loss_mask"].bool()
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    keep = out["completion_ids"].size(1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=attn).logits[:, -keep - 1 : -1]
    sampler_kept = safe_log_softmax(logits, out["completion_ids"], TopK(5)).log_kept_mass
    log_r = g["log_raw_ratio"][mask]
    torch.testing.assert_close(log_r, sampler_kept[mask], atol=1e-4, rtol=1e-4)
    assert trainer.metric_store["train"]["mismatch/is_raw_mean"][-1] < 0.99


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rollout_precision_mismatch_metrics(tiny_model_dir, tmp_path, dtype):
    trainer = make_trainer(tiny_model_dir, tmp_path, safe_vocab_rule="min_p=0.05", rollout_dtype=dtype)
    generate_batch(trainer, n_prompts=4)
    m = {k: v[-1] for k, v in trainer.metric_store["train"].items()}
    if dtype == "bfloat16":
        assert m["mismatch/abs_logp_diff_mean"] > 1e-3
        assert m["mismatch/k3_kl"] > 1e-7
        assert m["mismatch/log_ppl_abs_diff"] > 1e-4
        assert abs(m["mismatch/chi2_token"]) > 1e-6
        assert m["mismatch/is_raw_max"] > m["mismatch/is_raw_min"] + 1e-3
    else:
        assert m["mismatch/abs_logp_diff_max"] < 1e-4
        assert abs(m["mismatch/k3_kl"]) < 1e-8
        assert m["mismatch/is_raw_mean"] == pytest.approx(1.0, abs=1e-4)


def test_explicit_rollout_dtype_overrides_mixed_precision(tiny_model_dir, tmp_path):
    """Under bf16 mixed precision, accelerate's autocast wraps the forward, so trl's rollouts run in bf16 like the
    training pass ('auto': no mismatch); rollout_dtype='float32' really samples in fp32 (mismatch appears)."""
    diffs = {}
    for dtype in ("auto", "float32"):
        trainer = make_trainer(
            tiny_model_dir, tmp_path / dtype, safe_vocab_rule="min_p=0.05", bf16=True, rollout_dtype=dtype, max_steps=1
        )
        trainer.train()
        g = trainer.last_generation
        diffs[dtype] = (g["train_logps"] - g["rollout_logps"])[g["loss_mask"].bool()].abs().max().item()
        assert "forward" in vars(trainer.model)  # accelerate's wrapper is back in place after the rollout
    assert diffs["auto"] < 1e-5
    assert diffs["float32"] > 1e-3


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo"])
def test_generate_path_ratio_equals_trl_multiplication(tiny_model_dir, tmp_path, loss_type):
    """Folding the ratio into the advantages gives exactly trl's `per_token_loss * importance_sampling_ratio`."""
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        safe_vocab_rule="min_p=0.05",
        vllm_importance_sampling_mode="token_truncate",
        beta=0.05,
    )
    out = generate_batch(trainer)
    g = torch.Generator().manual_seed(1)
    out["importance_sampling_ratio"] = 0.5 + torch.rand(out["completion_ids"].shape, generator=g)
    trainer.current_gradient_accumulation_steps = 1
    trainer.loss_type = loss_type
    trainer._batch_settings = replace(trainer._batch_settings, loss_type=loss_type)  # built once, from the config
    ours = trainer._compute_loss(trainer.model, out)
    trainer.use_vllm = True  # trl's own code path: multiplies the per-token loss by the ratio
    try:
        reference = GRPOTrainer._compute_loss(trainer, trainer.model, out)
    finally:
        trainer.use_vllm = False
    no_ratio = dict(out)
    del no_ratio["importance_sampling_ratio"]
    unweighted = trainer._compute_loss(trainer.model, no_ratio)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(ours, unweighted, atol=1e-6), "the ratio must matter in this test"


def test_same_seed_same_metrics(tiny_model_dir, tmp_path):
    runs = []
    for i in range(2):
        trainer = make_trainer(tiny_model_dir, tmp_path / str(i), safe_vocab_rule="top_k=10,min_p=0.05", max_steps=1)
        trainer.train()
        runs.append({k: v for k, v in trainer.state.log_history[0].items() if k.startswith(("safevocab", "mismatch"))})
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:
        assert runs[0][k] == pytest.approx(runs[1][k], nan_ok=True), k


def test_args_must_be_safevocab_config(tiny_model_dir, tmp_path):
    with pytest.raises(TypeError, match="SafeVocabGRPOConfig"):
        SafeVocabGRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=vowel_reward,
            args=GRPOConfig(**grpo_kwargs(tmp_path)),
            train_dataset=prompt_dataset(),
            processing_class=build_tokenizer(),
        )


def test_eval_logs_safe_vocabulary_metrics(tiny_model_dir, tmp_path):
    args = SafeVocabGRPOConfig(
        **grpo_kwargs(
            tmp_path,
            safe_vocab_rule="top_k=5",
            max_steps=1,
            eval_strategy="steps",
            eval_steps=1,
            per_device_eval_batch_size=4,
        )
    )
    trainer = SafeVocabGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=prompt_dataset(),
        eval_dataset=prompt_dataset(1),
        processing_class=build_tokenizer(),
    )
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert evals and math.isfinite(evals[-1]["eval_loss"])
    assert evals[-1]["eval_safevocab/safe_size_mean"] == pytest.approx(5.0, abs=0.5)
    assert "eval_mismatch/k3_kl" in evals[-1]


@pytest.mark.parametrize("pad_to_multiple_of", [None, 16], ids=["unpadded", "pad_to_multiple_of"])
def test_single_turn_rollout_logprobs_equal_trls_own_tensor(tiny_model_dir, tmp_path, monkeypatch, pad_to_multiple_of):
    """Single-turn rollouts hand trl no per-completion lists: the trainer sets trl's padded
    ``sampling_per_token_logps`` from the recording itself. It must be exactly the tensor trl builds from the lists
    (the path tool turns still take), padding after each completion's end included."""
    trainer = make_trainer(tiny_model_dir, tmp_path, pad_to_multiple_of=pad_to_multiple_of, max_completion_length=12)
    direct = generate_batch(trainer, n_prompts=4)
    monkeypatch.setattr(trainer, "_rollout_logprobs_as_tensor", lambda: False)
    via_trl = generate_batch(trainer, n_prompts=4)
    assert torch.equal(direct["completion_ids"], via_trl["completion_ids"])  # the same rollout (same seed)
    lengths = direct["completion_mask"].sum(1)
    assert (lengths < direct["completion_ids"].shape[1]).any()  # some completions end early: padding is exercised
    assert direct["sampling_per_token_logps"].dtype == via_trl["sampling_per_token_logps"].dtype
    assert torch.equal(direct["sampling_per_token_logps"], via_trl["sampling_per_token_logps"])
