"""The mismatch lab's newer sources on the ``generate`` path: the biased ``lift`` perturbation, rollouts with the
weights rounded to ``k`` mantissa bits (``rollout_mantissa_bits``) and plug-in perturbations
(``rollout_perturbation``), through real transformers ``generate`` and real GRPO steps."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import rollout_plugins
import torch
import trl_helpers
from trl_helpers import PROMPTS, build_model, build_tokenizer, grpo_kwargs

from safevocab import NoPruning
from safevocab.bounds import logprob_mismatch_bound
from trl_integration import SafeVocabGRPOConfig
from trl_integration.rollout.mismatch import rounded_weights
from trl_integration.rollout.perturbations import LogitNoiseProcessor, lift_perturbation
from trl_integration.rollout.recorder import RolloutLogprobRecorder, recording_generate

# ----------------------------------------------------------------------------------------------------
# lift


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lift_follows_its_formula_is_bounded_and_biased_to_the_tail(dtype):
    eps = 0.3  # float32(0.3) > 0.3: the bound must still hold exactly
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(64, 200, generator=g, dtype=torch.float64) * 6).to(dtype)
    z[:, :3] = -torch.inf  # masked tokens (e.g. by an earlier processor)
    delta = lift_perturbation(z, eps)
    zn = z.double().numpy()
    expected = eps * np.minimum(1.0, (zn.max(-1, keepdims=True) - zn) / 10.0)  # independent: numpy, float64
    np.testing.assert_allclose(delta.double().numpy(), expected, rtol=1e-6, atol=1e-7)
    assert delta.dtype == dtype and float(delta.min()) >= 0.0 and float(delta.max()) <= eps
    assert torch.all(delta.gather(-1, z.argmax(-1, keepdim=True)) == 0)  # the top token keeps its logit
    # the exact mismatch bound at eps holds for every token, and the tail gains probability
    train = z.double().log_softmax(-1)
    rollout = (z.double() + delta.double()).log_softmax(-1)
    finite = torch.isfinite(train)
    gap = (rollout - train)[finite]
    assert torch.all(gap.abs() <= logprob_mismatch_bound(train[finite].exp(), eps) + 1e-12)
    p = train[finite].exp()
    assert gap[p < 1e-3].min() > 0 and gap[p > 0.5].max() < 0
    assert torch.equal(lift_perturbation(z, 0.0), torch.zeros_like(z))


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return build_model(tok).eval(), tok


def test_generate_samples_from_and_records_the_lifted_distribution(tiny):
    model, tok = tiny
    enc = tok(PROMPTS[:4], return_tensors="pt", padding=True)
    eps, temperature = 0.5, 0.8
    recorder = RolloutLogprobRecorder(NoPruning(), temperature)
    torch.manual_seed(0)
    with recording_generate(model, recorder, None, [LogitNoiseProcessor(eps, "lift", temperature=temperature)]):
        out = model.generate(
            **enc, do_sample=True, temperature=temperature, top_k=0, max_new_tokens=6, pad_token_id=tok.pad_token_id
        )
    steps = recorder.logprobs.shape[1]
    new = out[:, -steps:]
    attn = torch.cat([enc["attention_mask"], torch.ones_like(new)], 1)
    with torch.no_grad():  # independent: full forward, transformed logits z / T plus the lift's formula
        logits = model(input_ids=out, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    z = logits[:, -steps - 1 : -1].double() / temperature
    lifted = z + eps * ((z.amax(-1, keepdim=True) - z) / 10).clamp(max=1.0)
    expected = lifted.log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(recorder.logprobs.double(), expected, atol=2e-5, rtol=1e-5)
    train = z.log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    gap = recorder.logprobs.double() - train
    assert torch.all(gap.abs() <= logprob_mismatch_bound(train.exp(), eps) + 1e-5)
    assert gap.abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------------
# mantissa bits


def test_rounded_weights_round_inside_and_restore_the_same_tensors(tiny):
    model = copy.deepcopy(tiny[0])
    before = {n: (p.data_ptr(), p.data.clone()) for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    with rounded_weights(model, 7):
        for n, p in model.named_parameters():  # independent reference: torch's bfloat16 conversion
            assert torch.equal(p.data, before[n][1].to(torch.bfloat16).float()), n
        assert any(not torch.equal(p.data, before[n][1]) for n, p in model.named_parameters())
        for n, b in model.named_buffers():
            assert torch.equal(b, buffers[n]), n  # buffers (RoPE frequencies) are not weights
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p.data, before[n][1]), n  # the same storage
    with pytest.raises(RuntimeError), rounded_weights(model, 3):
        raise RuntimeError("generation failed")
    assert all(torch.equal(p.data, before[n][1]) for n, p in model.named_parameters())  # restored on errors too


def make_trainer(model_dir, tmp_path, perturbation=None, **config):
    return trl_helpers.make_trainer(
        model_dir, tmp_path, trainer_kwargs={"rollout_perturbation": perturbation}, **config
    )


def loss_tokens(trainer):
    g = trainer.last_generation
    m = g["loss_mask"].bool()
    return g["train_logps"][m].double(), g["rollout_logps"][m].double()


def test_mantissa_rollout_is_a_rollout_of_the_rounded_model(tiny_model_dir, tmp_path):
    """A run with rollout_mantissa_bits=7 samples exactly what a run on the bfloat16-rounded model samples, while it
    trains (and scores) the unrounded weights, which a rollout leaves bit-identical."""
    rounded_dir = tmp_path / "rounded"
    model = build_model(build_tokenizer())
    model.load_state_dict(__import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(rounded_dir)
    build_tokenizer().save_pretrained(rounded_dir)

    common = dict(safe_vocab_rule="none", rollout_logprobs=True, max_steps=1, learning_rate=0.0)
    coupled = make_trainer(tiny_model_dir, tmp_path / "a", rollout_mantissa_bits=7, **common)
    weights = {n: p.detach().clone() for n, p in coupled.model.named_parameters()}
    coupled.train()
    for n, p in coupled.model.named_parameters():
        assert torch.equal(p.detach(), weights[n]), n  # bit-identical: no rounding left behind
    reference = make_trainer(str(rounded_dir), tmp_path / "b", **common)
    reference.train()

    train_a, rollout_a = loss_tokens(coupled)
    train_b, rollout_b = loss_tokens(reference)
    torch.testing.assert_close(rollout_a, rollout_b, atol=1e-6, rtol=0)  # the same samples, the same mu
    assert (train_a - rollout_a).abs().max() > 1e-3  # the coupled run's mismatch is the rounding ...
    assert (train_b - rollout_b).abs().max() < 1e-4  # ... which the rounded model alone does not have
    assert coupled.state.log_history[0]["mismatch/abs_logp_diff_max"] > 1e-3


# ----------------------------------------------------------------------------------------------------
# plug-in perturbations


def test_plugin_perturbation_acts_like_the_built_in_noise(tiny_model_dir, tmp_path):
    """The lift given as a plug-in (config string, factory, processor) samples and records exactly what the
    built-in rollout_logit_noise_kind='lift' does, with the factory called once with the run's noise seed."""
    common = dict(safe_vocab_rule="none", rollout_logprobs=True, max_steps=1, rollout_noise_seed=3)
    rollout_plugins.SEEDS_SEEN.clear()
    runs = {  # each trainer is built right before it trains: building one draws from the global RNG
        "built-in": lambda: make_trainer(
            tiny_model_dir, tmp_path / "0", rollout_logit_noise=0.5, rollout_logit_noise_kind="lift", **common
        ),
        "config": lambda: make_trainer(
            tiny_model_dir, tmp_path / "1", rollout_perturbation="rollout_plugins:lift_half", **common
        ),
        "factory": lambda: make_trainer(tiny_model_dir, tmp_path / "2", rollout_plugins.lift_half, **common),
        "processor": lambda: make_trainer(tiny_model_dir, tmp_path / "3", LogitNoiseProcessor(0.5, "lift"), **common),
    }
    results = {}
    for name, build in runs.items():
        trainer = build()
        trainer.train()
        results[name] = loss_tokens(trainer)
    assert rollout_plugins.SEEDS_SEEN == [3, 3]
    train, rollout = results["built-in"]
    assert (rollout - train).abs().max() > 1e-2
    for name in ("config", "factory", "processor"):
        assert torch.equal(results[name][0], train) and torch.equal(results[name][1], rollout), name


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(rollout_mantissa_bits=30), ValueError,
         r"^rollout_mantissa_bits=30 is not accepted: accepted an integer in \[1, 23\]$"),
        (dict(rollout_mantissa_bits=0), ValueError, r"rollout_mantissa_bits=0 is not accepted"),
        (dict(rollout_mantissa_bits="7"), TypeError, "rollout_mantissa_bits must be an integer"),
        (dict(rollout_mantissa_bits=7, use_vllm=True), ValueError, "not use_vllm=True"),
        (dict(rollout_mantissa_bits=7, rollout_dtype="bfloat16"), ValueError, "rounds the rollout twice"),
        (dict(rollout_mantissa_bits=7, zero_mismatch=True), ValueError, "contradictory"),
        (dict(rollout_perturbation="no_colon"), ValueError, "accepted 'module:function'"),
        (dict(rollout_perturbation="no_such_module_xyz:f"), ValueError, "cannot import module 'no_such_module_xyz'"),
        (dict(rollout_perturbation="rollout_plugins:missing"), ValueError, "has no attribute 'missing'"),
        (dict(rollout_perturbation="rollout_plugins:NOT_CALLABLE"), ValueError, "not a function"),
        (dict(rollout_perturbation="rollout_plugins:lift_half", zero_mismatch=True), ValueError, "contradictory"),
        (dict(rollout_perturbation="rollout_plugins:lift_half", use_vllm=True), ValueError, "use_vllm"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message) as err:
        SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, **kwargs))
    assert "\n" not in str(err.value)


def test_trainer_argument_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="given twice"):
        make_trainer(
            tiny_model_dir, tmp_path, rollout_plugins.lift_half, rollout_perturbation="rollout_plugins:lift_half"
        )
    with pytest.raises(ValueError, match="returned str"):
        make_trainer(tiny_model_dir, tmp_path, rollout_plugins.not_a_processor)


def test_safevocab_grpo_flags_parse(tmp_path):
    from trl_integration.commands.grpo import make_parser

    _, cfg, _, _ = make_parser().parse_args_and_config(
        args=["--output_dir", str(tmp_path), "--model_name_or_path", "m", "--use_cpu", "true",
              "--rollout_mantissa_bits", "3", "--rollout_perturbation", "rollout_plugins:lift_half",
              "--rollout_logit_noise", "0.1", "--rollout_logit_noise_kind", "lift"]
    )  # fmt: skip
    assert cfg.rollout_mantissa_bits == 3 and cfg.rollout_perturbation == "rollout_plugins:lift_half"
    assert cfg.rollout_logit_noise_kind == "lift" and cfg.rollout_logprobs is True
