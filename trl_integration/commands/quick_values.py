"""The settings ``safevocab-grpo`` will run with, read before trl's parser builds them, and the checks on them.

:mod:`~trl_integration.commands.early_checks` checks each flag and YAML key by itself. Other mistakes need the value
a setting will take once the field's default, the main job's settings, the ``--config`` YAML and the command line
are merged (``--num_generations`` against the batch), or the file system (the output folder, the checkpoint to
resume from, the data's columns, the reward modules): trl's parser would name them only after importing its
training stack (15-30 s on a loaded laptop), some only after the model loads. :func:`read_settings` merges the
values as ``TrlParser`` does (field default < job default < YAML < command line, a string converted as argparse
converts it); :func:`check_settings` runs the checks on them, with the same one-line errors as the checks after the
full parse (:mod:`~trl_integration.commands.preflight`), which still run. A setting whose value this pass cannot
tell (a default that is not a literal, a value of another type) is left to the full parse.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

from trl_integration.commands.early_checks import _NUMBER, FieldSpec, converted, option_strings, value_kind

__all__ = ["Settings", "read_settings", "check_settings", "KNOWN_REWARDS", "REWARD_REQUIRED"]

#: The reward names ``--reward_funcs`` takes besides a dotted import path (``commands.grpo.resolve_reward_funcs``).
KNOWN_REWARDS = ("repeat_char_reward", "arithmetic_reward", "accuracy_reward", "reasoning_accuracy_reward",
                 "think_format_reward")  # fmt: skip

#: The error for a dataset of the user's own without a reward (``commands.grpo.resolve_reward_funcs``'s too).
REWARD_REQUIRED = ("--reward_funcs is required (e.g. --reward_funcs accuracy_reward, or a dotted path "
                   "my_pkg.rewards.my_reward), or --reward_model_name_or_path")  # fmt: skip

#: What ``preflight.check_before_loading`` reads of the training arguments.
_TRAINING = ("temperature", "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
             "max_completion_length", "logging_steps", "learning_rate", "loss_type", "output_dir")  # fmt: skip
_SCRIPT = ("dataset_name", "eval_num_prompts", "arithmetic_num_prompts", "synthetic_num_prompts")


@dataclasses.dataclass
class Settings:
    """``values``: field name -> the value the run will take (a field this pass cannot tell is absent);
    ``given``: the names set in the ``--config`` YAML or on the command line."""

    values: dict[str, object]
    given: set[str]


def _value(spec: FieldSpec, raw: object) -> object:
    kind, _ = value_kind(spec.annotation)
    if kind.startswith("list[") and isinstance(raw, list):
        return raw if all(isinstance(item, str) for item in raw) else dataclasses.MISSING
    return converted(spec, raw)


def _set(settings: Settings, spec: FieldSpec, raw: object) -> None:
    value = _value(spec, raw)
    settings.given.add(spec.name)
    if value is dataclasses.MISSING:
        settings.values.pop(spec.name, None)
    else:
        settings.values[spec.name] = value


def read_settings(argv: list[str], specs: dict[str, FieldSpec], config: object, job_defaults: dict) -> Settings:
    """The settings of a command line ``argv`` whose flags and ``--config`` YAML mapping ``config`` the quick pass
    accepted, over the main job's ``job_defaults`` (``{}`` for another job) and the fields' own defaults."""
    settings = Settings({n: s.default for n, s in specs.items() if s.default is not dataclasses.MISSING}, set())
    settings.values.update(job_defaults)
    if isinstance(config, dict):
        for key, raw in config.items():
            if key in specs:
                _set(settings, specs[key], raw)
    by_flag = {flag: spec for spec in specs.values() for flag in option_strings(spec)}
    for i, token in enumerate(argv):
        flag, has_value, raw = token.partition("=")
        spec = by_flag.get(flag)
        if spec is None or not token.startswith("--"):
            continue
        if flag in (f"--no_{spec.name}", f"--no-{spec.name.replace('_', '-')}"):
            _set(settings, spec, False)
            continue
        following = []
        for later in argv[i + 1 :]:
            if later.startswith("-") and not _NUMBER.match(later):
                break
            following.append(later)
        if value_kind(spec.annotation)[0].startswith("list["):
            _set(settings, spec, [raw] if has_value else following)
        elif has_value or following:
            _set(settings, spec, raw if has_value else following[0])
        else:
            _set(settings, spec, True)  # a bare boolean flag (a bare flag of another type: the full parse answers)
    return settings


def check_settings(settings: Settings, loss_types: tuple[str, ...], builtin_datasets: tuple[str, ...],
                   batch_size: tuple[int, str]) -> None:  # fmt: skip
    """Raise ``ValueError`` (one line naming the flag, the value and what is accepted) for a setting the run would
    refuse only after the full parse or the model load:

    - ``preflight.check_before_loading``'s checks (the model and data locations, the numbers' ranges, ``--loss_type``
      one of ``loss_types``, an ``--output_dir`` that is a file), when every value they read is known;
    - ``--num_generations`` below 2 or not dividing the generation batch (``batch_errors.check_generations``;
      ``batch_size``: ``(per_device_train_batch_size's default, where it comes from)``);
    - ``--safe_vocab_support replay`` without ``--use_vllm`` (the command has no other engine to replay);
    - a ``--resume_from_checkpoint`` folder missing, or lacking trainer, optimizer or scheduler state;
    - a local ``--dataset_name`` without a ``prompt`` column;
    - no ``--reward_funcs`` for a dataset of the user's own, a name neither known nor a dotted path, or one whose
      module Python cannot find.
    """
    from trl_integration.commands.batch_errors import check_generations
    from trl_integration.commands.preflight import check_before_loading, check_resume_checkpoint
    from trl_integration.commands.train_data import check_prompt_column

    values = settings.values
    mixture = bool(values.get("datasets"))
    if all(name in values for name in _TRAINING + ("model_name_or_path",)):
        script = SimpleNamespace(**{name: values.get(name) for name in _SCRIPT})
        script.dataset_name = None if mixture else script.dataset_name
        check_before_loading(script, SimpleNamespace(**{name: values[name] for name in _TRAINING}),
                             SimpleNamespace(model_name_or_path=values["model_name_or_path"]), builtin_datasets,
                             loss_types)  # fmt: skip
    check_generations(values, settings.given, batch_size, processes=int(os.environ.get("WORLD_SIZE", "1") or 1))
    if values.get("safe_vocab_support") == "replay" and values.get("use_vllm") is not True:
        # the command has no rollout_func: vLLM is the only engine whose kept sets it can replay
        raise ValueError(
            "--safe_vocab_support replay needs the engine's kept sets, which this command gets from vLLM only: "
            "accepted with --use_vllm true, or from Python with a rollout_func returning 'sampling_mask' "
            "(docs/trl.md#exact-support-replay)"
        )
    checkpoint = values.get("resume_from_checkpoint")
    if isinstance(checkpoint, str):
        model = values.get("model_name_or_path")
        allowed = values.get("resume_allow_changed_settings") or []
        check_resume_checkpoint(checkpoint, values.get("resume_allow_missing_state") is True,
                                model if isinstance(model, str) else None, allowed if isinstance(allowed, list) else [])  # fmt: skip
    dataset = values.get("dataset_name")
    rewards = values.get("reward_funcs")
    if (
        not rewards
        and "reward_model_name_or_path" in values
        and values["reward_model_name_or_path"] is None
        and (mixture or isinstance(dataset, str) and dataset not in builtin_datasets)
    ):
        raise ValueError(REWARD_REQUIRED)
    _check_reward_names(rewards)
    if isinstance(dataset, str) and not mixture and dataset not in builtin_datasets:
        try:
            check_prompt_column(os.path.expanduser(dataset), str(values.get("dataset_train_split", "train")))
        except ValueError as err:
            raise ValueError(f"--dataset_name {dataset}: {err}") from None


def _check_reward_names(names: object) -> None:
    from trl_integration.plugins import module_is_findable, where_modules_are_looked_for

    for name in names if isinstance(names, list) else []:
        if name in KNOWN_REWARDS:
            continue
        if "." not in name:
            raise ValueError(f"--reward_funcs: unknown reward function {name!r}: accepted "
                             f"{', '.join(map(repr, KNOWN_REWARDS))} or a dotted import path")  # fmt: skip
        module = name.rsplit(".", 1)[0]
        if not module_is_findable(module):
            top = module.split(".")[0]
            raise ValueError(f"--reward_funcs {name!r}: no module named {top!r}: looked "
                             f"{where_modules_are_looked_for(top)}: accepted a module Python can import "
                             "(installed, on PYTHONPATH or a .py file in the current folder)")  # fmt: skip
