"""The drop-in differs from trl's GRPOTrainer only where DVP needs it; the run harness is opt-in (``harness/``)."""

from __future__ import annotations

import torch
from trl import GRPOConfig, GRPOTrainer
from trl_helpers import build_model, build_tokenizer, grpo_kwargs, prompt_dataset, vowel_reward

from safevocab.threads import set_intra_op_threads
from trl_integration import HardenedSafeVocabGRPOTrainer, SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration.grpo.out_of_set_alert import OutOfSetAlert
from trl_integration.harness import threads


def build(trainer_cls, config_cls, tmp_path, **config):
    tokenizer = build_tokenizer()
    args = config_cls(**grpo_kwargs(tmp_path, disable_tqdm=False, **config))
    return trainer_cls(model=build_model(tokenizer), reward_funcs=vowel_reward, args=args,
                       train_dataset=prompt_dataset(), processing_class=tokenizer)  # fmt: skip


def test_the_drop_in_keeps_trls_train_checkpoint_save_callbacks_rewards_and_threads(tmp_path, monkeypatch):
    # A machine where the harness's thread policy would act: torch at its start-up default, no OMP_NUM_THREADS.
    for name in threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_torch_default_threads", lambda: 3)
    before = torch.get_num_threads()
    try:
        # torch's own setter: a vLLM engine built earlier in this worker leaves torch.set_num_threads a no-op
        set_intra_op_threads(3)
        stock = build(GRPOTrainer, GRPOConfig, tmp_path / "stock")
        plain = build(SafeVocabGRPOTrainer, SafeVocabGRPOConfig, tmp_path / "plain")
        assert torch.get_num_threads() == 3  # the drop-in left torch's count alone
        hardened = build(HardenedSafeVocabGRPOTrainer, SafeVocabGRPOConfig, tmp_path / "hardened")
        assert torch.get_num_threads() == 1  # the harness chose one thread for a model this small
    finally:
        set_intra_op_threads(before)
    assert SafeVocabGRPOTrainer.train is GRPOTrainer.train
    assert SafeVocabGRPOTrainer._save_checkpoint is GRPOTrainer._save_checkpoint
    trls = [type(c) for c in stock.callback_handler.callbacks]
    # trl's callbacks as trl built them; the drop-in adds its own out-of-set alert (a DVP need: docs/trl.md)
    assert [type(c) for c in plain.callback_handler.callbacks if not isinstance(c, OutOfSetAlert)] == trls
    assert plain.reward_funcs == [vowel_reward]

    assert HardenedSafeVocabGRPOTrainer.train is not GRPOTrainer.train
    assert HardenedSafeVocabGRPOTrainer._save_checkpoint is not GRPOTrainer._save_checkpoint
    assert [type(c) for c in hardened.callback_handler.callbacks if not isinstance(c, OutOfSetAlert)] != trls
    assert hardened.reward_funcs != [vowel_reward]  # wrapped in the reward checks


def test_the_harness_trains_like_the_drop_in(tmp_path):
    """The harness changes how a run is kept, not what it trains: the same weights after two steps."""
    plain = build(SafeVocabGRPOTrainer, SafeVocabGRPOConfig, tmp_path / "plain", seed=3)
    plain.train()
    hardened = build(HardenedSafeVocabGRPOTrainer, SafeVocabGRPOConfig, tmp_path / "hardened", seed=3)
    hardened.train()
    for (name, a), (_, b) in zip(plain.model.named_parameters(), hardened.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
