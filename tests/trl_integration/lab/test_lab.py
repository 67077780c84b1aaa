"""The controlled-mismatch lab on the trainer: injected logit noise, zero mismatch, config/CLI, fp16 pieces on CPU.

- Injected noise: ``|delta| <= eps`` on the transformed logits; the sampler draws from, and the recorder records,
  the perturbed distribution; every rollout token's gap to the training log-probability is within
  ``log(p + (1 - p) e^{2 eps})``.
- Zero mismatch: over a real GRPO step the rollout and training log-probabilities are bit-identical, while the
  gap measured before the replacement (bf16 rollout) is non-zero and logged.
- fp16: accelerate runs fp16 mixed precision (autocast + GradScaler) on CUDA only, so these tests cover what runs
  on a CPU: fp16 weights with an fp32 head through a real GRPO step, and loss scaling through the safe head.
"""

from __future__ import annotations

import math

import pytest
import torch
from trl_helpers import PROMPTS, build_model, build_tokenizer, grpo_kwargs, make_trainer

from safevocab import NoPruning, safe_log_softmax
from safevocab.bounds import logprob_mismatch_bound
from trl_integration import SafeVocabGRPOConfig
from trl_integration.rollout.perturbations import LogitNoiseProcessor, logit_noise
from trl_integration.rollout.recorder import RolloutLogprobRecorder, recording_generate


def loss_tokens(trainer, key="rollout_logps"):
    g = trainer.last_generation
    m = g["loss_mask"].bool()
    return g["train_logps"][m].double(), g[key][m].double()


# ----------------------------------------------------------------------------------------------------
# injected noise


@pytest.mark.parametrize("kind", ["uniform", "clipped_gaussian"])
def test_logit_noise_is_bounded_and_seeded(kind):
    eps = 0.3
    draw = lambda seed: logit_noise((64, 500), eps, kind, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    a, b, c = draw(1), draw(1), draw(2)
    assert a.abs().max().item() <= eps
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.abs().max().item() > 0.95 * eps  # it does use the range
    if kind == "clipped_gaussian":
        clipped = (a.abs() >= eps - 1e-7).double().mean().item()
        assert 0.02 < clipped < 0.08  # P(|N(0, (eps/2)^2)| >= eps) = 4.6%
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="eps"):
            logit_noise((2, 2), bad)
    with pytest.raises(ValueError, match="kind"):
        logit_noise((2, 2), 0.1, "laplace")


def test_noise_processor_perturbs_the_transformed_logits():
    scores = torch.randn(4, 50) * 5
    temperature = 0.7
    proc = LogitNoiseProcessor(0.2, seed=5, temperature=temperature)
    out = proc(torch.zeros(4, 3, dtype=torch.long), scores.clone())
    delta = (out.double() / temperature) - (scores.double() / temperature)  # what the softmax sees
    assert delta.abs().max().item() <= 0.2 + 1e-5  # hard bound, up to fp32 rounding of the sum
    assert delta.abs().max().item() > 0.15
    assert 0 < proc.max_abs_delta <= 0.2 and proc.num_calls == 1
    again = LogitNoiseProcessor(0.2, seed=5, temperature=temperature)(torch.zeros(4, 3, dtype=torch.long), scores)
    assert torch.equal(out, again)
    assert torch.equal(LogitNoiseProcessor(0.0)(None, scores), scores)


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return build_model(tok).eval(), tok


def test_generate_samples_from_and_records_the_perturbed_distribution(tiny):
    """The recorder (after the noise) records exactly the distribution the sampler drew from, which is the
    perturbed one: every sampled token's gap to the clean model is within the mismatch bound, and noise 0 gives
    no gap at all."""
    model, tok = tiny
    enc = tok(PROMPTS[:4], return_tensors="pt", padding=True)
    eps, temperature = 0.25, 0.8
    gaps = {}
    for noise in (eps, 0.0):
        recorder = RolloutLogprobRecorder(NoPruning(), temperature)
        proc = LogitNoiseProcessor(noise, seed=0, temperature=temperature)
        torch.manual_seed(0)
        with recording_generate(model, recorder, None, [proc]):
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                max_new_tokens=6,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
            )
        steps = len(out.scores)
        new = out.sequences[:, -steps:]
        # the scores the sampler drew from (after every processor and warper), re-normalised
        sampler_logps = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(recorder.logprobs, sampler_logps, atol=1e-5, rtol=1e-5)
        # the clean training distribution of the same tokens (full forward)
        attn = torch.cat([enc["attention_mask"], torch.ones_like(new)], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=out.sequences, attention_mask=attn, position_ids=pos).logits[:, -steps - 1 : -1]
        train = safe_log_softmax(logits, new, NoPruning(), temperature=temperature).logprobs
        gap = (train.double() - recorder.logprobs.double()).abs()
        bound = logprob_mismatch_bound(train.double().exp(), eps)
        assert torch.all(gap <= bound + 1e-5), (gap - bound).max()
        gaps[noise] = gap.max().item()
        assert proc.num_calls == steps
    assert gaps[eps] > 1e-2 and gaps[0.0] < 1e-4


def test_trainer_noise_step_within_bound(tiny_model_dir, tmp_path):
    eps = 0.2
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        safe_vocab_rule="none",
        rollout_dtype="float32",
        rollout_logit_noise=eps,
        rollout_logit_noise_kind="uniform",
        rollout_noise_seed=3,
        max_steps=1,
        temperature=0.9,
    )
    trainer.train()
    train, rollout = loss_tokens(trainer)
    gap = (train - rollout).abs()
    assert gap.max().item() > 1e-2  # the noise is there
    # fp32 engines add ~1e-6 of their own to the injected perturbation
    assert torch.all(gap <= logprob_mismatch_bound(train.exp(), eps) + 1e-4)
    assert 0 < trainer.rollout_mismatch.noise.max_abs_delta <= eps
    assert trainer.rollout_mismatch.noise.temperature == pytest.approx(0.9)
    logged = trainer.state.log_history[0]
    assert logged["mismatch/abs_logp_diff_max"] <= 2 * eps


# ----------------------------------------------------------------------------------------------------
# zero mismatch


def test_zero_mismatch_is_bit_identical_over_a_grpo_step(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        safe_vocab_rule="min_p=0.05",
        rollout_dtype="bfloat16",
        zero_mismatch=True,
        vllm_importance_sampling_mode="token_truncate",
        max_steps=1,
    )
    trainer.train()
    train, rollout = loss_tokens(trainer)
    assert train.numel() > 0
    assert (train - rollout).abs().max().item() == 0.0
    assert torch.equal(train, rollout)
    g = trainer.last_generation
    ratio = g["importance_sampling_ratio"][g["loss_mask"].bool()]
    assert torch.all(ratio == 1.0)
    h = trainer.state.log_history[0]
    for key in ("k3_kl", "abs_logp_diff_max", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert h[f"mismatch/{key}"] == 0.0, key
    assert h["mismatch/is_raw_min"] == h["mismatch/is_raw_max"] == 1.0
    # what was removed: the bf16 rollout's measured gap, non-zero, logged and kept for inspection
    _, measured = loss_tokens(trainer, "measured_rollout_logps")
    removed = (train - measured).abs().max().item()
    assert removed > 1e-3
    assert h["mismatch/removed/abs_logp_diff_max"] == pytest.approx(removed, rel=1e-4)


# ----------------------------------------------------------------------------------------------------
# config and command line


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(zero_mismatch=True, rollout_logit_noise=0.1), "contradictory"),
        (dict(rollout_logit_noise=-0.1), "rollout_logit_noise"),
        (dict(rollout_logit_noise=math.inf), "rollout_logit_noise"),
        (dict(rollout_logit_noise_kind="laplace"), "rollout_logit_noise_kind"),
        (dict(use_vllm=True, rollout_logit_noise=0.1), "use_vllm"),
        (dict(use_vllm=True, zero_mismatch=True), "use_vllm"),
        (
            dict(
                use_transformers_continuous_batching=True,
                rollout_logprobs=False,
                vllm_importance_sampling_correction=False,
                rollout_logit_noise=0.1,
            ),
            "continuous_batching",
        ),
    ],
)
def test_incoherent_lab_settings_raise(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, **kwargs))


def test_lab_flags_parse(tmp_path):
    from trl_integration.commands.grpo import make_parser

    _, cfg, _, _ = make_parser().parse_args_and_config(
        args=[
            "--output_dir", str(tmp_path), "--model_name_or_path", "m", "--use_cpu", "true",
            "--rollout_logit_noise", "0.05", "--rollout_logit_noise_kind", "clipped_gaussian",
            "--rollout_noise_seed", "7", "--rollout_dtype", "float16",
        ]
    )  # fmt: skip
    assert (cfg.rollout_logit_noise, cfg.rollout_logit_noise_kind, cfg.rollout_noise_seed) == (
        0.05,
        "clipped_gaussian",
        7,
    )
    assert cfg.rollout_dtype == "float16" and cfg.zero_mismatch is False
    _, cfg, _, _ = make_parser().parse_args_and_config(
        args=["--output_dir", str(tmp_path), "--model_name_or_path", "m", "--use_cpu", "true", "--zero_mismatch"]
    )
    assert cfg.zero_mismatch is True


# ----------------------------------------------------------------------------------------------------
# fp16


def test_fp16_on_cpu_warns_that_accelerate_ignores_it(tmp_path):
    with pytest.warns(UserWarning, match="fp16=True on a machine without"):
        cfg = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, fp16=True, cast_lm_head_to_fp32=True))
    assert cfg.fp16 and not cfg.bf16 and cfg.cast_lm_head_to_fp32


def test_fp16_weights_with_fp32_head_train_a_grpo_step(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        safe_vocab_rule="min_p=0.05",
        cast_lm_head_to_fp32=True,
        model_init_kwargs={"dtype": "float16"},
        max_steps=1,
        learning_rate=1e-2,
    )
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    # trl's cast_lm_head_to_fp32 keeps the head weight itself in fp32
    assert {n: p.dtype for n, p in params.items() if p.dtype != torch.float16} == {"lm_head.weight": torch.float32}
    trainer.train()
    h = trainer.state.log_history[0]
    assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), params[n])]
    assert changed and all(trainer.model.get_parameter(n).dtype == params[n].dtype for n in params)
    g = trainer.last_generation
    assert g["train_logps"].dtype == torch.float32 and torch.isfinite(g["train_logps"]).all()
    # the rollout ran with fp16 weights too, the training head in fp32: the gap is small but real
    assert h["mismatch/abs_logp_diff_max"] < 0.1


def _fp16_trainer(model_dir, tmp_path, init_scale: float, **config):
    """A trainer with ``fp16=True`` whose fp16 mixed precision really runs on this CPU.

    accelerate keeps fp16 AMP off on a CPU by a device check and nothing else. Switching its own machinery on
    (``native_amp``, so that preparing the model wraps its forward in fp16 autocast, and a ``GradScaler`` that the
    Trainer's backward, gradient clipping and optimizer step go through) runs the Trainer's GPU fp16 path here,
    unchanged: scaled backward through the safe head, unscale before clipping, inf check, skipped steps."""
    with pytest.warns(UserWarning, match="fp16=True on a machine without"):
        trainer = make_trainer(model_dir, tmp_path, fp16=True, **config)
    acc = trainer.accelerator
    assert acc.mixed_precision == "fp16" and not acc.native_amp and acc.scaler is None  # what accelerate does on CPU
    acc.native_amp = True
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return trainer


# fp32 master weights, fp16 autocast for the loss pass, fp32 LM head, fp32 rollouts (so both runs sample alike)
FP16_RUN = dict(safe_vocab_rule="min_p=0.05", cast_lm_head_to_fp32=True, rollout_dtype="float32", max_steps=2)


def test_fp16_mixed_precision_trains_through_the_trainers_loss_scaling(tiny_model_dir, tmp_path):
    trainer = _fp16_trainer(tiny_model_dir, tmp_path / "fp16", init_scale=2.0**10, **FP16_RUN)
    passes = []  # (grad enabled, dtype) of the first decoder MLP's output in every forward
    trainer.model.model.layers[0].mlp.register_forward_hook(
        lambda m, i, o: passes.append((torch.is_grad_enabled(), o.dtype))
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert (True, torch.float16) in passes  # the loss pass ran under fp16 autocast ...
    assert (True, torch.float32) not in passes
    assert trainer.last_generation["train_logps"].dtype == torch.float32  # ... with the fp32 safe head
    scaler = trainer.accelerator.scaler
    assert scaler._scale is not None and scaler.get_scale() == 2.0**10  # the scaler ran; no overflow
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights ...
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())  # ... updated

    reference = make_trainer(tiny_model_dir, tmp_path / "fp32", **FP16_RUN)
    reference.train()
    for h, r in zip(trainer.state.log_history[:2], reference.state.log_history[:2]):
        # unscaled fp16 gradients: the same norm as the fp32 run's, to fp16 accuracy
        assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-2) and h["grad_norm"] > 1.0


def test_fp16_overflow_skips_the_step_and_backs_off(tiny_model_dir, tmp_path):
    """A loss scale of 2^100 overflows the fp16 backward: the scaler must skip the update and halve the scale."""
    trainer = _fp16_trainer(tiny_model_dir, tmp_path, init_scale=2.0**100, **{**FP16_RUN, "max_steps": 1})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.accelerator.scaler.get_scale() == 2.0**99
    assert all(torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
    assert not math.isfinite(trainer.state.log_history[0]["grad_norm"])


def test_loss_scaling_through_the_safe_head_under_fp16_autocast(tiny):
    """What accelerate does on a GPU with fp16=True (autocast + GradScaler), on CPU: the scaled backward through
    the fused safe head, unscaled, gives the unscaled gradients, and the scaler's inf check sees them."""
    from trl_integration.grpo.head import add_safe_lm_head

    _, tok = tiny
    model = build_model(tok, seed=1)
    add_safe_lm_head(model, rule=NoPruning(), cast_lm_head_to_fp32=True)
    ids = tok(["hello there", "abc abc"], return_tensors="pt", padding=True)
    labels = ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100)

    def grads(scaler):
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(**ids, labels=labels, fused_lm_head=True)
        loss = out.loss
        assert out.log_probs.dtype == torch.float32
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
            found_inf = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
            assert found_inf == 0
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(None)
    scaled = grads(torch.amp.GradScaler("cpu", init_scale=2.0**10))
    assert plain.keys() == scaled.keys() and "lm_head.weight" in plain
    for name in plain:
        torch.testing.assert_close(scaled[name], plain[name], atol=2e-3, rtol=2e-2, msg=name)
