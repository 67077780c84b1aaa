"""Loud when rollouts and the safe set disagree (issue 43): completions from a ``rollout_func`` or a patched
``generate`` that fall outside the trainer's safe set warn in one line naming the share and the fixes, and a step
left with nothing to train stops the run (or warns); the trainer's own sampler stays silent.

Real trainers on the bundled tiny model (``trl_integration.demo``) with rule ``top_k=5``. The out-of-set completions
are those of an "engine" that samples without the rule: at every position it takes the policy's *least* likely token
(never in the top 5 of the bundled 19-token vocabulary), optionally after a few greedy (in-set) tokens.
"""

from __future__ import annotations

import json
import warnings
from unittest.mock import patch

import pytest
import torch

from trl_integration import SafeVocabGRPOTrainer
from trl_integration.demo import make_dataset, tiny_grpo_config, tiny_model_path
from trl_integration.grpo.out_of_set_alert import (
    REPEAT_EVERY_STEPS,
    NothingToTrainError,
    OutOfSetAlert,
    OutOfSetWarning,
)

RULE = "top_k=5"
#: What a message may be at most (issue 57: 730-850 characters before): one line of about 250.
MAX_MESSAGE = 275


def config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, learning_rate=1e-2, logging_steps=1, safe_vocab_rule=RULE, use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    settings.update(overrides)
    return tiny_grpo_config(**settings)


@torch.no_grad()
def least_likely_completion(model, prompt_ids: list[int], length: int, greedy_first: int = 0) -> list[int]:
    """``length`` tokens: ``greedy_first`` most likely ones (inside any top-k set), then the least likely ones."""
    ids = list(prompt_ids)
    out = []
    for i in range(length):
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
        token = int(logits.argmax() if i < greedy_first else logits.argmin())
        out.append(token)
        ids.append(token)
    return out


def off_rule_rollout_func(length: int = 4, greedy_first: int = 0):
    """A ``rollout_func`` whose engine ignores the rule (see the module docstring); no log-probabilities."""

    def rollout_func(prompts, trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        completions = [least_likely_completion(model, ids, length, greedy_first) for ids in prompt_ids]
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    return rollout_func


def spread_reward(completions, **kwargs):
    """A reward that differs within every group (the completions of a prompt are the same here): non-zero
    advantages, so a step with loss tokens moves the weights."""
    return [float(i % 4) for i in range(len(completions))]


def train(tmp_path, rollout_func=None, fake_generate=None, **overrides):
    """Train and return ``(trainer, initial parameters, the OutOfSetWarnings, the error or None)``."""
    trainer = SafeVocabGRPOTrainer(
        model=str(tiny_model_path()), reward_funcs=spread_reward, args=config(tmp_path, **overrides),
        train_dataset=make_dataset(32, seed=0, split="train"), rollout_func=rollout_func,
    )  # fmt: skip
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if fake_generate is None:
                trainer.train()
            else:
                with patch.object(trainer.model, "generate", side_effect=fake_generate(trainer)):
                    trainer.train()
        except NothingToTrainError as e:
            error = e
    alerts = [str(w.message) for w in caught if issubclass(w.category, OutOfSetWarning)]
    return trainer, before, alerts, error


def moved(trainer, before) -> bool:
    return any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())


def assert_names_the_fixes(message: str, *fixes: str) -> None:
    """One short line naming the rule, the fixes that can work here (and rule ``none``), the docs; no masking mode."""
    assert "\n" not in message and len(message) <= MAX_MESSAGE, (len(message), message)
    assert repr(RULE) in message and "safe_vocab_rule='none'" in message and "docs/trl.md#out-of-set-tokens" in message
    for fix in fixes:
        assert fix in message, fix
    assert "mask_sequence" not in message and "mask_token" not in message


# ----------------------------------------------------------------------------------------------------------------
# rollouts outside the set


def test_a_rollout_func_outside_the_set_warns_once_naming_the_share_and_the_fixes(tmp_path):
    """Half of every completion outside top-5: the run trains on the other half, and says so once (the repeat is
    at least REPEAT_EVERY_STEPS steps later)."""
    trainer, before, alerts, error = train(tmp_path, off_rule_rollout_func(length=4, greedy_first=2), max_steps=3)
    assert error is None and moved(trainer, before)
    assert len(alerts) == 1, alerts  # 3 steps over the threshold, one warning
    message = alerts[0]
    assert message == (
        "safevocab: step 1: 16 of 32 tokens (50%) fall outside the rule 'top_k=5' and leave the loss (from a "
        "rollout_func); fix: sample under the rule there, or safe_vocab_support='replay', or safe_vocab_rule='none'; "
        "see docs/trl.md#out-of-set-tokens"
    )
    assert_names_the_fixes(message)
    logged = [h["safevocab/out_of_set_frac"] for h in trainer.state.log_history if "safevocab/out_of_set_frac" in h]
    assert logged == [0.5, 0.5, 0.5]  # the warning's share is the logged metric's
    assert trainer.out_of_set_alert.out_of_set_share == pytest.approx(0.5)
    assert trainer.out_of_set_alert.steps_trained_nothing == 0


def test_a_step_with_every_token_outside_the_set_stops_the_run(tmp_path):
    """Every completion token outside top-5: nothing is left to train, the first step says so and stops."""
    trainer, before, alerts, error = train(tmp_path, off_rule_rollout_func(length=4))
    assert error is not None
    message = str(error)
    assert message.startswith(
        "safevocab: step 1 trains on nothing: all 32 tokens fall outside the rule 'top_k=5' (from a rollout_func); fix: "
    )
    assert "safe_vocab_empty_step='warn' trains on" in message
    assert_names_the_fixes(message, "safe_vocab_support='replay'")
    assert not moved(trainer, before)  # raised before the optimizer step
    assert len(alerts) == 1 and "32 of 32 tokens (100%)" in alerts[0]  # the share, then the error


def test_with_empty_step_warn_the_run_trains_on_and_warns(tmp_path):
    """``safe_vocab_empty_step="warn"``: each empty step is counted, and warned about at most every N steps (issue 57:
    it repeated every step); the share warning comes once.

    With trl's default ``beta=0`` and no weight decay, a step with no loss token leaves every parameter as it was:
    the silent failure of trl's tool tests under a pruning rule (issue 43)."""
    trainer, before, alerts, error = train(tmp_path, off_rule_rollout_func(length=4), safe_vocab_empty_step="warn")
    assert error is None
    empty = [a for a in alerts if "trains on nothing" in a]
    share = [a for a in alerts if "leave the loss" in a]
    assert len(empty) == 1 and len(share) == 1, alerts
    assert f"said every {REPEAT_EVERY_STEPS} steps" in empty[0]
    assert "32 of 32 tokens (100%)" in share[0]
    assert not moved(trainer, before)
    assert trainer.out_of_set_alert.steps_trained_nothing == 2


def test_a_patched_generate_outside_the_set_warns(tmp_path):
    """trl's tool tests replace ``generate`` by one returning fixed ids: the same warning, naming the source."""

    def fake_generate(trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)

        def generate(input_ids, **kwargs):
            rows = [least_likely_completion(model, row.tolist(), 4, greedy_first=1) for row in input_ids]
            return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=1)

        return generate

    trainer, before, alerts, error = train(tmp_path, fake_generate=fake_generate, max_steps=1)
    assert error is None and moved(trainer, before)
    assert len(alerts) == 1 and "24 of 32 tokens (75%)" in alerts[0]
    assert "(from a replaced generate); fix: train on the model's own samples" in alerts[0]
    assert_names_the_fixes(alerts[0])
    assert "sample under the rule" not in alerts[0]  # the trainer's sampler does: that fix cannot work here


def test_the_threshold_is_a_config_field(tmp_path):
    """Above the share, no warning; the share is still counted."""
    trainer, _, alerts, error = train(
        tmp_path, off_rule_rollout_func(length=4, greedy_first=2), max_steps=1, safe_vocab_out_of_set_warn_frac=0.5
    )
    assert error is None and alerts == []
    assert trainer.out_of_set_alert.out_of_set_share == pytest.approx(0.5)


# ----------------------------------------------------------------------------------------------------------------
# the normal path stays silent; the summary reports the totals


def test_the_trainers_own_sampler_is_silent_and_the_summary_reports_zero(tmp_path):
    from trl_integration.commands.summary import run_summary

    trainer, before, alerts, error = train(tmp_path, max_steps=3)
    assert error is None and alerts == [] and moved(trainer, before)
    summary = run_summary(trainer)
    assert summary["out_of_set_share"] == 0.0 and summary["steps_trained_nothing"] == 0
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["out_of_set_share"] == 0.0 and written["steps_trained_nothing"] == 0


def test_the_summary_reports_the_share_and_the_empty_steps(tmp_path, capsys):
    from trl_integration.commands.summary import print_run_summary

    trainer, _, _, _ = train(tmp_path, off_rule_rollout_func(length=4), safe_vocab_empty_step="warn")
    summary = print_run_summary(trainer)
    assert summary["out_of_set_share"] == 1.0 and summary["steps_trained_nothing"] == 2
    printed = capsys.readouterr().out
    assert "completion tokens outside the safe set (masked)" in printed and "100.00%" in printed
    assert "steps that trained nothing (every token masked)" in printed


# ----------------------------------------------------------------------------------------------------------------
# config


def test_config_fields_refuse_out_of_range_values(tmp_path):
    assert config(tmp_path).safe_vocab_out_of_set_warn_frac == 0.2
    assert config(tmp_path).safe_vocab_empty_step == "error"
    with pytest.raises(ValueError, match=r"^safe_vocab_out_of_set_warn_frac=1.5 is out of range: accepted a number"):
        config(tmp_path, safe_vocab_out_of_set_warn_frac=1.5)
    with pytest.raises(ValueError, match=r"^safe_vocab_empty_step='skip' is not accepted: accepted one of"):
        config(tmp_path, safe_vocab_empty_step="skip")


class _State:
    global_step = 0


def _fake_trainer(is_main_process: bool = True, other_rank: list[int] | None = None, **overrides):
    """A stand-in trainer for the alert alone; ``other_rank``: the counts another process adds to the gather."""

    class Accelerator:
        device = torch.device("cpu")

        @staticmethod
        def gather(t):
            return t if other_rank is None else torch.cat([t, torch.tensor([other_rank], dtype=t.dtype)])

    trainer = type("Trainer", (), {})()
    trainer.accelerator, trainer.rollout_func, trainer.model = Accelerator(), None, torch.nn.Linear(1, 1)
    trainer.accelerator.is_main_process = is_main_process
    trainer.args = config("unused", **overrides)
    return trainer


def test_the_warning_repeats_at_most_every_n_steps():
    """The throttle on its own: one step over the threshold after another."""
    trainer = _fake_trainer()
    alert = OutOfSetAlert(trainer)
    warned = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2 * REPEAT_EVERY_STEPS + 1):
            _State.global_step = step
            alert.observe_generation(_inputs(out_of_set=3, counted=4))
            alert.observe_loss({"completion_mask": torch.ones(1, 4)})
            n = len(caught)
            alert.on_pre_optimizer_step(trainer.args, _State, None)
            if len(caught) > n:
                warned.append(step + 1)
    assert warned == [1, 1 + REPEAT_EVERY_STEPS, 1 + 2 * REPEAT_EVERY_STEPS]
    assert alert.out_of_set_share == 0.75 and alert.steps_trained_nothing == 0


def test_several_processes_decide_on_the_sums_and_only_the_main_one_warns():
    """The counts are summed over processes before anything is decided: this process's 1 of 4 out of set with
    another's 4 of 4 is 5 of 8, over the threshold; another process whose loss tokens remain makes the step not
    empty; a process other than the main one warns nothing but raises the same error."""
    _State.global_step = 0
    for is_main in (True, False):
        trainer = _fake_trainer(is_main, other_rank=[4, 4, 4, 3])  # counted, out of set, completion, loss
        alert = OutOfSetAlert(trainer)
        alert.observe_generation(_inputs(out_of_set=1, counted=4))
        alert.observe_loss({"completion_mask": torch.ones(1, 4), "tool_mask": torch.zeros(1, 4)})  # nothing left here
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            alert.on_pre_optimizer_step(trainer.args, _State, None)
        assert [("5 of 8" in str(w.message)) for w in caught] == ([True] if is_main else [])
        assert alert.out_of_set_share == 5 / 8 and alert.steps_trained_nothing == 0

        trainer = _fake_trainer(is_main, other_rank=[0, 0, 4, 0])  # nothing left on the other process either
        alert = OutOfSetAlert(trainer)
        alert.observe_loss({"completion_mask": torch.ones(1, 4), "tool_mask": torch.zeros(1, 4)})
        with pytest.raises(NothingToTrainError, match="all 8 tokens fall outside"):
            alert.on_pre_optimizer_step(trainer.args, _State, None)


def test_the_empty_step_counts_the_tokens_the_loss_would_have_used():
    """Issue 57: the warning said "65 of 65" and the error "all 112" for the same step: the error counted the tool
    responses trl keeps out of the loss. Now both count ``completion_mask * tool_mask`` before the out-of-set masking."""
    from trl_integration.grpo.batch import HANDLE_KEY, BatchRow, BatchSettings, GenerationBatch

    batch = GenerationBatch(BatchSettings(), score=None, mode="train", gather=None, publish=None)
    batch._trl_tool_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])  # trl's: tool responses out of the loss
    micro = {
        HANDLE_KEY: [BatchRow(batch, 1), BatchRow(batch, 0)],
        "completion_mask": torch.ones(2, 4, dtype=torch.long),
        "tool_mask": torch.zeros(2, 4, dtype=torch.long),
    }  # fmt: skip  (every counted token masked by ours)
    inputs = batch.loss_inputs(None, micro)
    assert int(batch.loss_counted) == 5  # rows in trl's shuffled order: 3 + 2, not the 8 completion tokens
    trainer = _fake_trainer()
    alert = OutOfSetAlert(trainer)
    alert.observe_generation(_inputs(out_of_set=5, counted=5))
    alert.observe_loss(inputs, batch.loss_counted)
    with pytest.raises(NothingToTrainError, match="all 5 tokens fall outside"):
        alert.on_pre_optimizer_step(trainer.args, _State, None)


def test_evaluation_batches_are_not_counted():
    trainer = _fake_trainer()
    trainer.model.eval()
    alert = OutOfSetAlert(trainer)
    alert.observe_generation(_inputs(out_of_set=4, counted=4))
    alert.observe_loss({"completion_mask": torch.ones(1, 4), "tool_mask": torch.zeros(1, 4)})
    alert.on_pre_optimizer_step(trainer.args, _State, None)
    assert alert.out_of_set_share is None and alert.steps_trained_nothing == 0


def _inputs(out_of_set: int, counted: int):
    from types import SimpleNamespace

    in_safe = torch.tensor([[i >= out_of_set for i in range(counted)]])
    masks = SimpleNamespace(counted=torch.ones(1, counted, dtype=torch.bool))
    return SimpleNamespace(masks=masks, stats=SimpleNamespace(in_safe=in_safe))


# ----------------------------------------------------------------------------------------------------------------
# trl's tool test under a pruning rule (the case)


def test_trls_tool_test_under_top_k_5_warns_naming_the_tool_loop(tmp_path):
    """trl's ``test_train_with_tools`` (as tests/trl_integration/grpo/test_conformance.py builds it: a patched ``generate``
    returning fixed tool calls) under rule ``top_k=5``: almost every completion token is outside the set; the run
    says so, naming the real cause, the replaced ``generate`` (issue 57: it named the tool loop)."""
    from chat_helpers import build_chat_tokenizer
    from test_conformance import agent, chat_dataset, multiply_tool, tool_call
    from trl_helpers import build_model, grpo_kwargs

    from trl_integration import SafeVocabGRPOConfig

    tokenizer = build_chat_tokenizer()
    build_model(tokenizer, head_scale=1.0, max_position_embeddings=2048).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    name = multiply_tool.__name__
    first = [tool_call(name, '{"a": 3, "b": 4}'), tool_call(name, '{"a": 3, "c": 4}')]
    first.append("I don't know any tool<|im_end|>")
    kwargs = agent(str(tmp_path / "model"), first)
    fake_generate = kwargs.pop("fake_generate")
    args = SafeVocabGRPOConfig(**grpo_kwargs(
        tmp_path / "run", safe_vocab_rule=RULE, **{k: kwargs.pop(k) for k in list(kwargs) if k not in (
            "model", "processing_class", "reward_funcs")},
    ))  # fmt: skip
    trainer = SafeVocabGRPOTrainer(
        model=kwargs["model"], reward_funcs=kwargs["reward_funcs"], args=args, train_dataset=chat_dataset(),
        processing_class=kwargs["processing_class"], tools=[multiply_tool],
    )  # fmt: skip
    patched = patch.object(trainer.model, "generate", side_effect=fake_generate)
    with warnings.catch_warnings(record=True) as caught, patched:
        warnings.simplefilter("always")
        trainer.train()
    alerts = [str(w.message) for w in caught if issubclass(w.category, OutOfSetWarning)]
    assert len(alerts) == 1 and "(from a replaced generate)" in alerts[0], alerts
    assert_names_the_fixes(alerts[0])
    assert trainer.out_of_set_alert.out_of_set_share > 0.9
