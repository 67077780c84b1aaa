"""SafeVocabGRPOConfig: parsing, sampler synchronisation and the incoherent combinations that must raise."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from trl import GRPOConfig

from safevocab import MinP, MinProb, NoPruning, TopK, TopP, parse_rule
from trl_integration.grpo.config import SafeVocabGRPOConfig


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
    assert cfg.safe_vocab_effective_rule == "top_k=20"


# The sampler's truncation composes with the rule (issue 14): the effective rule is rule & sampler rule, each kind of
# threshold merged into the stricter one, and the sampler is set to it (flags and generation_kwargs alike).
COMPOSE_CASES = [
    # (rule, user sampler settings, effective rule, sampler flags after)
    (
        "min_p=0.001",
        dict(top_k=10, top_p=0.9, min_p=0.01),
        "top_k=10,top_p=0.9,min_p=0.01",
        dict(top_k=10, top_p=0.9, min_p=0.01),
    ),
    ("min_p=0.05", dict(top_k=5), "top_k=5,min_p=0.05", dict(top_k=5, min_p=0.05)),
    ("top_k=5", dict(top_k=6), "top_k=5", dict(top_k=5)),
    ("top_k=7", dict(top_k=3), "top_k=3", dict(top_k=3)),
    ("min_p=0.05", dict(min_p=0.1), "min_p=0.1", dict(min_p=0.1)),
    ("top_p=0.8", dict(top_p=0.95), "top_p=0.8", dict(top_p=0.8)),
    ("none", dict(top_p=0.9), "top_p=0.9", dict(top_p=0.9)),
    (
        "none",
        dict(top_k=10, top_p=0.9, min_p=0.01),
        "top_k=10,top_p=0.9,min_p=0.01",
        dict(top_k=10, top_p=0.9, min_p=0.01),
    ),
]


@pytest.mark.parametrize("rule, user, effective, flags", COMPOSE_CASES)
def test_sampler_flags_compose_with_rule(tmp_path, rule, user, effective, flags):
    cfg = make(tmp_path, safe_vocab_rule=rule, **user)
    assert cfg.safe_vocab_rule == str(parse_rule(rule))  # what the user asked for is kept
    assert cfg.safe_vocab_effective_rule == effective
    assert str(cfg.effective_rule) == effective
    assert cfg.sampler_rule == cfg.effective_rule  # the sampler draws from the effective set
    for key, value in flags.items():
        assert getattr(cfg, key) == value, key
    assert cfg.to_dict()["safe_vocab_effective_rule"] == effective  # logged in the run's config
    assert cfg.rollout_logprobs  # a pruning effective rule switches the extras on


def test_generation_kwargs_compose_with_rule(tmp_path):
    gk = {"top_k": 50, "min_p": 0.2, "num_beams": 2}
    cfg = make(tmp_path, safe_vocab_rule="min_p=0.05", generation_kwargs=dict(gk))
    assert cfg.safe_vocab_effective_rule == "top_k=50,min_p=0.2"
    assert cfg.generation_kwargs == {"top_k": 50, "min_p": 0.2, "num_beams": 2}  # beams are kept (run-time fallback)
    cfg = make(tmp_path, safe_vocab_rule="top_k=20", generation_kwargs={"top_k": 50})
    assert cfg.safe_vocab_effective_rule == "top_k=20"
    assert cfg.generation_kwargs["top_k"] == 20 and cfg.top_k == 20  # the override now applies the effective rule
    assert cfg.sampler_rule == TopK(20)


@pytest.mark.parametrize("empty", ["", "  "])
def test_empty_rule_is_refused_as_on_the_command_line(tmp_path, empty):
    """An empty rule (most often an unset shell variable) is refused in Python as on the command line, never read
    as "none" (which would switch the pruning off silently)."""
    with pytest.raises(ValueError, match=r"^safe_vocab_rule='' is not accepted: accepted a rule such as"):
        make(tmp_path, safe_vocab_rule=empty)


def test_rule_none_defaults_are_stock_trl(tmp_path):
    cfg = make(tmp_path, safe_vocab_rule="none")
    assert cfg.safe_vocab_effective_rule == "none"
    assert cfg.rollout_logprobs is False  # nothing recorded: trl's generate path unchanged
    assert not cfg.generate_path_importance_sampling
    assert (cfg.top_k, cfg.top_p, cfg.min_p) == (0, 1.0, None)  # trl's defaults
    assert cfg.vllm_importance_sampling_correction  # trl's own default, untouched (it acts on vLLM only)
    cfg = make(tmp_path, safe_vocab_rule="none", rollout_logprobs=True)
    assert cfg.generate_path_importance_sampling  # the user switches the extras on


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(loss_type="vespo"),  # trl checks VESPO's IS mode on vLLM only
        dict(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask", safe_vocab_rule="none"),
        dict(generation_kwargs={"typical_p": 0.9}),  # the recorder falls back at run time
        dict(generation_kwargs={"top_k": 50, "num_beams": 2, "do_sample": True}),
        dict(vllm_importance_sampling_correction=True, rollout_logprobs=False),
        dict(use_transformers_continuous_batching=True),
        dict(top_k=10, top_p=0.9, min_p=0.01, repetition_penalty=1.1),
        dict(safe_vocab_rule="none", top_k=10, top_p=0.9, min_p=0.01),
    ],
)
def test_configs_stock_trl_accepts_are_accepted(tmp_path, kwargs):
    GRPOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        report_to="none",
        **{k: v for k, v in kwargs.items() if k != "safe_vocab_rule" and k != "rollout_logprobs"},
    )
    make(tmp_path, **kwargs)


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
        (dict(safe_vocab_rule="min_p=0.05", safe_vocab_effective_rule="top_k=3"), "safe_vocab_effective_rule"),
        (dict(vllm_importance_sampling_mode="token_clip"), "vllm_importance_sampling_mode"),
        (dict(use_vllm=True, rollout_dtype="bfloat16"), "rollout_dtype"),
        (dict(use_transformers_continuous_batching=True, rollout_logprobs=True), "continuous_batching"),
        (dict(safe_vocab_out_of_set="drop"), "safe_vocab_out_of_set"),
        (dict(rollout_dtype="fp8"), "rollout_dtype"),
        (dict(mismatch_buckets=[0.5, 0.1]), "mismatch_buckets"),
        (dict(mismatch_buckets=[0.0, 0.1]), "mismatch_buckets"),
        (dict(safe_vocab_rule="min_p=0"), "min_p"),
        (dict(safe_vocab_rule="top_q=3"), "unknown"),
        (dict(safe_vocab_max_chunk_bytes=0), "safe_vocab_max_chunk_bytes"),
    ],
)
def test_incoherent_combinations_raise(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(tmp_path, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(safe_vocab_max_chunk_bytes=0), ValueError, "safe_vocab_max_chunk_bytes=0 is out of range: accepted an integer > 0"),
        (dict(safe_vocab_max_chunk_bytes=1.5), TypeError, "safe_vocab_max_chunk_bytes must be an integer, got float: 1.5"),
        (dict(safe_vocab_keep_logits_bytes=-1), ValueError, "safe_vocab_keep_logits_bytes=-1 is out of range: accepted an integer >= 0 (0: recompute)"),
        (dict(safe_vocab_keep_logits_bytes=2.0), TypeError, "safe_vocab_keep_logits_bytes must be an integer, got float: 2.0"),
        (dict(rollout_logit_noise=-0.1), ValueError, "rollout_logit_noise=-0.1 is out of range: accepted a finite float >= 0"),
        (dict(rollout_logit_noise=True), TypeError, "rollout_logit_noise must be a real number, got bool: True"),
        (dict(rollout_noise_seed="7"), TypeError, "rollout_noise_seed must be an integer, got str: '7'"),
        (dict(length_decay_min_lr_ratio=2.0), ValueError, "length_decay_min_lr_ratio=2.0 is out of range: accepted 0 <= ratio <= 1"),
        (dict(length_decay_start="later"), ValueError, "length_decay_start='later' is not accepted: accepted 'on_surge' or 'step0'"),
        (dict(safe_vocab_scoring="twice"), ValueError, "safe_vocab_scoring='twice' is not accepted: accepted one of ('auto', 'loss_forward', 'separate')"),
    ],
)  # fmt: skip
def test_field_errors_are_one_line_naming_the_field(tmp_path, kwargs, error, message):
    with pytest.raises(error) as err:
        make(tmp_path, **kwargs)
    assert str(err.value) == message


def test_numeric_fields_are_stored_as_python_numbers(tmp_path):
    import numpy as np

    cfg = make(
        tmp_path, safe_vocab_max_chunk_bytes=np.int64(4096), rollout_logit_noise=np.float32(0.5), zero_mismatch=False,
        safe_vocab_keep_logits_bytes=np.int64(2**20),
    )  # fmt: skip
    assert type(cfg.safe_vocab_max_chunk_bytes) is int and type(cfg.rollout_logit_noise) is float
    assert type(cfg.safe_vocab_keep_logits_bytes) is int and cfg.safe_vocab_keep_logits_bytes == 2**20
    assert cfg.rollout_logit_noise == 0.5


def test_enumerations_have_one_home():
    import trl_integration.grpo.config as config
    import trl_integration.options as enums
    import trl_integration.rollout.perturbations as perturbations
    from safevocab.correction import IS_MODES
    from safevocab.logprobs import DEFAULT_MAX_CHUNK_BYTES

    assert config.OUT_OF_SET_MODES is enums.OUT_OF_SET_MODES and config.SCORING_MODES is enums.SCORING_MODES
    assert perturbations.NOISE_KINDS is enums.NOISE_KINDS
    assert enums.IS_MODES is IS_MODES
    fields = SafeVocabGRPOConfig.__dataclass_fields__
    assert fields["safe_vocab_max_chunk_bytes"].default == DEFAULT_MAX_CHUNK_BYTES == 64 * 2**20
    assert fields["safe_vocab_rule"].default == config.DEFAULT_RULE == "min_p=0.001"
    assert fields["rollout_logit_noise_kind"].metadata["choices"] == list(enums.NOISE_KINDS)
    assert fields["length_decay_start"].metadata["choices"] == list(enums.LENGTH_DECAY_STARTS)


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


def test_docstring_documents_every_field_of_its_own():
    """Every field SafeVocabGRPOConfig adds to trl's GRPOConfig has its entry in the class docstring (trl's style:
    ``name (`type`, defaults to ...):``), under a ``> Parameters that control ...`` group."""
    import dataclasses

    from trl import GRPOConfig

    own = [f.name for f in dataclasses.fields(SafeVocabGRPOConfig)]
    own = [name for name in own if name not in {f.name for f in dataclasses.fields(GRPOConfig)}]
    doc = SafeVocabGRPOConfig.__doc__
    assert len(own) >= 28
    assert [name for name in own if f"\n        {name} (`" not in doc] == []
    assert doc.count("> Parameters that control") >= 6


@pytest.mark.parametrize(("use_vllm", "kept"), [(False, 3), (True, 2)])
def test_rules_compose_in_the_rollout_engines_order(tmp_path, use_vllm, kept):
    """vLLM applies min_p before top_k/top_p, transformers' generate after: top_p=0.75 & min_p=0.3 on
    p = [0.4, 0.3, 0.2, 0.1] keeps {0, 1, 2} in generate's order and {0, 1} in vLLM's, and the trainer's rule follows
    the engine that samples the rollouts."""
    import math

    cfg = make(tmp_path, use_vllm=use_vllm, safe_vocab_rule="top_p=0.75,min_p=0.3")
    assert cfg.effective_rule.engine == cfg.rule.engine == ("vllm" if use_vllm else "hf")
    logits = torch.tensor([[math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]])
    assert int(cfg.effective_rule.keep_mask(logits).sum()) == kept
    assert parse_rule(cfg.safe_vocab_effective_rule, engine=cfg.rule_engine) == cfg.effective_rule


def test_every_field_s_help_is_its_docstring_entry_written_once():
    # Issue 39 point 3: the config's fields are described once, in the docstring (rendered by the API reference); the
    # command line's --help text is read from it, and a field without an entry cannot be defined.
    import dataclasses

    from trl_integration.grpo.config import SafeVocabGRPOConfig
    from trl_integration.grpo.field_help import docstring_help, fill_field_help

    described = docstring_help(SafeVocabGRPOConfig.__doc__)
    own = SafeVocabGRPOConfig.__dict__["__annotations__"]
    fields = [f for f in dataclasses.fields(SafeVocabGRPOConfig) if f.name in own]
    assert len(fields) > 30
    for f in fields:
        assert f.metadata["help"] == described[f.name] and len(f.metadata["help"]) > 20, f.name
    assert ":func:" not in described["safe_vocab_in_sampler"] and "compose_rules" in described["safe_vocab_in_sampler"]
    source = (Path(__file__).resolve().parents[3] / "trl_integration" / "grpo" / "config.py").read_text()
    assert '"help"' not in source  # no second copy in the fields' metadata

    @dataclasses.dataclass
    class Undocumented:
        """A config.

        Parameters:
            documented (`int`, defaults to `1`):
                Described.
        """

        documented: int = 1
        forgotten: int = 2

    with pytest.raises(TypeError, match=r"fields \['forgotten'\] have no entry in the class docstring"):
        fill_field_help(Undocumented)


def test_unknown_loss_type_is_refused_when_the_config_is_built(tmp_path):
    """trl checks ``loss_type`` only inside the loss (after the model, the data and a generation batch); the config
    refuses a typo at once, in one line, with trl's own documented list, and accepts every value on it."""
    with pytest.raises(ValueError, match=r"^loss_type='grpoo': accepted one of grpo, dr_grpo, .*\(trl's GRPOConfig\)$"):
        SafeVocabGRPOConfig(output_dir=str(tmp_path), loss_type="grpoo", use_cpu=True)
    for name in (
        "grpo",
        "dr_grpo",
        "dapo",
        "bnpo",
        "cispo",
        "vespo",
        GRPOConfig.__dataclass_fields__["loss_type"].default,
    ):
        assert SafeVocabGRPOConfig(output_dir=str(tmp_path), loss_type=name, use_cpu=True).loss_type == name
