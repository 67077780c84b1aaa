"""The first hour of a TRL user: every bad input to ``safevocab-grpo`` ends with one line and exit status 2,
before any model loads; broken runs (no usable reward, nothing trained) end with one line and status 1.

The command runs in-process (``trl_integration.commands.grpo.main``) so the file stays fast; the trainer's
constructor is replaced by one that fails the test, so a case that reaches the model load cannot pass.
"""

from __future__ import annotations

import math

import pytest

from trl_integration.commands import grpo
from trl_integration.demo.model import tiny_model_path

TINY = str(tiny_model_path())


@pytest.fixture
def no_model_load(monkeypatch):
    import trl_integration.grpo.trainer as trainer_module

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded: the bad input was not caught first")

    monkeypatch.setattr(trainer_module.SafeVocabGRPOTrainer, "__init__", loaded)


def _bad_inputs(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("max_steps: [1\n  bad: : :\n")
    list_yaml = tmp_path / "list.yaml"
    list_yaml.write_text("- a\n- b\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text('{"text": "hi"}\n')
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1="}\n{not json\n')
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"prompt": "1+1="}\n')
    (mixed / "b.jsonl").write_text('{"question": 1}\n')
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"prompt": [{"role": "user", "content": "1+1="}], "solution": "2"}\n')
    out = ["--output_dir", str(tmp_path / "run")]
    model = ["--model_name_or_path", TINY]
    return {
        "rule out of range": (["--safe_vocab_rule", "min_p=2", *out], "min_p"),
        "unknown rule": (["--safe_vocab_rule", "foo=1", *out], "foo"),
        "top_k 0": (["--safe_vocab_rule", "top_k=0", *out], "top_k"),
        "not an int": (["--max_steps", "abc", *out], "--max_steps"),
        "negative steps": (["--max_steps", "-5", *out], "--max_steps"),
        "zero steps": (["--max_steps", "0", *out], "--max_steps"),
        "abbreviated flag": (["--max_step", "3", *out], "--max_step"),
        "unknown flag": (["--max_stepz", "3", *out], "--max_stepz"),
        "zero temperature": (["--temperature", "0", *out], "--temperature"),
        "missing model dir": (["--model_name_or_path", "./no/such/model", *out], "--model_name_or_path"),
        "not a hub id": (["--model_name_or_path", "a b c", *out], "--model_name_or_path"),
        "missing config": (["--config", str(tmp_path / "nope.yaml"), *out], "--config"),
        "malformed yaml": (["--config", str(bad_yaml), *out], "--config"),
        "yaml not a mapping": (["--config", str(list_yaml), *out], "--config"),
        "missing data file": ([*model, "--dataset_name", str(tmp_path / "nope.jsonl"), "--reward_funcs",
                               "accuracy_reward", *out], "--dataset_name"),
        "empty data file": ([*model, "--dataset_name", str(empty), "--reward_funcs", "accuracy_reward", *out],
                            "--dataset_name"),
        "no prompt column": ([*model, "--dataset_name", str(no_prompt), "--reward_funcs", "accuracy_reward", *out],
                             "prompt"),
        "missing reward module": ([*model, "--dataset_name", "synthetic", "--reward_funcs", "nosuch.module", *out],
                                  "--reward_funcs"),
        "missing reward function": ([*model, "--dataset_name", "synthetic", "--reward_funcs", "math.nosuch", *out],
                                    "--reward_funcs"),
        "unknown reward name": ([*model, "--dataset_name", "synthetic", "--reward_funcs", "nosuch", *out],
                                "--reward_funcs"),
        "no reward for a custom dataset": ([*model, "--dataset_name", str(no_prompt), *out], "--reward_funcs"),
        "bad safe_vocab_support": (["--safe_vocab_support", "engine", *out], "safe_vocab_support"),
        "bad rollout dtype": (["--rollout_dtype", "fp8", *out], "rollout_dtype"),
        "unknown accelerate config": (["--accelerate_config", "zero9", *out], "--accelerate_config"),
        "num_processes not an int": (["--num_processes", "two", *out], "--num_processes"),
        "abbreviated launcher flag": (["--num_proc", "2", *out], "--num_proc"),
        "unknown yaml key": (["--config", str(_yaml(tmp_path, "typo", {"max_stepz": 3})), *out],
                             "typo.yaml: unknown key 'max_stepz' (did you mean max_steps?)"),
        "mixture missing file": ([*model, "--config", str(_mixture(tmp_path, "nofile", [
            {"path": "json", "data_files": str(tmp_path / "nope.jsonl")}])), "--reward_funcs", "accuracy_reward", *out],
            "datasets[0].data_files"),
        "mixture fraction on one entry": ([*model, "--config", str(_mixture(tmp_path, "frac", [
            {"path": "json", "data_files": str(_prompts(tmp_path)), "fraction": 0.5},
            {"path": "json", "data_files": str(_prompts(tmp_path))}])), "--reward_funcs", "accuracy_reward", *out],
            "datasets[1].fraction"),
        "mixture builder without files": ([*model, "--config", str(_mixture(tmp_path, "nobuild", [{"path": "json"}])),
                                          "--reward_funcs", "accuracy_reward", *out], "datasets[0]"),
        "mixture on the command line": ([*model, "--datasets", "a.jsonl", "--reward_funcs", "accuracy_reward", *out],
                                        "datasets[0].path 'a.jsonl': no such file"),
        "mixture unknown key": ([*model, "--config", str(_mixture(tmp_path, "key", [{"pth": "json"}])), "--reward_funcs",
                                 "accuracy_reward", *out], "pth"),
        # found by a new user's trial (each reached the model load, or trained, before)
        "zero processes": (["--num_processes", "0", *out], "--num_processes 0"),
        "negative processes": (["--num_processes", "-1", *out], "--num_processes -1"),
        "unparsable data file": ([*model, "--dataset_name", str(broken), "--reward_funcs", "accuracy_reward", *out],
                                 "cannot be read"),
        "folder of mismatched files": ([*model, "--dataset_name", str(mixed), "--reward_funcs", "accuracy_reward", *out],
                                       "cannot be read"),
        "reward not a function": ([*model, "--dataset_name", "synthetic", "--reward_funcs", "os.sep", *out],
                                  "not a function"),
        "negative learning rate": (["--learning_rate", "-1", *out], "--learning_rate"),
        "zero batch size": (["--per_device_train_batch_size", "0", *out], "--per_device_train_batch_size"),
        "zero completion length": (["--max_completion_length", "0", *out], "--max_completion_length"),
        "output dir is a file": (["--output_dir", str(empty)], "--output_dir"),
        "report_to not installed": (["--report_to", _missing_integration(), *out], "--report_to"),
        "model folder without config": (["--model_name_or_path", str(tmp_path), *out], "config.json"),
        "negative eval prompts": (["--eval_num_prompts", "-1", *out], "--eval_num_prompts"),
        "empty rule": (["--safe_vocab_rule", "", *out], "safe_vocab_rule='' is not accepted"),
        "empty rule with =": (["--safe_vocab_rule=", *out], "safe_vocab_rule='' is not accepted"),
        # issue 31: a typo answered with a suggestion, and what failed only after the model loaded
        "typo with a suggestion": (["--safe_vocab_rul", "x", *out],
                                   "unrecognized argument --safe_vocab_rul (did you mean --safe_vocab_rule?)"),
        "unknown loss type": (["--loss_type", "grpoo", *out], "--loss_type 'grpoo': accepted one of "),
        "generations not dividing the batch": (["--num_generations", "3", *out],
                                               "--per_device_train_batch_size 64 is the main job's default"),
        "chat prompts without a chat template": ([*model, "--dataset_name", str(chat), "--reward_funcs",
                                                  "accuracy_reward", *out], "has no chat_template"),
    }  # fmt: skip


def _missing_integration() -> str:
    """A logging integration whose package this environment lacks (wandb, unless it is installed)."""
    from transformers.integrations import get_available_reporting_integrations

    available = set(get_available_reporting_integrations())
    return next(n for n in ("wandb", "comet_ml", "neptune", "clearml", "mlflow", "dvclive") if n not in available)


def _yaml(tmp_path, name, mapping):
    import yaml

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(mapping))
    return path


def _mixture(tmp_path, name, entries):
    return _yaml(tmp_path, name, {"datasets": entries})


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    return path


@pytest.mark.parametrize(
    "case",
    [
        "rule out of range", "unknown rule", "top_k 0", "not an int", "negative steps", "zero steps",
        "abbreviated flag", "unknown flag", "zero temperature", "missing model dir", "not a hub id", "missing config",
        "malformed yaml", "yaml not a mapping", "missing data file", "empty data file", "no prompt column",
        "missing reward module", "missing reward function", "unknown reward name", "no reward for a custom dataset",
        "bad safe_vocab_support", "bad rollout dtype", "unknown accelerate config", "num_processes not an int",
        "abbreviated launcher flag", "unknown yaml key", "mixture missing file", "mixture fraction on one entry",
        "mixture builder without files", "mixture unknown key", "mixture on the command line", "zero processes",
        "negative processes", "unparsable data file", "folder of mismatched files", "reward not a function",
        "negative learning rate", "zero batch size", "zero completion length", "output dir is a file",
        "report_to not installed", "model folder without config", "negative eval prompts", "empty rule",
        "empty rule with =", "typo with a suggestion", "unknown loss type", "generations not dividing the batch",
        "chat prompts without a chat template",
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2_before_the_model_loads(case, tmp_path, capsys, no_model_load):
    argv, names = _bad_inputs(tmp_path)[case]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert names in lines[-1], err


def test_debug_shows_the_traceback(tmp_path, no_model_load):
    with pytest.raises(ValueError, match="min_p"):
        grpo.main(["--safe_vocab_rule", "min_p=2", "--debug", "--output_dir", str(tmp_path)])


def _none_reward(completions, **kwargs):
    return [None] * len(completions)


def _nan_reward(completions, **kwargs):
    return [math.nan] * len(completions)


@pytest.mark.parametrize("reward", ["_none_reward", "_nan_reward"])
def test_a_run_without_usable_rewards_fails_loudly(reward, tmp_path, capsys):
    argv = [
        "--model_name_or_path", TINY, "--dataset_name", "synthetic", "--reward_funcs", f"{__name__}.{reward}",
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "4", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
        "--output_dir", str(tmp_path),
    ]  # fmt: skip
    with pytest.warns(UserWarning), pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert "every reward was missing (None) or non-finite" in err.strip().splitlines()[-1]


# [int] in the slow tier (issue 53: a fresh interpreter each); [rule] keeps the console path in the fast suite, and
# test_bad_input_is_one_line_and_exit_2_before_the_model_loads the integer parser's message
@pytest.mark.parametrize(
    "argv",
    [["--safe_vocab_rule", "min_p=2"], pytest.param(["--max_steps", "abc"], marks=pytest.mark.slow)],
    ids=["rule", "int"],
)
def test_the_console_command_prints_one_line(argv, tmp_path):
    """As a user runs it (a fresh process: import-time warnings and progress bars count too)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "trl_integration.commands.grpo", *argv, "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[-1].startswith("safevocab-grpo: error: "), proc.stderr


def _parsed(argv):
    parser = grpo.make_parser()
    if grpo.bundled_job_requested(argv):
        parser.set_defaults(model_name_or_path=TINY, dataset_name="arithmetic", **grpo.tiny_grpo_config_kwargs())
    return parser.parse_args_and_config(args=argv)[1]


def test_the_run_names_every_setting_that_differs_from_trl(tmp_path):
    """The bundled job's own defaults are visible (they differ from trl's); another model gets trl's defaults."""
    from trl_integration.commands.differences import settings_that_differ

    bundled = {name: value for name, value, _ in settings_that_differ(_parsed(["--output_dir", str(tmp_path)]))}
    assert bundled["max_steps"] == 200 and bundled["learning_rate"] == 1e-4 and bundled["max_completion_length"] == 8
    other = _parsed(["--model_name_or_path", TINY, "--output_dir", str(tmp_path), "--learning_rate", "3e-6"])
    assert {name for name, _, _ in settings_that_differ(other)} == {"learning_rate", "min_p"}  # min_p: the rule's


def test_help_shows_the_defaults_of_the_case_asked(capsys):
    def help_of(argv):
        with pytest.raises(SystemExit):
            parser = grpo.make_parser()
            if grpo.bundled_job_requested(argv):
                parser.set_defaults(**grpo.tiny_grpo_config_kwargs())
            parser.parse_args_and_config(args=[*argv, "--help"])
        return " ".join(capsys.readouterr().out.split())

    assert "--max_steps MAX_STEPS" in help_of([])
    bundled, other = help_of([]), help_of(["--model_name_or_path", TINY])
    pick = lambda text: text.rsplit("--max_steps MAX_STEPS", 1)[1][:400]  # the option's entry, after the usage  # noqa: E731
    assert "200" in pick(bundled) and "(default: -1)" in pick(other)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr_scheduler_type", "reduce_lr_on_plateau"], "lr_scheduler_type='reduce_lr_on_plateau' with length_decay=True: length decay multiplies a schedule stepped once per optimizer step"),
        (["--length_decay_max_decays", "0"], "length_decay_max_decays=0 is out of range: accepted an integer >= 1"),
        (["--length_decay_cooldown", "-1", "--length_decay_max_decays", "2"], "length_decay_cooldown=-1 is out of range: accepted an integer number of steps >= 0"),
        (["--length_decay_cooldown", "5"], "length_decay_cooldown=5 with length_decay_max_decays=1: the cooldown spaces decays after the first and there are none"),
        (["--length_surge_baseline", "mean"], "--length-surge-baseline: invalid choice: 'mean' (choose from 'median', 'ema')"),
        (["--length_surge_ema_alpha", "0.2"], "length_surge_ema_alpha=0.2 with length_surge_baseline='median': accepted only with length_surge_baseline='ema'"),
        (["--length_surge_baseline", "ema", "--length_surge_ema_alpha", "1.5"], "length_surge_ema_alpha=1.5 is out of range: accepted 0 < alpha <= 1"),
    ],
)  # fmt: skip
def test_length_decay_refuses_bad_controls_in_one_line(flags, message, tmp_path, capsys, no_model_load):
    """Each bad length-decay value (or a schedule it cannot multiply) exits 2 with one line naming the flag."""
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(["--length_decay", "true", *flags, "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert message in err, err
    assert len(err.splitlines()) == 1, err


def test_the_run_pushes_to_the_hub_and_ends_like_trls_script(tmp_path, monkeypatch, capsys):
    """``--push_to_hub`` pushes the final model once, after saving it (the Hub call itself is replaced: no network
    here), and the run ends with transformers' ``Trainer.end()`` as trl's own grpo script does."""
    import trl_integration.grpo.trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module.SafeVocabGRPOTrainer, "init_hf_repo", lambda self, token=None: None)
    monkeypatch.setattr(
        trainer_module.SafeVocabGRPOTrainer, "push_to_hub", lambda self, **kw: calls.append(("push", kw))
    )
    original_end = trainer_module.SafeVocabGRPOTrainer.end
    monkeypatch.setattr(
        trainer_module.SafeVocabGRPOTrainer, "end", lambda self: calls.append(("end",)) or original_end(self)
    )
    grpo.run([
        "--model_name_or_path", TINY, "--dataset_name", "synthetic", "--max_steps", "1", "--per_device_train_batch_size",
        "4", "--num_generations", "4", "--max_completion_length", "4", "--report_to", "none", "--save_strategy", "no",
        "--output_dir", str(tmp_path), "--push_to_hub", "--hub_model_id", "me/tiny",
    ])  # fmt: skip
    assert calls[-2:] == [("push", {"dataset_name": "synthetic"}), ("end",)]  # save_model pushes too, as in trl
    assert (tmp_path / "model.safetensors").exists()


def test_the_loss_types_named_are_trls(tmp_path, capsys, no_model_load):
    """The accepted values come from trl's GRPOConfig (the field's documented list), and trl's default is among them."""
    from trl import GRPOConfig

    with pytest.raises(SystemExit):
        grpo.main(["--loss_type", "grpoo", "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    default = GRPOConfig.__dataclass_fields__["loss_type"].default
    for name in (default, "grpo", "dr_grpo", "bnpo", "cispo", "vespo"):
        assert f" {name}," in err or f" {name} " in err, err


def _head_size_16_model(tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=19, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=64, num_hidden_layers=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    path = tmp_path / "head16"
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(path)
    return str(path)


def test_vllm_cpu_refuses_the_head_size_before_the_model_loads(tmp_path, capsys, no_model_load):
    """vLLM's CPU attention backend (its own class decides: the sizes named are the ones it lists) refuses head size
    16 once its engine runs; the command refuses it first, in one line."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU build of vLLM decides the head sizes here")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    argv = ["--model_name_or_path", _head_size_16_model(tmp_path), "--dataset_name", "synthetic", "--use_vllm", "true",
            "--vllm_mode", "colocate", "--output_dir", str(tmp_path / "run")]  # fmt: skip
    capsys.readouterr()  # the model's save progress bar
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
    assert "head_dim=16" in lines[0] and f"accepted {sizes};" in lines[0], lines
    assert not CPUAttentionBackend.supports_head_size(16) and CPUAttentionBackend.supports_head_size(32)


def test_the_trainer_refuses_chat_prompts_without_a_template_when_built(tmp_path):
    """docs/trl.md: the trainer checks the tokenizer when it is built, not in the first generation step."""
    from datasets import Dataset

    from trl_integration import SafeVocabGRPOTrainer
    from trl_integration.demo import tiny_grpo_config

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1="}]}] * 4)
    with pytest.raises(ValueError, match="conversational .* has no chat_template"):
        SafeVocabGRPOTrainer(model=TINY, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                             args=tiny_grpo_config(output_dir=str(tmp_path), max_steps=1), train_dataset=data)  # fmt: skip


_HEAVY = ("transformers.training_args", "peft", "vllm", "trl.trainer.grpo_trainer", "trl.trainer.grpo_config")

#: (id, argv, exit code) of the mistakes (and ``--help``) the command answers before the training stack is imported.
MISTAKES = [
    ("typo", ["--safe_vocab_rul", "x"], 2), ("help", ["--help"], 0), ("rule", ["--safe_vocab_rule", "min_p=2"], 2),
    ("int", ["--max_steps", "abc"], 2), ("mode", ["--safe_vocab_support", "engine"], 2),
    ("yaml key", ["--config", "TYPO_YAML"], 2),
    # issues 37 (N7) and 38 (point 5)
    ("generations 0", ["--num_generations", "0"], 2), ("generations 7", ["--num_generations", "7"], 2),
    ("loss type", ["--loss_type", "grpoo"], 2), ("repeated yaml key", ["--config", "REPEATED_YAML"], 2),
    ("yaml seed 1.5", ["--config", "SEED_YAML"], 2), ("missing config", ["--config", "/nonexistent.yaml"], 2),
    ("missing checkpoint", ["--resume_from_checkpoint", "/nonexistent"], 2), ("output dir a file", ["--output_dir", "A_FILE"], 2),
    ("no prompt column", ["--model_name_or_path", TINY, "--dataset_name", "NO_PROMPT", "--reward_funcs", "accuracy_reward"], 2),
    ("missing reward module", ["--model_name_or_path", TINY, "--dataset_name", "synthetic", "--reward_funcs", "nosuch_module_x.f"], 2),
]  # fmt: skip

#: Runs each case's ``main`` in turn in one fresh interpreter, as a user's shell would run each command: its exit code,
#: everything it wrote to stderr (Python's and the file descriptor's), and the heavy modules that it imported.
_MISTAKES_DRIVER = f"""
import contextlib, io, json, os, sys, tempfile
from trl_integration.commands.grpo import main
results = []
for argv in json.loads(sys.argv[1]):
    imported_before = {{m for m in {_HEAVY!r} if m in sys.modules}}
    python_err, fd_err = io.StringIO(), tempfile.TemporaryFile(mode="w+")
    saved = os.dup(2)
    os.dup2(fd_err.fileno(), 2)
    code = 0
    try:
        with contextlib.redirect_stderr(python_err), contextlib.redirect_stdout(io.StringIO()):
            main(argv)
    except SystemExit as exit:
        code = exit.code
    finally:
        os.dup2(saved, 2)
    fd_err.seek(0)
    imported = sorted(m for m in {_HEAVY!r} if m in sys.modules and m not in imported_before)
    results.append(dict(code=code, stderr=python_err.getvalue() + fd_err.read(), imported=imported))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def mistakes_answered(tmp_path_factory):
    """Each of :data:`MISTAKES` run by the command, all in one fresh interpreter (one start-up, not sixteen: none
    of them imports the stack, and each case is charged with what it imports itself)."""
    import json
    import subprocess
    import sys

    tmp_path = tmp_path_factory.mktemp("mistakes")
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text('{"text": "hi"}\n')
    (tmp_path / "a_file").write_text("")
    repeated = tmp_path / "repeated.yaml"
    repeated.write_text("max_steps: 2\nmax_steps: 3\n")
    files = {
        "TYPO_YAML": _yaml(tmp_path, "typo", {"safe_vocab_rul": "min_p=0.1"}),
        "REPEATED_YAML": repeated,
        "SEED_YAML": _yaml(tmp_path, "seed", {"seed": 1.5}),
        "A_FILE": tmp_path / "a_file",
        "NO_PROMPT": no_prompt,
    }
    argvs = []
    for _name, argv, _code in MISTAKES:
        argv = [str(files.get(a, a)) for a in argv]
        argvs.append(argv + ([] if "--output_dir" in argv else ["--output_dir", str(tmp_path)]))
    proc = subprocess.run([sys.executable, "-c", _MISTAKES_DRIVER, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip((name for name, _, _ in MISTAKES), json.loads(proc.stdout.splitlines()[-1]), strict=True))


@pytest.mark.parametrize("name, code", [(name, code) for name, _, code in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_mistakes_and_help_answer_before_the_training_stack_is_imported(mistakes_answered, name, code):
    """Issue 31: a typo answered in seconds: transformers' TrainingArguments (which imports peft), trl's trainer and
    vLLM are not imported by then (a fresh interpreter, as a user runs the command). Issues 37 and 38: so are the
    cheap mistakes that reached the full parse or the model load before."""
    answer = mistakes_answered[name]
    assert (answer["imported"], answer["code"]) == ([], code), answer
    if code == 2:
        lines = [line for line in answer["stderr"].splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("safevocab-grpo: error: "), answer["stderr"]


def test_short_help_lists_the_safe_vocabulary_flags_first_and_help_all_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(["--help"])
    short = capsys.readouterr().out
    assert exit_info.value.code == 0
    options = [line.split()[0] for line in short.splitlines() if line.startswith("  --")]
    # --model first among the flags (First hour IV: it lists the bundled aliases), then the safe-vocabulary ones
    assert options[:4] == ["--help-all", "--config", "--model", "--safe_vocab_rule"], options[:5]
    assert len(short.splitlines()) < 400 and "--max_steps" in short and "--help-all" in short
    with pytest.raises(SystemExit):
        grpo.main(["--help-all"])
    full = capsys.readouterr().out
    assert "--gradient_checkpointing" in full and "--safe_vocab_rule" in full and len(full.splitlines()) > 1000


def test_the_quick_pass_knows_exactly_the_parsers_flags():
    """The flags read from the installed sources (early_checks) are the ones trl's parser builds: none refused that
    the parser takes, and every field of every dataclass known."""
    import dataclasses

    from trl import DatasetMixtureConfig, ModelConfig

    from trl_integration.commands import early_checks
    from trl_integration.grpo.config import SafeVocabGRPOConfig

    specs = early_checks.training_fields()
    assert set(specs) == {f.name for f in dataclasses.fields(SafeVocabGRPOConfig) if f.init}
    specs.update(early_checks.dataclass_fields((grpo.SafeVocabScriptArguments, ModelConfig, DatasetMixtureConfig)))
    ours = {flag for spec in specs.values() for flag in early_checks.option_strings(spec)}
    theirs = {flag for action in grpo.make_parser()._actions for flag in action.option_strings} - {"-h", "--help"}
    assert ours == theirs, (sorted(ours - theirs)[:10], sorted(theirs - ours)[:10])
    # The defaults the short --help prints are the dataclasses' own, module constants included (default=DEFAULT_RULE)
    real = {f.name: f.default for f in dataclasses.fields(SafeVocabGRPOConfig) if f.init}
    read = {name: spec.default for name, spec in early_checks.training_fields().items()
            if spec.default is not dataclasses.MISSING}  # fmt: skip
    assert read["safe_vocab_rule"] == real["safe_vocab_rule"] == "min_p=0.001"
    # The values the quick pass checks with grpo.checks (which imports torch) are all the config's own fields
    from trl_integration.grpo.checks import STRING_CHOICES

    assert set(STRING_CHOICES) | set(early_checks.RULE_FIELDS) <= early_checks._own_field_names()
    assert {name: (value, real[name]) for name, value in read.items() if value != real[name]} == {}


# ---------------------------------------------------------------------------------------------------------------------
# Issues 37 (N7) and 38 (point 5): cheap mistakes answered by the quick pass, before trl's parser imports its training
# stack (make_parser) and before the model loads; each of these reached the full parse (or the model load) before.


@pytest.fixture
def no_full_parse(monkeypatch, no_model_load):
    """A case that reaches trl's parser (which imports transformers' TrainingArguments, peft, trl's trainer) fails."""

    def full_parse(*args, **kwargs):
        raise AssertionError("the full parse ran: the mistake was not answered by the quick pass")

    monkeypatch.setattr(grpo, "make_parser", full_parse)


def _checkpoint(tmp_path, files=("trainer_state.json", "model.safetensors", "scheduler.pt", "rng_state.pth")):
    folder = tmp_path / "run" / "checkpoint-4"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_text("{}")
    return str(folder)


def _foreign_checkpoint(tmp_path):
    """A complete-looking checkpoint whose settings file records another model (SmolLM2's vocabulary)."""
    import json

    folder = _checkpoint(tmp_path / "foreign", ("trainer_state.json", "optimizer.pt", "scheduler.pt"))
    settings = {"model_config_class": "LlamaConfig", "model_vocab_size": 49152, "model_hidden_size": 576}
    (tmp_path / "foreign" / "run" / "checkpoint-4" / "safevocab_settings.json").write_text(
        json.dumps({"format": 1, "settings": settings})
    )
    return folder


def _cheap_mistakes(tmp_path):
    out = ["--output_dir", str(tmp_path / "run")]
    model = ["--model_name_or_path", TINY]
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text('{"text": "hi"}\n{"text": "ho", "answer": 1}\n')
    no_prompt_csv = tmp_path / "no_prompt.csv"
    no_prompt_csv.write_text("question,answer\n1+1=,2\n")
    repeated = tmp_path / "repeated.yaml"
    repeated.write_text("max_steps: 2\nlearning_rate: 1.0e-5\nmax_steps: 200\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("model_init_kwargs:\n  dtype: float32\n  dtype: bfloat16\n")
    return {
        "zero generations": (["--num_generations", "0", *out],
                             "--num_generations 0: accepted an integer >= 2"),
        "one generation": (["--num_generations=1", *out], "--num_generations 1: accepted an integer >= 2"),
        "yaml steps not an integer": (["--config", str(_yaml(tmp_path, "f", {"max_steps": 2.7})), *out],
                                      "f.yaml: max_steps 2.7: accepted an integer"),
        "yaml steps a list": (["--config", str(_yaml(tmp_path, "l", {"max_steps": [2]})), *out],
                              "l.yaml: max_steps [2]: accepted an integer"),
        "yaml seed not an integer": (["--config", str(_yaml(tmp_path, "s", {"seed": 1.5})), *out],
                                     "s.yaml: seed 1.5: accepted an integer"),
        "yaml rate a list": (["--config", str(_yaml(tmp_path, "r", {"learning_rate": [1]})), *out],
                             "r.yaml: learning_rate [1]: accepted a number"),
        "yaml repeated key": (["--config", str(repeated), *out],
                              "repeated.yaml: key 'max_steps' is set twice (lines 1 and 3): accepted each key once"),
        "yaml repeated nested key": (["--config", str(nested), *out],
                                     "nested.yaml: key 'dtype' is set twice (lines 2 and 3)"),
        "resume from nowhere": (["--resume_from_checkpoint", "/nonexistent", *out],
                                "--resume_from_checkpoint '/nonexistent': no such directory: accepted a checkpoint-N"),
        "checkpoint without optimizer": (["--resume_from_checkpoint", _checkpoint(tmp_path), *out],
                                         ("checkpoint-4' lacks optimizer.pt: resuming would silently start the optimizer "
                                         "state and the learning-rate schedule")),
        "missing config": (["--config", str(tmp_path / "nope.yaml"), *out], "nope.yaml': no such file"),
        "unknown loss type": (["--loss_type", "grpoo", *out], "--loss_type 'grpoo': accepted one of grpo, dr_grpo, "),
        "generations not dividing the batch": (["--num_generations", "7", *out],
                                               "--num_generations 7: a generation batch of 64 completions "),
        "generations not dividing a yaml batch": (
            [*model, "--config", str(_yaml(tmp_path, "b", {"per_device_train_batch_size": 6})), "--num_generations",
             "4", *out], ("--num_generations 4: a generation batch of 6 completions (per_device_train_batch_size x "
                         "processes x steps_per_generation) cannot hold whole groups of 4: accepted a divisor of 6 "
                         "(2, 3, 6), or --per_device_train_batch_size a multiple of 4")),
        "output dir is a file": (["--output_dir", str(a_file)], "is a file: accepted a directory"),
        "yaml output dir is a file": (["--config", str(_yaml(tmp_path, "o", {"output_dir": str(a_file)}))],
                                      "--output_dir"),
        "no prompt column": ([*model, "--dataset_name", str(no_prompt), "--reward_funcs", "accuracy_reward", *out],
                             "needs a 'prompt' column; it has ['text', 'answer']"),
        "no prompt column in a csv": ([*model, "--dataset_name", str(no_prompt_csv), "--reward_funcs",
                                       "accuracy_reward", *out], "needs a 'prompt' column; it has ['question', 'answer']"),
        "missing reward module": ([*model, "--dataset_name", "synthetic", "--reward_funcs", "nosuch_module_x.reward",
                                   *out], ("--reward_funcs 'nosuch_module_x.reward': no module named 'nosuch_module_x': "
                                          "looked in the current folder (")),
        "unknown reward name": ([*model, "--dataset_name", "synthetic", "--reward_funcs", "nosuch", *out],
                                "unknown reward function 'nosuch'"),
        # issue 57: answered before the model loads (before: after the load, 149 s under load)
        "empty output dir": (["--output_dir", ""], "--output_dir '': accepted a folder path"),
        "infinite temperature": (["--temperature", "inf", *out], "--temperature inf: accepted a finite number > 0"),
        # issue 53: before, it trained on the rule's sets with a UserWarning mixed into the progress bars
        "replay without an engine": (["--safe_vocab_support", "replay", *out], "--safe_vocab_support replay needs the "
                                     "engine's kept sets, which this command gets from vLLM only"),
        # issue 53: a typo of an alias, with no network, in the time of the early checks (before: 74 s of Hub retries)
        "alias typo": (["--model", "smollm2", *out], "--model smollm2: not a model folder, not an alias and not in the "
                       "Hugging Face cache, and the Hub cannot be reached from here: did you mean --model smollm2-135m?"),
        # issue 53: another model's checkpoint, from its files (before: refused after a 26 s model load)
        "checkpoint of another model": ([*model, "--resume_from_checkpoint", _foreign_checkpoint(tmp_path), *out],
                                        "was trained with other settings (safevocab_settings.json): model_vocab_size "
                                        "49152 -> "),
    }  # fmt: skip


@pytest.mark.parametrize("case", [
    "zero generations", "one generation", "yaml steps not an integer", "yaml steps a list", "yaml seed not an integer",
    "yaml rate a list", "yaml repeated key", "yaml repeated nested key", "resume from nowhere",
    "checkpoint without optimizer", "missing config", "unknown loss type", "generations not dividing the batch",
    "generations not dividing a yaml batch", "output dir is a file", "yaml output dir is a file", "no prompt column",
    "no prompt column in a csv", "missing reward module", "unknown reward name", "empty output dir",
    "infinite temperature", "alias typo", "checkpoint of another model", "replay without an engine",
])  # fmt: skip
def test_cheap_mistakes_answer_in_one_line_before_the_full_parse(case, tmp_path, capsys, no_full_parse, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no Hub here; and the alias check's own setting is undone after
    argv, message = _cheap_mistakes(tmp_path)[case]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("safevocab-grpo: error: "), lines
    assert message in lines[0], lines


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "examples/recipes/dvp_grpo.yaml", "--model_name_or_path", TINY],
        ["--config", "examples/recipes/vllm_colocate_cpu.yaml", "--model_name_or_path", TINY],
        ["--config", "YAML:num_generations: 7\nmax_steps: '5'\nlearning_rate: 1e-3\nbf16: false\n", "--num_generations", "8"],
        ["--num_generations", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3"],
        ["--num_generations", "3", "--generation_batch_size", "12"],
        ["--resume_from_checkpoint", "CHECKPOINT", "--resume_allow_missing_state", "true"],
        ["--resume_from_checkpoint", "FULL_CHECKPOINT"],
        ["--dataset_name", "PROMPTS", "--model_name_or_path", TINY, "--reward_funcs", "math.isfinite"],
    ],
    ids=["recipe", "vllm recipe", "yaml overridden", "accumulation", "generation batch", "allowed", "complete", "data"],
)  # fmt: skip
def test_good_settings_pass_the_quick_pass(argv, tmp_path, monkeypatch, no_full_parse):
    """No false refusal: each reaches the full parse (the flag overrides the YAML, a YAML string is converted as
    argparse converts it, the checkpoint's missing state is allowed, ...)."""
    import os

    monkeypatch.chdir(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))  # the repo
    replace = {
        "CHECKPOINT": _checkpoint(tmp_path, ("trainer_state.json",)),
        "PROMPTS": str(_prompts(tmp_path)),
        "FULL_CHECKPOINT": _checkpoint(tmp_path / "full", ("trainer_state.json", "optimizer.pt", "scheduler.pt")),
    }
    for i, arg in enumerate(argv):
        if arg.startswith("YAML:"):
            path = tmp_path / "good.yaml"
            path.write_text(arg[len("YAML:") :])
            argv[i] = str(path)
    argv = [replace.get(a, a) for a in argv]
    with pytest.raises(AssertionError, match="the full parse ran"):
        grpo.main([*argv, "--output_dir", str(tmp_path / "out")])


def test_a_missing_reward_module_says_where_it_was_looked_for(tmp_path, monkeypatch):
    """The import itself (after the quick pass, or for `safevocab study --task`) names the folders searched."""
    import sys

    from trl_integration.plugins import import_module

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModuleNotFoundError) as missing:
        import_module("nosuch_module_x.rewards")
    assert f"No module named 'nosuch_module_x': looked in the current folder ({tmp_path}) and on sys.path [" in str(
        missing.value
    )
    assert sys.path[-1] in str(missing.value) and str(tmp_path) not in sys.path
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'json.nosuch': looked in package 'json' \(/"):
        import_module("json.nosuch")
