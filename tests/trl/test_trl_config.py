"""SafeVocabGRPOConfig: parsing, sampler synchronisation and the incoherent combinations that must raise."""

from __future__ import annotations

import warnings

import pytest

from safevocab import MinP, MinProb, NoPruning, TopK, TopP, parse_rule
from trl_integration.config import SafeVocabGRPOConfig


def make(tmp_path, **kwargs):
    base = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none")
    base.update(kwargs)
    return SafeVocabGRPOConfig(**base)


def test_default_rule_and_sampler(tmp_path):
    cfg = make(tmp_path)
    assert cfg.safe_vocab_rule == "min_p=0.001"
    assert cfg.rule == MinP(0.001)
    # the sampler is set from the rule
    assert cfg.min_p == 0.001 and cfg.top_k == 0 and cfg.top_p == 1.0
    assert cfg.sampler_rule == cfg.rule
    assert cfg.generate_path_importance_sampling  # trl's correction default (True) now applies to generate


@pytest.mark.parametrize(
    "spec, expected, sampler",
    [
        ("min_p=0.05", MinP(0.05), dict(min_p=0.05, top_k=0, top_p=1.0)),
        ("top_k=7", TopK(7), dict(min_p=None, top_k=7, top_p=1.0)),
        ("top_p=0.9", TopP(0.9), dict(min_p=None, top_k=0, top_p=0.9)),
        ("min_p=0.01, top_k=50", TopK(50) & MinP(0.01), dict(min_p=0.01, top_k=50, top_p=1.0)),
        ("none", NoPruning(), dict(min_p=None, top_k=0, top_p=1.0)),
    ],
)
def test_rule_sets_sampler(tmp_path, spec, expected, sampler):
    cfg = make(tmp_path, safe_vocab_rule=spec)
    assert cfg.rule == expected
    assert cfg.safe_vocab_rule == str(expected)  # canonical form
    assert parse_rule(cfg.safe_vocab_rule) == expected
    for key, value in sampler.items():
        assert getattr(cfg, key) == value, key
    assert cfg.sampler_rule == expected


def test_matching_sampler_value_is_accepted(tmp_path):
    cfg = make(tmp_path, safe_vocab_rule="top_k=20", top_k=20)
    assert cfg.top_k == 20


def test_sampler_kept_when_not_in_sampler(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = make(tmp_path, safe_vocab_rule="min_p=0.1", safe_vocab_in_sampler=False, top_k=5)
    assert cfg.top_k == 5 and cfg.min_p is None
    assert cfg.sampler_rule == TopK(5)
    assert any("log(kept-mass) offset" in str(w.message) for w in caught)


def test_min_prob_needs_sampler_off(tmp_path):
    cfg = make(tmp_path, safe_vocab_rule="min_prob=0.01", safe_vocab_in_sampler=False)
    assert cfg.rule == MinProb(0.01)
    assert cfg.sampler_rule == NoPruning()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(safe_vocab_rule="min_prob=0.01"), "min_prob"),
        (dict(safe_vocab_rule="min_p=0.05", top_k=5), "top_k=5 disagrees"),
        (dict(safe_vocab_rule="top_k=5", top_k=6), "top_k=6 disagrees"),
        (dict(safe_vocab_rule="min_p=0.05", min_p=0.1), "min_p=0.1 disagrees"),
        (dict(safe_vocab_rule="none", top_p=0.9), "top_p=0.9 disagrees"),
        (dict(safe_vocab_rule="min_p=0.05", generation_kwargs={"min_p": 0.2}), "generation_kwargs"),
        (dict(generation_kwargs={"typical_p": 0.9}), "typical_p"),
        (dict(vllm_importance_sampling_correction=True, rollout_logprobs=False), "rollout_logprobs"),
        (dict(use_vllm=True, rollout_dtype="bfloat16"), "rollout_dtype"),
        (dict(use_transformers_continuous_batching=True), "continuous_batching"),
        (dict(safe_vocab_out_of_set="drop"), "safe_vocab_out_of_set"),
        (dict(rollout_dtype="fp8"), "rollout_dtype"),
        (dict(mismatch_buckets=[0.5, 0.1]), "mismatch_buckets"),
        (dict(mismatch_buckets=[0.0, 0.1]), "mismatch_buckets"),
        (dict(safe_vocab_rule="min_p=0"), "min_p"),
        (dict(safe_vocab_rule="top_q=3"), "unknown"),
        (dict(safe_vocab_max_chunk_bytes=0), "safe_vocab_max_chunk_bytes"),
        (dict(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask"), "vespo"),
    ],
)
def test_incoherent_combinations_raise(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(tmp_path, **kwargs)


def test_no_correction_without_rollout_logprobs_is_fine(tmp_path):
    cfg = make(tmp_path, vllm_importance_sampling_correction=False, rollout_logprobs=False)
    assert not cfg.generate_path_importance_sampling


def test_to_dict_round_trip(tmp_path):
    cfg = make(tmp_path, safe_vocab_rule="top_k=50,min_p=0.01", mismatch_buckets=[0.01, 0.2])
    d = cfg.to_dict()
    assert d["safe_vocab_rule"] == "top_k=50,min_p=0.01"
    assert d["mismatch_buckets"] == [0.01, 0.2]
    again = make(tmp_path, **{k: d[k] for k in ("safe_vocab_rule", "top_k", "min_p", "mismatch_buckets")})
    assert again.rule == cfg.rule
