"""The Python quick start's guarantees: bf16 off by itself without a GPU, and the tokenizer requirements checked
at trainer construction with one line (issue 18, part B, point 4). The quick start itself runs in
``tests/test_docs_examples.py`` (it is a block of docs/trl.md)."""

from __future__ import annotations

import pytest
import torch
from trl_helpers import build_model, build_tokenizer, prompt_dataset

from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
from trl_integration.grpo.checks import bf16_supported
from trl_integration.grpo.trainer_checks import check_tokenizer

no_bf16_device = pytest.mark.skipif(bf16_supported(), reason="this machine has a bf16 device: trl's default stands")


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _args(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path), report_to="none", max_steps=1, per_device_train_batch_size=4,
                num_generations=4, max_completion_length=4, save_strategy="no")  # fmt: skip
    return SafeVocabGRPOConfig(**{**base, **overrides})


@no_bf16_device
def test_unset_bf16_is_off_without_a_bf16_device(tmp_path):
    assert _args(tmp_path).bf16 is False  # trl's unset bf16 (True) would raise "Your setup doesn't support bf16/gpu"


@no_bf16_device
def test_an_explicit_bf16_is_still_refused_by_transformers(tmp_path):
    with pytest.raises(ValueError, match="doesn't support bf16/gpu"):
        _args(tmp_path, bf16=True)


def test_use_cpu_and_fp16_keep_trl_precision_defaults(tmp_path):
    assert _args(tmp_path, use_cpu=True).bf16 is True  # bf16 autocast on CPU, as in trl
    with pytest.warns(UserWarning, match="fp16=True on a machine without"):
        assert _args(tmp_path, use_cpu=True, fp16=True).bf16 is False  # trl: unset bf16 = not fp16


def _no_eos_tokenizer(pad: bool):
    tokenizer = build_tokenizer()
    tokenizer.eos_token = None
    if not pad:
        tokenizer.pad_token = None
    return tokenizer


@pytest.mark.parametrize("pad", [False, True])
def test_a_tokenizer_without_eos_fails_in_one_line_before_the_model_loads(tmp_path, pad):
    tokenizer = _no_eos_tokenizer(pad)
    assert tokenizer.eos_token_id is None and (tokenizer.pad_token_id is not None) == pad
    # The model path does not exist: loading it would raise OSError, so the ValueError proves the check ran first.
    for call in (
        lambda: SafeVocabGRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=_reward, args=_args(tmp_path),
                                     train_dataset=prompt_dataset(), processing_class=tokenizer),
        lambda: SafeVocabGRPOTrainer(str(tmp_path / "no-such-model"), _reward, _args(tmp_path), prompt_dataset(), None,
                                     tokenizer),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=r"^tokenizer\.eos_token_id=None \(\w+\) is not accepted") as err:
            call()
        assert "\n" not in str(err.value) and "accepted" in str(err.value)


def test_a_tokenizer_loaded_by_trl_is_checked_too(tmp_path):
    tokenizer = _no_eos_tokenizer(pad=False)
    model = build_model(build_tokenizer())
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")  # trl loads this one (processing_class=None)
    with pytest.raises(ValueError, match=r"^tokenizer\.eos_token_id=None"):
        SafeVocabGRPOTrainer(model=str(tmp_path / "model"), reward_funcs=_reward, args=_args(tmp_path / "out"),
                             train_dataset=prompt_dataset())  # fmt: skip


def test_a_missing_pad_token_is_borrowed_from_eos_as_trl_does(tiny_model_dir, tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    trainer = SafeVocabGRPOTrainer(model=tiny_model_dir, reward_funcs=_reward, args=_args(tmp_path),
                                   train_dataset=prompt_dataset(), processing_class=tokenizer)  # fmt: skip
    assert trainer.processing_class.pad_token_id == tokenizer.eos_token_id
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_right_padded_text_tokenizer_is_accepted_trl_left_pads_prompts_itself():
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "right"
    check_tokenizer(tokenizer)


def test_a_right_padded_processor_is_refused(tmp_path):
    from transformers import AutoProcessor
    from vlm_helpers import build_vlm

    build_vlm(str(tmp_path))
    processor = AutoProcessor.from_pretrained(str(tmp_path), padding_side="right")
    assert processor.tokenizer.padding_side == "right"
    with pytest.raises(ValueError, match=r"^processing_class\.tokenizer\.padding_side='right' .*accepted 'left'"):
        check_tokenizer(processor)
    check_tokenizer(AutoProcessor.from_pretrained(str(tmp_path), padding_side="left"))
    assert torch.is_tensor(processor.tokenizer(["ab"], return_tensors="pt")["input_ids"])


def test_a_logging_integration_that_is_not_installed_fails_in_one_line_when_the_config_is_built(tmp_path):
    """Issue 31: ``report_to="tensorboard"`` without tensorboard ended in transformers' RuntimeError when the trainer
    was built; the config now refuses it with one line naming the field."""
    import importlib.util

    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    # tensorboard, as the user had it, unless installed here; then any integration whose package is missing
    missing = [name for name in ("tensorboard", "wandb", "comet_ml", "clearml", "mlflow")
               if name in INTEGRATION_TO_CALLBACK and importlib.util.find_spec(name) is None]  # fmt: skip
    assert missing, "every candidate integration is installed here: pick another"
    with pytest.raises(ValueError) as err:
        _args(tmp_path, report_to=missing[0])
    message = str(err.value)
    assert message.startswith(f"report_to={missing[0]!r}") and "not installed" in message and "\n" not in message
    with pytest.raises(ValueError, match="report_to='no-such-tracker'.*accepted 'none', 'all'"):
        _args(tmp_path, report_to=["no-such-tracker"])
