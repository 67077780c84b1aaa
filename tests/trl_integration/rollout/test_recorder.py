"""The rollout log-prob recorder and rollout precision on the transformers ``generate`` path."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from trl_helpers import build_model, build_tokenizer

from safevocab import MinP, NoPruning, TopK, TopP
from safevocab.effective_rule import sampler_rule
from trl_integration.rollout.recorder import (
    RolloutLogprobRecorder,
    recording_generate,
    rollout_precision,
    rollout_recorder,
    sampler_rule_from_generation_config,
)


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return build_model(tok, head_scale=10.0).eval(), tok


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05),
    ],
)
@pytest.mark.parametrize("max_buffer_bytes", [1, 64 * 2**20], ids=["score_each_step", "score_once"])
def test_recorder_matches_processed_scores(tiny, sampling, max_buffer_bytes):
    """The recorder's log-probs equal the log-softmax of the scores HF actually sampled from (output_scores),
    whether it scores every step as it comes or buffers the whole rollout into one call."""
    model, tok = tiny
    gc = GenerationConfig(
        do_sample=True, max_new_tokens=6, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **sampling
    )
    rule, temperature = sampler_rule_from_generation_config(gc)
    recorder = RolloutLogprobRecorder(rule, temperature, max_buffer_bytes=max_buffer_bytes)
    inputs = tok(["hello", "the cat", "1+1="], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with recording_generate(model, recorder, None):
        out = model.generate(**inputs, generation_config=gc, return_dict_in_generate=True, output_scores=True)
    assert "generate" not in vars(model)  # the patch is removed
    new_tokens = out.sequences[:, inputs["input_ids"].shape[1] :]
    processed = torch.stack(out.scores, dim=1).log_softmax(-1)  # [B, T, V], -inf outside the sampler's set
    expected = processed.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    assert recorder.logprobs.shape == expected.shape
    assert torch.isfinite(recorder.logprobs).all()
    torch.testing.assert_close(recorder.logprobs, expected, atol=1e-5, rtol=1e-5)
    lists = recorder.per_sequence([row[:3].tolist() for row in new_tokens])
    assert [len(x) for x in lists] == [3, 3, 3]


def test_recorder_detects_detached():
    recorder = RolloutLogprobRecorder(NoPruning())
    with pytest.raises(RuntimeError, match="never called"):
        recorder.finalize(torch.zeros(2, 3, dtype=torch.long))


def test_recording_generate_degrades_when_generate_runs_no_processor(tiny):
    """A replaced generate (trl's tests patch it) never calls the recorder: the rollout is returned and the recorder
    says why it has nothing, instead of raising out of generate."""
    model, tok = tiny
    recorder = RolloutLogprobRecorder(NoPruning())
    inputs = tok(["hello", "the cat"], return_tensors="pt", padding=True)

    def fake_generate(input_ids, **kwargs):
        assert recorder in kwargs["logits_processor"]  # attached, but this generate never runs processors
        return torch.cat([input_ids, torch.full((input_ids.shape[0], 3), 7)], dim=1)

    model.generate = fake_generate
    try:
        with recording_generate(model, recorder, None):
            out = model.generate(**inputs)
    finally:
        del model.generate
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    assert recorder.failure is not None and "never called" in recorder.failure
    assert recorder.logprobs is None


def test_sampler_rule_neutral_values():
    assert sampler_rule(0, 1.0, None) == NoPruning()
    assert sampler_rule(-1, None, 0.0) == NoPruning()
    assert sampler_rule(5, 0.9, 0.1) == TopK(5) & TopP(0.9) & MinP(0.1)
    with pytest.raises(ValueError, match="typical_p"):
        sampler_rule_from_generation_config(GenerationConfig(do_sample=True, typical_p=0.5))
    with pytest.raises(ValueError, match="do_sample"):
        sampler_rule_from_generation_config(GenerationConfig(do_sample=False))


def test_rollout_recorder_or_the_reason_there_is_none():
    recorder, reason = rollout_recorder(GenerationConfig(do_sample=True, top_k=5, temperature=0.7), True)
    assert reason is None and recorder.rule == TopK(5) and recorder.temperature == pytest.approx(0.7)
    recorder, reason = rollout_recorder(GenerationConfig(do_sample=True, num_beams=2), False)
    assert recorder is None and "num_beams" in reason
    penalised = GenerationConfig(do_sample=True, repetition_penalty=1.2)
    recorder, reason = rollout_recorder(penalised, True)  # the ratio would miss the context-dependent penalty
    assert recorder is None and "repetition_penalty=1.2" in reason
    recorder, reason = rollout_recorder(penalised, False)  # recorded for the mismatch metrics all the same
    assert isinstance(recorder, RolloutLogprobRecorder) and reason is None


def test_rollout_precision_keeps_master_weights(tiny):
    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tok(["hello world"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model(ids).logits
        with rollout_precision(model, torch.bfloat16):
            low = model(ids).logits
        with rollout_precision(model, torch.float32):
            same = model(ids).logits
    assert low.dtype == torch.bfloat16
    assert 0 < (low.float() - ref).abs().max() < 1.0  # bf16 rounding, not garbage
    torch.testing.assert_close(same, ref)
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k


def test_rollout_precision_upcast_is_lossless():
    tok = build_tokenizer()
    model = build_model(tok).to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tok(["abc"], return_tensors="pt")["input_ids"]
    with torch.no_grad(), rollout_precision(model, torch.float32):
        assert all(p.dtype == torch.float32 for p in model.parameters())
        out = model(ids).logits
    assert out.dtype == torch.float32
    for k, v in model.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, before[k]), k
