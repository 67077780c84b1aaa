"""``safevocab`` and ``safevocab-grpo``: the dispatcher and its subcommands, the old import paths, flags and YAML
into the config, help, errors, and two steps end to end."""

from __future__ import annotations

import os

import pytest

from safevocab import MinP, TopK, TopP
from trl_integration.commands.grpo import main, make_parser, run

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
    """(script, config, model) of the command's parser (its fourth dataclass, trl's DatasetMixtureConfig, dropped)."""
    return make_parser().parse_args_and_config(args=argv)[:3]


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
    from trl_integration.commands.grpo import BUNDLED_JOB_DEFAULTS, bundled_job_requested
    from trl_integration.demo.model import tiny_model_path

    assert bundled_job_requested([]) and bundled_job_requested(["--max_steps", "3"])
    assert not bundled_job_requested(["--model_name_or_path", "x"]) and not bundled_job_requested(["--config=a.yaml"])
    parser = make_parser()
    parser.set_defaults(model_name_or_path=str(tiny_model_path()), **BUNDLED_JOB_DEFAULTS)
    script, cfg, model, _ = parser.parse_args_and_config(args=["--max_steps", "3"])
    assert model.model_name_or_path == str(tiny_model_path())
    assert script.dataset_name == "arithmetic" and cfg.max_steps == 3  # a flag still overrides the job's default
    assert cfg.num_generations == BUNDLED_JOB_DEFAULTS["num_generations"]


def test_the_main_job_prints_eight_log_lines_at_any_length(tmp_path):
    """The main job's stdout stays under 10 KB (issue 38; 9,421 bytes measured, 18,240 with trl's logging_steps=10):
    each logged step prints one line of trl's 24 keys (about 740 bytes), the summary about 2.8 KB. So it logs an
    eighth of its steps (transformers' share form of ``logging_steps``): 8 lines at 200 steps, as at 8 or 2000; and
    ``run`` uses these defaults (8 steps log 8 times; with trl's 10 they would log none)."""
    from types import SimpleNamespace

    from transformers import TrainerState

    from trl_integration.commands.grpo import BUNDLED_JOB_DEFAULTS

    for max_steps in (8, 200, 2000):
        state = TrainerState()
        state.compute_steps(SimpleNamespace(logging_steps=BUNDLED_JOB_DEFAULTS["logging_steps"], eval_steps=None,
                                            save_steps=None), max_steps)  # fmt: skip
        assert max_steps // state.logging_steps == 8, (max_steps, state.logging_steps)
    trainer = run(["--max_steps", "8", "--eval_num_prompts", "0", "--disable_tqdm", "true", "--output_dir",
                   str(tmp_path / "run")])  # fmt: skip
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == list(range(1, 9))


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
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after datasets' progress bars: one line
    assert last.startswith("safevocab-grpo: error: ") and "'prompt' column" in last


# --- the `safevocab` dispatcher ------------------------------------------------------------------------------

SUBCOMMANDS = ("grpo", "diagnose", "study", "bench")


def test_safevocab_help_lists_the_four_subcommands(capsys):
    from trl_integration.commands import main as safevocab

    assert safevocab(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: safevocab")
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ") and line[4] != " "]
    assert tuple(listed) == SUBCOMMANDS
    assert safevocab([]) == 2  # no command: the help, on stderr
    assert "grpo" in capsys.readouterr().err


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_its_help(name, capsys):
    from trl_integration.commands import main as safevocab

    with pytest.raises(SystemExit) as exit_info:
        safevocab([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    prog = "safevocab-grpo" if name == "grpo" else f"safevocab {name}"
    assert out.startswith(f"usage: {prog} ")
    assert {"grpo": "--safe_vocab_rule", "diagnose": "--compare", "study": "--arms", "bench": "--variants"}[name] in out


def test_safevocab_grpo_help_equals_safevocab_grpo_subcommand_help(capsys):
    from trl_integration.commands import main as safevocab

    with pytest.raises(SystemExit):
        main(["--help"])
    alias = capsys.readouterr().out
    with pytest.raises(SystemExit):
        safevocab(["grpo", "--help"])
    assert capsys.readouterr().out == alias and "--safe_vocab_rule" in alias


def test_unknown_subcommand_is_one_line_and_exit_2(capsys):
    from trl_integration.commands import main as safevocab

    assert safevocab(["nope", "--help"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("safevocab: error: unknown command 'nope'") and all(n in line for n in SUBCOMMANDS)


def test_console_scripts_point_at_the_dispatcher_and_grpo():
    import importlib
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]["scripts"]
    resolved = {}
    for name, target in scripts.items():
        module, attr = target.split(":")
        resolved[name] = getattr(importlib.import_module(module), attr)
    from trl_integration.commands import main as safevocab

    assert resolved == {"safevocab": safevocab, "safevocab-grpo": main}


def test_safevocab_bench_imports_no_trl():
    """``safevocab bench`` (and the dispatcher) stay torch-only: subcommands are imported when they run."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from trl_integration.commands import main\n"
        "try:\n    main(['bench', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print(sorted(m for m in ('trl', 'transformers', 'datasets') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_tiny_grpo_config_is_the_main_jobs_and_takes_overrides(tmp_path):
    from trl_integration.commands.grpo import BUNDLED_JOB_DEFAULTS
    from trl_integration.demo.config import TINY_GRPO_DEFAULTS, tiny_grpo_config
    from trl_integration.grpo.config import SafeVocabGRPOConfig

    # the main job logs an eighth of its steps (test_the_main_job_prints_eight_log_lines_at_any_length)
    assert BUNDLED_JOB_DEFAULTS == {"dataset_name": "arithmetic", **TINY_GRPO_DEFAULTS, "logging_steps": 0.125}
    config = tiny_grpo_config(output_dir=str(tmp_path), max_steps=7, safe_vocab_rule="min_p=0.05")
    assert isinstance(config, SafeVocabGRPOConfig)
    assert config.max_steps == 7 and str(config.rule) == "min_p=0.05"
    for key in (
        "per_device_train_batch_size",
        "num_generations",
        "max_completion_length",
        "learning_rate",
        "beta",
        "save_strategy",
        "seed",
    ):
        assert getattr(config, key) == TINY_GRPO_DEFAULTS[key], key


def test_a_reward_module_in_the_working_directory_leaves_sys_path_alone(tiny_model_dir, tmp_path, monkeypatch):
    """``--reward_funcs my_rewards.length_reward`` imports ./my_rewards.py (and, at its import, a file beside it), but
    the working directory is not left on ``sys.path``: a stray ``peft.py`` or ``vllm.py`` there does not shadow the
    installed package during the run. In this process (a fresh one cost ~8 CPU-seconds for trl's imports): the
    reward records where an import of each name would resolve while the trainer calls it, which is what a stray file
    would shadow."""
    import json
    import sys
    import textwrap

    work = tmp_path / "work"
    work.mkdir()
    for stray in ("peft", "vllm"):
        (work / f"{stray}.py").write_text(
            f"raise RuntimeError('the stray {stray}.py of the working directory was imported')\n"
        )
    (work / "reward_helpers.py").write_text("def length(text):\n    return float(len(text))\n")
    (work / "my_rewards.py").write_text(
        textwrap.dedent("""
        import importlib.machinery, json, os, sys
        from reward_helpers import length

        def length_reward(completions, **kwargs):
            # where an import of the name resolves now on sys.path (sys.modules aside: trl may have imported them)
            specs = {name: importlib.machinery.PathFinder.find_spec(name) for name in ("peft", "vllm")}
            seen = {name: spec.origin if spec else None for name, spec in specs.items()}
            seen["cwd_on_path"] = os.getcwd() in sys.path or "" in sys.path
            with open("seen.json", "w") as f:
                json.dump(seen, f)
            return [length(c) for c in completions]
    """)
    )
    monkeypatch.chdir(work)
    # as the console script runs: sys.path[0] is the script's folder, and neither "" nor the working directory
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(work))])
    for name in ("my_rewards", "reward_helpers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = list(sys.path)
    main(["--model_name_or_path", tiny_model_dir, "--dataset_name", "synthetic", "--reward_funcs",
          "my_rewards.length_reward", "--max_steps", "1", "--output_dir", str(tmp_path / "run"), *SMALL])  # fmt: skip
    seen = json.loads((work / "seen.json").read_text())
    assert seen["peft"] != str(work / "peft.py") and seen["vllm"] != str(work / "vllm.py"), seen
    assert seen["cwd_on_path"] is False
    assert sys.path == before


def test_a_plugin_in_the_working_directory_leaves_sys_path_alone(tmp_path, monkeypatch):
    """``--task`` / ``--rollout_perturbation`` plug-ins (``module:function``) import from the working directory the
    same way: found there, and ``sys.path`` is as it was afterwards."""
    import sys

    from trl_integration.plugins import load_callable

    name = f"plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("def make():\n    return 'made'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    assert load_callable(f"{name}:make", "--task")() == "made"
    assert sys.path == before
