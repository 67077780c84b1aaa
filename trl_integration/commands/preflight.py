"""What ``safevocab-grpo`` checks before it loads a model: paths, values trl would only reject mid-run.

Every check raises ``ValueError`` with one line that names the flag, the value and what is accepted; the
command turns it into its one-line error (exit status 2, :func:`trl_integration.commands.errors.fail`). The
checks read only the parsed arguments and the file system: nothing here loads a model, a tokenizer or a dataset.
The quick pass (:mod:`~trl_integration.commands.quick_values`) runs them on the settings it reads before trl's
parser is imported; the command runs them again on the parsed arguments.

- ``--model_name_or_path``: an existing local directory, or something shaped like a Hub id (``org/name`` or
  ``name``); a path that points nowhere (``./x``, ``/x``, ``~/x``, ``x/y/z``) is refused here instead of being
  sent to the Hub.
- ``--dataset_name``: likewise; a data file name (``.json``/``.jsonl``/``.csv``/``.parquet``) must exist.
- ``--temperature`` > 0 (sampling divides by it), ``--max_steps`` a positive integer or -1 (trl's "train by
  epochs"; other negatives would silently train by epochs), ``--num_train_epochs`` > 0; batch size, gradient
  accumulation, completion length and logging steps > 0, ``--learning_rate`` finite and >= 0, the prompt counts
  >= 0; ``--loss_type`` one of the values trl's ``GRPOConfig`` documents; a local model directory holding
  ``config.json``; ``--output_dir`` not a file. (``--report_to`` is checked when the config is built:
  ``grpo.checks.check_report_to``.)
- ``--resume_from_checkpoint`` (:func:`check_resume_checkpoint`): an existing checkpoint folder with its trainer,
  optimizer and scheduler state (unless ``--resume_allow_missing_state``).
- a dataset mixture (``datasets:`` in the ``--config`` YAML, trl's ``DatasetMixtureConfig``): every entry's ``path``
  a ``datasets`` builder name, an existing local path or a Hub id, its local ``data_files`` existing, ``fraction``
  set for all entries or none (each > 0), and no ``fraction`` when streaming.
"""

from __future__ import annotations

import math
import os
import re

from trl_integration.commands.model_names import check_model_name
from trl_integration.grpo.loss_types import accepted_loss_types, loss_types_in

__all__ = [
    "check_before_loading",
    "check_mixture",
    "accepted_loss_types",
    "loss_types_in",
    "check_resume_checkpoint",
    "DATA_FILE_SUFFIXES",
    "DATASETS_BUILDERS",
]

#: Local data files ``safevocab-grpo`` loads with the matching ``datasets`` builder.
DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")

#: ``datasets``' packaged builders: a mixture entry's ``path`` may name one, with its ``data_files``.
DATASETS_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "webdataset", "imagefolder", "audiofolder",
                     "videofolder", "pdffolder", "xml", "sql", "eval")  # fmt: skip

#: A Hugging Face Hub repository id: ``name`` or ``namespace/name`` (letters, digits, ``-_.``).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _looks_local(value: str) -> bool:
    return value.startswith((".", "/", "~")) or value.count("/") > 1 or os.sep != "/" and os.sep in value


def _check_location(flag: str, value: str, what: str, builtin: tuple[str, ...] = ()) -> None:
    if value in builtin or os.path.exists(os.path.expanduser(value)):
        return
    if value.endswith(DATA_FILE_SUFFIXES) and (flag == "--dataset_name" or flag.startswith("datasets[")):
        raise ValueError(f"{flag} {value!r}: no such file")
    if _looks_local(value) or not _HUB_ID.match(value):
        raise ValueError(
            f"{flag} {value!r}: no such directory, and not a Hugging Face Hub id (namespace/name): accepted {what}"
        )


def check_before_loading(
    script_args,
    training_args,
    model_args,
    builtin_datasets: tuple[str, ...] = (),
    loss_types: tuple[str, ...] | None = None,
) -> None:
    """Raise ``ValueError`` (one line naming the flag) for arguments that would fail only after the model loads.

    Args:
        script_args: the parsed ``SafeVocabScriptArguments`` (or a namespace with its attributes).
        training_args: the parsed ``SafeVocabGRPOConfig`` (or a namespace with the attributes checked here).
        model_args: the parsed ``trl.ModelConfig`` (or a namespace with ``model_name_or_path``).
        builtin_datasets: ``--dataset_name`` values the command builds itself (no file, no Hub).
        loss_types: the accepted ``--loss_type`` values (default: :func:`accepted_loss_types` of
            ``type(training_args)``).
    """
    model = model_args.model_name_or_path
    if model:
        _check_location("--model_name_or_path", model, "a local model directory (save_pretrained) or a Hub id")
        check_model_name(model)  # a Hub id this machine cannot have: one line now, not the Hub's retries later
    dataset = script_args.dataset_name
    if dataset:
        _check_location(
            "--dataset_name", dataset, f"{', '.join(builtin_datasets)}, a local directory or data file, or a Hub id",
            builtin=builtin_datasets,
        )  # fmt: skip
    temperature = training_args.temperature
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"--temperature {temperature}: accepted a finite number > 0 (GRPO samples its completions)")
    if training_args.max_steps == 0 or training_args.max_steps < -1:
        raise ValueError(
            f"--max_steps {training_args.max_steps}: accepted a positive number of steps, or -1 to train by "
            "--num_train_epochs"
        )
    if training_args.max_steps == -1 and not training_args.num_train_epochs > 0:
        raise ValueError(f"--num_train_epochs {training_args.num_train_epochs}: accepted > 0")
    _check_numbers(script_args, training_args)
    _check_loss_type(
        training_args.loss_type, accepted_loss_types(type(training_args)) if loss_types is None else loss_types
    )
    if model and os.path.isdir(os.path.expanduser(model)) and not _has_config(os.path.expanduser(model)):
        raise ValueError(
            f"--model_name_or_path {model!r}: the directory has no config.json: accepted a directory written by "
            "save_pretrained (config.json and the weights)"
        )
    output_dir = training_args.output_dir
    if output_dir is not None and not str(output_dir).strip():  # an unset shell variable, most often
        raise ValueError("--output_dir '': accepted a folder path (created when missing)")
    if output_dir and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir!r} is a file: accepted a directory (created when missing)")


def _check_loss_type(loss_type: str, accepted: tuple[str, ...]) -> None:
    if accepted and loss_type not in accepted:
        raise ValueError(f"--loss_type {loss_type!r}: accepted one of {', '.join(accepted)} (trl's GRPOConfig)")


def check_resume_checkpoint(
    checkpoint: str, allow_missing_state: bool, model: str | None = None, allowed_changes: list[str] | tuple = ()
) -> None:
    """Raise ``ValueError`` (one line) for a ``--resume_from_checkpoint`` folder the run would refuse only once the
    model is loaded (``harness.checkpoint_files.checked_resume_checkpoint``; with ``model``, a local folder, also
    ``harness.checkpoint_identity.foreign_checkpoint_problem``: another model's checkpoint by its settings file and
    weights header, unless ``allowed_changes`` names the setting): missing, without ``trainer_state.json``, or,
    unless ``--resume_allow_missing_state``, without the optimizer or scheduler state (``harness.checkpoint_files
    .missing_state``'s rule for them: ``optimizer.pt``, ``optimizer.bin`` or an ``optimizer*`` folder, ``scheduler.pt``;
    DeepSpeed's ``global_step*`` holds both). What depends on the run (the RNG state per process, the fp16 scaler,
    the length-decay state, whole files) is checked when the trainer resumes."""
    flag = f"--resume_from_checkpoint {checkpoint!r}"
    folder = os.path.expanduser(checkpoint)
    if not os.path.isdir(folder):
        what = "is a file" if os.path.exists(folder) else "no such directory"
        raise ValueError(f"{flag}: {what}: accepted a checkpoint-N folder a run saved (in its --output_dir)")
    names = set(os.listdir(folder))
    if "trainer_state.json" not in names:
        raise ValueError(f"{flag} is not a complete checkpoint: trainer_state.json is missing; accepted a checkpoint-N "
                         "folder a run saved (in its --output_dir)")  # fmt: skip
    folders = {n for n in names if os.path.isdir(os.path.join(folder, n))}
    deepspeed = any(n.startswith("global_step") for n in folders)
    missing = []
    if not (deepspeed or {"optimizer.pt", "optimizer.bin"} & names or any("optimizer" in n for n in folders)):
        missing.append("optimizer.pt")
    if "scheduler.pt" not in names and not deepspeed:
        missing.append("scheduler.pt")
    if missing and not allow_missing_state:
        raise ValueError(
            f"{flag} lacks {', '.join(missing)}: resuming would silently start the optimizer state and the "
            "learning-rate schedule (transformers loads the two only together) fresh; accepted a checkpoint that has "
            "them, or --resume_allow_missing_state true to accept that"
        )
    if model is not None and os.path.isdir(os.path.expanduser(model)):
        # another model's checkpoint, from the files alone: the harness's message, before the model loads
        from trl_integration.harness.checkpoint_identity import foreign_checkpoint_problem

        problem = foreign_checkpoint_problem(folder, os.path.expanduser(model), allowed_changes)
        if problem is not None:
            raise ValueError(problem)


def _has_config(folder: str) -> bool:
    # A PEFT adapter folder (adapter_config.json) also loads: trl resolves its base model.
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("config.json", "adapter_config.json"))


def _check_numbers(script_args, training_args) -> None:
    """Sizes and rates that trl or torch would reject only once the model is loaded (or take silently)."""
    positive = {
        "--per_device_train_batch_size": training_args.per_device_train_batch_size,
        "--gradient_accumulation_steps": training_args.gradient_accumulation_steps,
        "--max_completion_length": training_args.max_completion_length,
        "--logging_steps": training_args.logging_steps,
    }
    for flag, value in positive.items():
        if value is not None and not value > 0:
            raise ValueError(f"{flag} {value}: accepted > 0")
    rate = training_args.learning_rate
    if not (rate >= 0 and rate != float("inf")):
        raise ValueError(f"--learning_rate {rate}: accepted a finite value >= 0")
    for flag in ("eval_num_prompts", "arithmetic_num_prompts", "synthetic_num_prompts"):
        value = getattr(script_args, flag, None)
        if value is not None and value < 0:
            raise ValueError(
                f"--{flag} {value}: accepted an integer >= 0 (0 skips it)"
                if flag == "eval_num_prompts"
                else f"--{flag} {value}: accepted an integer > 0"
            )


def _data_file_names(data_files) -> list[str]:
    if data_files is None:
        return []
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [f for files in data_files.values() for f in _data_file_names(files)]
    return [f for files in data_files for f in _data_file_names(files)]


def check_mixture(dataset_args) -> None:
    """Raise ``ValueError`` (one line naming the entry) for a dataset mixture that would fail at load time.

    Args:
        dataset_args: the parsed ``trl.DatasetMixtureConfig`` (``datasets:`` in the ``--config`` YAML); an empty
            mixture passes.
    """
    entries = list(dataset_args.datasets or [])
    for i, entry in enumerate(entries):
        where = f"datasets[{i}]"
        if not isinstance(entry.path, str) or not entry.path:
            raise ValueError(f"{where}.path {entry.path!r}: accepted a builder name ({', '.join(DATASETS_BUILDERS[:4])}, "
                             "...) with data_files, a local directory or file, or a Hub id")  # fmt: skip
        _check_location(f"{where}.path", entry.path, "a datasets builder name with data_files, a local directory or "
                        "file, or a Hub id", builtin=DATASETS_BUILDERS)  # fmt: skip
        for name in _data_file_names(entry.data_files):
            if "://" not in name and not any(c in name for c in "*?[") and not os.path.exists(os.path.expanduser(name)):
                raise ValueError(f"{where}.data_files {name!r}: no such file")
        if entry.path in DATASETS_BUILDERS and entry.data_files is None and entry.data_dir is None:
            raise ValueError(
                f"{where}: path {entry.path!r} is a datasets builder: accepted with data_files or data_dir"
            )
    fractions = [entry.fraction for entry in entries]
    if any(f is not None for f in fractions):
        if any(f is None for f in fractions):
            unset = [i for i, f in enumerate(fractions) if f is None]
            raise ValueError(f"datasets[{unset[0]}].fraction is not set: accepted a fraction on every entry or on none")
        for i, fraction in enumerate(fractions):
            if not (
                isinstance(fraction, (int, float))
                and fraction > 0
                and fraction == fraction
                and fraction != float("inf")
            ):
                raise ValueError(f"datasets[{i}].fraction {fraction!r}: accepted a finite number > 0")
        if dataset_args.streaming:
            raise ValueError("datasets: fraction with streaming: true is not accepted (trl's get_dataset cannot "
                             "take shares of a stream): accepted streaming: false, or no fraction")  # fmt: skip
    size = dataset_args.test_split_size
    if size is not None and not (0 < size < 1 or (float(size).is_integer() and size >= 1)):
        raise ValueError(f"test_split_size {size!r}: accepted a fraction in (0, 1) or a number of rows >= 1")
