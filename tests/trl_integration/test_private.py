"""The private-API fence (trl_integration/_private.py): the version/signature check at import, one contract test
per touchpoint against real trl, and that no other module names a private trl/transformers/accelerate name."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import trl
from trl import GRPOConfig, GRPOTrainer
from trl_helpers import PROMPTS, build_tokenizer, grpo_kwargs, prompt_dataset, user_env, vowel_reward

import trl_integration
import trl_integration._private as fence
from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration._private import (
    REQUIRED_PARAMETERS,
    SUPPORTED_TRL,
    GRPOTrainerBridge,
    check_trl,
    disable_gradient_checkpointing,
    mark_scheduler_created,
    maybe_gather_lm_head_ctx,
    metric_store,
)

PACKAGE = pathlib.Path(trl_integration.__file__).parent


def stock_trainer(model_dir, tmp_path, **config):
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=vowel_reward,
        args=GRPOConfig(**grpo_kwargs(tmp_path, **config)),
        train_dataset=prompt_dataset(),
        processing_class=build_tokenizer(),
    )


# ----------------------------------------------------------------------------------------------------------------
# the check


def test_installed_trl_is_in_the_tested_range():
    assert SUPPORTED_TRL == "trl>=1.16,<1.17"
    check_trl(trl.__version__)  # what the import ran; must not raise
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert f'"{SUPPORTED_TRL}"' in pyproject  # the packaging range is the checked one


@pytest.mark.parametrize("version", ["1.17.0", "1.15.3", "2.0.0", "1.17.0.dev0", "not-a-version"])
def test_version_outside_the_range_fails_in_one_line(version):
    with pytest.raises(ImportError) as info:
        check_trl(version)
    message = str(info.value)
    assert "\n" not in message
    assert SUPPORTED_TRL in message and version in message


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.1rc1", "1.16.0.post1"])
def test_versions_inside_the_range_pass(version):
    check_trl(version)


@pytest.mark.parametrize("name", list(REQUIRED_PARAMETERS))
def test_changed_signature_fails_in_one_line(name):
    def changed(self, something_else):  # a trl refactor renamed the parameters
        return None

    fake = type("FakeGRPOTrainer", (GRPOTrainer,), {name: changed})
    with pytest.raises(ImportError, match=re.escape(SUPPORTED_TRL)) as info:
        check_trl("1.16.0", fake)
    assert name in str(info.value) and "\n" not in str(info.value)


def test_missing_method_and_helper_fail_in_one_line():
    fake = type("FakeGRPOTrainer", (GRPOTrainer,), {"_generate_single_turn": None})
    with pytest.raises(ImportError, match="_generate_single_turn is missing"):
        check_trl("1.16.0", fake)
    with pytest.raises(ImportError, match="maybe_gather_lm_head_ctx is missing"):
        check_trl("1.16.0", GRPOTrainer, modules={"trl.models.utils": fence, "trl.trainer.utils": object()})


# The config's import (slow tier, issue 53) runs the same fence as the trainer's, which the fast suite keeps.
@pytest.mark.parametrize("module", ["trl_integration.grpo.trainer", "trl_integration.grpo.config"])
def test_unsupported_trl_fails_at_import(module):
    """A trl outside the tested range fails when the integration is imported, with one line, not during a step; from
    the trainer's and from the config's import (``trl_integration/trl_version.py``, the same range), before trl's
    trainer stack (and vLLM with it) loads: in about the time of ``import torch``."""
    code = (
        "import atexit, sys, trl\n"
        "atexit.register(lambda: print('loaded:', *sorted({'trl.trainer.grpo_trainer', 'transformers.training_args', 'vllm'} & set(sys.modules))))\n"
        f"trl.__version__ = '1.17.0'; import {module}\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, env=user_env()
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: trl 1.17.0 is not supported") and SUPPORTED_TRL in last
    assert result.stdout.strip() == "loaded:", result.stdout


# ----------------------------------------------------------------------------------------------------------------
# contract tests: what the trainer relies on in each touchpoint, checked on stock trl


def test_scoring_calls_the_fused_head_protocol(tiny_model_dir, tmp_path):
    """``_get_per_token_logps_and_entropies`` calls ``model(..., labels=..., fused_lm_head=True)`` and returns the
    last ``logits_to_keep`` columns of ``outputs.log_probs`` / ``outputs.entropy`` (what lm_head.py patches)."""
    trainer = stock_trainer(tiny_model_dir, tmp_path)
    model = trainer.model
    calls, original = [], model.forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((kwargs, out))
        return out

    model.forward = spy
    ids = torch.randint(4, 40, (2, 7))
    with torch.no_grad():
        logps, entropies, aux = trainer._get_per_token_logps_and_entropies(
            model, ids, torch.ones_like(ids), 3, compute_entropy=True
        )
    del model.forward
    ((kwargs, out),) = calls
    assert kwargs["fused_lm_head"] is True and kwargs["labels"].shape == ids.shape
    assert torch.equal(logps, out.log_probs[:, -3:]) and torch.equal(entropies, out.entropy[:, -3:])
    assert aux is None


def test_generate_turn_calls_the_unwrapped_models_generate(tiny_model_dir, tmp_path):
    """The plain path calls ``generate`` on the unwrapped model (where rollout.recording_generate patches it), with
    trl's generation config and no log-probabilities back."""
    trainer = stock_trainer(tiny_model_dir, tmp_path)
    target = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    seen, original = [], target.generate

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    target.generate = spy
    tokenizer = build_tokenizer()
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    completion_ids, logprobs = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    del target.generate
    assert len(seen) == 1 and seen[0]["generation_config"] is trainer.generation_config
    assert len(completion_ids) == 2 and all(isinstance(i, int) for i in completion_ids[0])
    assert logprobs is None


@pytest.mark.parametrize("num_iterations, old_pass", [(1, False), (2, True)])
def test_generation_batch_carries_old_logps_iff_trl_scored_the_old_policy(
    tiny_model_dir, tmp_path, num_iterations, old_pass
):
    """``_generate_and_score_completions`` returns trl's padded batch; ``old_per_token_logps`` is there exactly when
    trl ran its old-policy pass, and holds that pass's values (the trainer matches it by value)."""
    trainer = stock_trainer(tiny_model_dir, tmp_path, num_iterations=num_iterations)
    passes, original = [], trainer._get_per_token_logps_and_entropies

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        passes.append(out[0])
        return out

    trainer._get_per_token_logps_and_entropies = spy
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:1] for _ in range(4)])
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"):
        assert key in batch, key
    assert ("old_per_token_logps" in batch) is old_pass
    if old_pass:
        assert torch.equal(passes[0], batch["old_per_token_logps"])
    assert "sampling_per_token_logps" not in batch  # the plain path records nothing: the trainer adds it


def test_compute_loss_takes_model_and_batch(tiny_model_dir, tmp_path):
    trainer = stock_trainer(tiny_model_dir, tmp_path)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:1] for _ in range(4)])
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(trainer.model, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_metric_store_is_trls(tiny_model_dir, tmp_path):
    trainer = stock_trainer(tiny_model_dir, tmp_path)
    store = metric_store(trainer)
    assert set(store) == {"train", "eval"}
    store["train"]["safevocab/probe"].append(1.0)  # a defaultdict(list) per mode
    trainer.model.train()
    trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:1] for _ in range(4)])
    assert store["train"]["reward"]  # trl logs into the same store


def test_helper_context_managers(tiny_model_dir, tmp_path):
    trainer = stock_trainer(tiny_model_dir, tmp_path)
    with disable_gradient_checkpointing(trainer.model, None):
        pass
    head = trainer.model.get_output_embeddings()
    with maybe_gather_lm_head_ctx(head.weight, head.bias):  # a no-op without DeepSpeed ZeRO-3
        assert head.weight.numel() > 0


def test_bridge_routes_trls_private_calls_to_the_hooks(tiny_model_dir, tmp_path):
    """trl's code calls the private names; a SafeVocabGRPOTrainer receives them in its public hooks."""
    calls = []

    class Spy(SafeVocabGRPOTrainer):
        def score_completion_tokens(self, *args, **kwargs):
            calls.append("score")
            return super().score_completion_tokens(*args, **kwargs)

        def generate_turn(self, *args, **kwargs):
            calls.append("generate")
            return super().generate_turn(*args, **kwargs)

        def generate_and_score(self, inputs):
            calls.append("batch")
            return super().generate_and_score(inputs)

        def grpo_loss(self, model, inputs):
            calls.append("loss")
            return super().grpo_loss(model, inputs)

    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, max_steps=1))
    trainer = Spy(
        model=tiny_model_dir,
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=build_tokenizer(),
    )
    assert isinstance(trainer, GRPOTrainerBridge)
    trainer.train()
    assert {"score", "generate", "batch", "loss"} <= set(calls)


def test_transformers_rebuilds_a_scheduler_marked_as_created(tiny_model_dir, tmp_path):
    """``Trainer._prepare_for_training`` drops ``lr_scheduler`` when ``_created_lr_scheduler`` is set, so that a second
    ``train()`` builds a fresh one; the length-decay scheduler is marked the same way."""
    import inspect

    from transformers import Trainer

    from safevocab.schedulers import LengthDecayLR

    assert "_created_lr_scheduler" in inspect.getsource(Trainer.create_scheduler)
    assert "if self._created_lr_scheduler:" in inspect.getsource(Trainer._prepare_for_training)
    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, length_decay=True, length_decay_period="3"))
    trainer = SafeVocabGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=build_tokenizer(),
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    assert isinstance(trainer.lr_scheduler, LengthDecayLR) and trainer._created_lr_scheduler is True
    trainer._created_lr_scheduler = False
    mark_scheduler_created(trainer)
    assert trainer._created_lr_scheduler is True


def test_save_checkpoint_writes_into_the_output_dir_it_reads(tiny_model_dir, tmp_path):
    """transformers' ``_save_checkpoint`` (through trl's override) writes ``checkpoint-<global_step>`` into
    ``_get_output_dir(trial)`` and rotates old checkpoints there, nowhere else: what the staged save relies on
    (trl_integration.harness.checkpoints); and the checkpoint bridge routes the call to the ``save_checkpoint`` hook."""

    from trl_integration._private import CheckpointBridge

    trainer = stock_trainer(tiny_model_dir, tmp_path / "run", max_steps=1, save_total_limit=1)
    trainer.train()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "checkpoint-0").mkdir(parents=True)  # an older checkpoint there: rotated out
    trainer._get_output_dir = lambda trial: str(elsewhere)
    trainer._save_checkpoint(trainer.model, None)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["checkpoint-1"]
    written = set(os.listdir(elsewhere / "checkpoint-1"))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= written
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint")]

    calls = []

    class Spy(CheckpointBridge, SafeVocabGRPOTrainer):  # the harness's checkpoints mix the bridge in
        def save_checkpoint(self, model, trial):
            calls.append(self.checkpoint_run_dir(trial))
            self.stock_save_checkpoint(model, trial, parent=str(tmp_path / "staged"))

    args = SafeVocabGRPOConfig(**grpo_kwargs(tmp_path / "ours", max_steps=1, save_strategy="steps", save_steps=1))
    Spy(model=tiny_model_dir, reward_funcs=vowel_reward, args=args, train_dataset=prompt_dataset(),
        processing_class=build_tokenizer()).train()  # fmt: skip
    assert calls == [str(tmp_path / "ours")]
    assert (tmp_path / "staged" / "checkpoint-1" / "trainer_state.json").is_file()


# ----------------------------------------------------------------------------------------------------------------
# the fence itself

PRIVATE_NAMES = [
    r"\._get_per_token_logps_and_entropies\b",
    r"\._generate_single_turn\b",
    r"\._generate_and_score_completions\b",
    r"\._compute_loss\b",
    r"\._metrics\b",
    r"_original_forward\b",
    r"_created_lr_scheduler\b",
    r"from trl\.trainer\.utils import",
    r"from trl\.models\.utils import",
    r"def _get_per_token_logps_and_entropies\b",
    r"def _generate_single_turn\b",
    r"def _generate_and_score_completions\b",
    r"def _compute_loss\b",
    r"\._save_checkpoint\b",
    r"\._get_output_dir\b",
    r"def _save_checkpoint\b",
    r"def _get_output_dir\b",
    r"_iter_named_params\b",
    r"\.model_runner\b",
    r"\.driver_worker\b",
    r"\.reload_weights\b",
    r"\.engine_core\b",
    r"\.get_model\(",
    r"trl\.generation\.vllm_generation",
]


def test_no_other_module_names_a_private_name():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_private.py" and path.parent == PACKAGE:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(re.search(p, code) for p in PRIVATE_NAMES) and "``" not in code:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
