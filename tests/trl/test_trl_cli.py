"""``safevocab-grpo``: flags and YAML into the config, help, errors, and two steps end to end."""

from __future__ import annotations

import os

import pytest

from safevocab import MinP, TopK, TopP
from trl_integration.cli import main, make_parser, run

SMALL = [
    "--per_device_train_batch_size", "4",
    "--num_generations", "4",
    "--max_completion_length", "8",
    "--report_to", "none",
    "--save_strategy", "no",
    "--logging_steps", "1",
    "--use_cpu", "true",
    "--bf16", "false",
    "--no_gradient_checkpointing",
    "--disable_tqdm", "true",
]  # fmt: skip


def parse(argv):
    return make_parser().parse_args_and_config(args=argv)


def test_thresholds_parse_into_config(tmp_path):
    script, cfg, model = parse(
        [
            "--output_dir", str(tmp_path),
            "--model_name_or_path", "some/model",
            "--safe_vocab_rule", "top_p=0.95,top_k=40,min_p=0.02",
            "--safe_vocab_out_of_set", "mask_sequence",
            "--rollout_dtype", "bfloat16",
            "--mismatch_buckets", "0.001", "0.05", "0.5",
            "--vllm_importance_sampling_mode", "token_truncate",
            "--vllm_importance_sampling_clip_min", "0.5",
            "--vllm_importance_sampling_clip_max", "2.5",
            "--temperature", "0.8",
            "--no_log_mismatch_metrics",
            "--use_cpu", "true",
            "--bf16", "false",
        ]
    )  # fmt: skip
    assert cfg.rule == TopK(40) & TopP(0.95) & MinP(0.02)
    assert cfg.safe_vocab_rule == "top_k=40,top_p=0.95,min_p=0.02"
    assert (cfg.top_k, cfg.top_p, cfg.min_p, cfg.temperature) == (40, 0.95, 0.02, 0.8)
    assert cfg.safe_vocab_out_of_set == "mask_sequence"
    assert cfg.rollout_dtype == "bfloat16"
    assert cfg.mismatch_buckets == [0.001, 0.05, 0.5]
    assert cfg.vllm_importance_sampling_mode == "token_truncate"
    assert (cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max) == (0.5, 2.5)
    assert cfg.log_mismatch_metrics is False
    assert model.model_name_or_path == "some/model"
    assert script.dataset_name is None


def test_yaml_config_and_flag_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "safe_vocab_rule: min_p=0.1\n"
        "safe_vocab_in_sampler: false\n"
        "top_k: 7\n"
        "rollout_logprobs: true\n"
        f"output_dir: {tmp_path}\n"
        "use_cpu: true\n"
        "bf16: false\n"
    )
    with pytest.warns(UserWarning, match="offset"):
        _, cfg, _ = parse(["--config", str(path), "--safe_vocab_rule", "min_p=0.2"])
    assert cfg.rule == MinP(0.2)  # the flag wins over the YAML
    assert cfg.safe_vocab_in_sampler is False and cfg.top_k == 7  # the YAML applies


def test_bad_threshold_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="min_p"):
        parse(["--output_dir", str(tmp_path), "--safe_vocab_rule", "min_p=1.5", "--use_cpu", "true"])


def test_help_lists_safe_vocab_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--safe_vocab_rule",
        "--safe_vocab_out_of_set",
        "--safe_vocab_in_sampler",
        "--rollout_dtype",
        "--rollout_logprobs",
        "--log_mismatch_metrics",
        "--mismatch_buckets",
        "--vllm_importance_sampling_mode",
        "--dataset_name",
        "--reward_funcs",
        "--model_name_or_path",
    ):
        assert flag in text, flag


def test_config_without_model_says_what_to_pass(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(path), *SMALL])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--model_name_or_path is required" in err and "save_pretrained" in err


def test_no_arguments_selects_the_bundled_job():
    from trl_integration.assets import tiny_model_path
    from trl_integration.cli import BUNDLED_JOB_DEFAULTS, bundled_job_requested

    assert bundled_job_requested([]) and bundled_job_requested(["--max_steps", "3"])
    assert not bundled_job_requested(["--model_name_or_path", "x"]) and not bundled_job_requested(["--config=a.yaml"])
    parser = make_parser()
    parser.set_defaults(model_name_or_path=str(tiny_model_path()), **BUNDLED_JOB_DEFAULTS)
    script, cfg, model = parser.parse_args_and_config(args=["--max_steps", "3"])
    assert model.model_name_or_path == str(tiny_model_path())
    assert script.dataset_name == "arithmetic" and cfg.max_steps == 3  # a flag still overrides the job's default
    assert cfg.num_generations == BUNDLED_JOB_DEFAULTS["num_generations"]


def test_two_steps_end_to_end_synthetic(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    trainer = run(
        [
            "--model_name_or_path", tiny_model_dir,
            "--dataset_name", "synthetic",
            "--safe_vocab_rule", "min_p=0.05",
            "--max_steps", "2",
            "--output_dir", str(out),
            *SMALL,
        ]
    )  # fmt: skip
    assert trainer.state.global_step == 2
    assert trainer.args.rule == MinP(0.05) and trainer.args.min_p == 0.05
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    assert all("safevocab/pruned_mass_mean" in h and "mismatch/k3_kl" in h for h in steps)
    assert any(h["rewards/repeat_char_reward/mean"] is not None for h in steps)
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()


def test_two_steps_end_to_end_local_dataset(tiny_model_dir, tmp_path):
    from datasets import Dataset

    data_dir = tmp_path / "data"
    Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "ok?"] * 2}).save_to_disk(str(data_dir))
    reward_module = tmp_path / "my_rewards.py"
    reward_module.write_text("def length_reward(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)  # dotted reward paths resolve from the working directory, as in trl's script
    try:
        code = main(
            [
                "--model_name_or_path", tiny_model_dir,
                "--dataset_name", str(data_dir),
                "--reward_funcs", "my_rewards.length_reward",
                "--safe_vocab_rule", "top_k=5",
                "--max_steps", "2",
                "--output_dir", str(tmp_path / "run"),
                *SMALL,
            ]
        )  # fmt: skip
    finally:
        os.chdir(cwd)
    assert code == 0
    assert (tmp_path / "run" / "model.safetensors").exists()


def test_dataset_without_prompt_column_is_rejected(tiny_model_dir, tmp_path, capsys):
    from datasets import Dataset

    data_dir = tmp_path / "data"
    Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(data_dir))
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data_dir),
              "--reward_funcs", "repeat_char_reward", "--output_dir", str(tmp_path / "run"), *SMALL])  # fmt: skip
    assert exit_info.value.code == 2
    assert "'prompt' column" in capsys.readouterr().err
