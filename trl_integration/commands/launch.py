"""Several processes from ``safevocab-grpo``: ``--num_processes`` and ``--accelerate_config``, as ``trl grpo`` has them.

trl's CLI hands every flag its dataclasses do not know to ``accelerate launch``; so does this command. When such
launcher flags are given (on the command line, or as keys of the ``--config`` YAML), the command checks its own
arguments first (one line, exit 2, before anything starts), then runs::

    accelerate launch [launcher flags] -m trl_integration.commands.grpo [the training flags]

in-process (accelerate's own ``launch_command``), with ``SAFEVOCAB_GRPO_LAUNCHED=1`` in the environment, so each
launched process trains and ignores the launcher flags it is handed again through the YAML file.

- ``--accelerate_config NAME|PATH``: a YAML file, or one of trl's bundled accelerate configs (``zero2``, ``fsdp2``,
  ``multi_gpu``, ...), resolved by trl's own :func:`trl.cli.accelerate_config.resolve_accelerate_config_argument`.
- ``--num_processes N`` (N > 1) without a config file or a distributed-type flag adds ``--multi_gpu``: accelerate's
  plain launcher would otherwise start *one* process on a machine without several GPUs; with ``--multi_gpu`` it
  starts N processes (NCCL on GPUs). Without CUDA the processes get ``ACCELERATE_USE_CPU=true``, so each Trainer
  joins as a gloo ``MULTI_CPU`` rank (as ``use_cpu=True`` would).
- Any other ``accelerate launch`` flag (``--main_process_port``, ``--mixed_precision``, ``--num_machines``, ...)
  passes through; a flag neither this command nor ``accelerate launch`` knows is a one-line error naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

__all__ = [
    "LAUNCHED_ENV",
    "MODULE",
    "join_the_launchers_group",
    "check_joined",
    "launcher_flags",
    "accelerate_launch_takes",
    "launch",
    "running_under_launch",
]

#: Set in the environment of the processes this command launches.
LAUNCHED_ENV = "SAFEVOCAB_GRPO_LAUNCHED"

#: The module every launched process runs.
MODULE = "trl_integration.commands.grpo"

#: ``accelerate launch`` flags that already choose how the processes are distributed.
_DISTRIBUTION_FLAGS = ("--config_file", "--multi_gpu", "--cpu", "--tpu", "--use_deepspeed", "--use_fsdp",
                       "--use_megatron_lm")  # fmt: skip


def running_under_launch() -> bool:
    """Whether this process was started by :func:`launch` (so launcher flags are the launcher's, not ours)."""
    return os.environ.get(LAUNCHED_ENV) == "1"


def _launch_parser(error: Callable[[str], None]):
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.allow_abbrev = False  # `--num_proc 2` is a typo here, as it is for the training flags
    parser.error = error
    return parser


def join_the_launchers_group() -> int:
    """The number of processes a launcher (``accelerate launch``, ``torchrun``: ``WORLD_SIZE``) started this process
    among (1: none). Without CUDA, makes this process join them as a gloo rank (``ACCELERATE_USE_CPU=true``, as
    :func:`launch` does): a recipe for GPUs (``distributed_type: MULTI_GPU``) would otherwise leave each process
    training alone on CPU, every one of them writing the same ``--output_dir``. Call before the training arguments
    are built (they create accelerate's state)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size > 1 and "ACCELERATE_USE_CPU" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["ACCELERATE_USE_CPU"] = "true"
    return world_size


def check_joined(world_size: int, processes: int) -> None:
    """``ValueError`` (one line) when the launcher started ``world_size`` processes but this one's training state
    counts ``processes``: they would train separately, into one folder."""
    if world_size > 1 and processes != world_size:
        raise ValueError(
            f"this process is one of WORLD_SIZE={world_size} a launcher started, but they did not join one process "
            f"group (the trainer sees {processes}): each would train alone and write the same --output_dir; "
            "accepted a launch whose processes join (safevocab-grpo --num_processes N starts them right)"
        )


def accelerate_launch_takes(flag: str) -> bool:
    """Whether ``accelerate launch`` (or trl's ``--accelerate_config``) takes ``flag``, asked of accelerate's own
    parser: a flag it does not know is left over; one that wants a value it is not given is an error."""
    if flag == "--accelerate_config":
        return True

    def refuse(message: str) -> None:
        raise ValueError(message)

    try:
        _, unknown = _launch_parser(refuse).parse_known_args([flag, "-m", MODULE])
    except ValueError:  # "expected one argument": a flag it knows, whose value is not given here
        return True
    return flag not in unknown


def launcher_flags(leftover: list[str], error: Callable[[str], None]) -> list[str]:
    """``leftover`` (the flags the training dataclasses did not take) as ``accelerate launch`` flags, with
    ``--accelerate_config`` resolved to ``--config_file`` and ``--multi_gpu`` added where N processes need it;
    ``[]`` (train in this process) when there are none.

    Calls ``error(message)`` (which must raise) for a flag ``accelerate launch`` does not know either, a value
    without a flag, or an ``--accelerate_config`` that is neither a file nor one of trl's configs.
    """
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    if not leftover:  # no launcher flag: this process trains
        return []
    try:
        flags = resolve_accelerate_config_argument(list(leftover))
    except ValueError:
        name = leftover[leftover.index("--accelerate_config") + 1] if leftover[-1] != "--accelerate_config" else ""
        error(f"--accelerate_config {name!r}: no such file, and not one of trl's accelerate configs: accepted a "
              f"YAML file or one of {_trl_config_names()}")  # fmt: skip
    parsed, unknown = _launch_parser(error).parse_known_args([*flags, "-m", MODULE])
    flags_unknown = [a for a in unknown if a.startswith("-")]
    if flags_unknown or parsed.training_script != MODULE:
        stray = flags_unknown or [parsed.training_script]
        error(f"unrecognized argument{'s' if len(stray) > 1 else ''} {' '.join(stray)}: accepted this command's "
              "flags (--help) and `accelerate launch` flags such as --num_processes N or --accelerate_config NAME")  # fmt: skip
    if parsed.num_processes is not None and parsed.num_processes < 1:
        error(f"--num_processes {parsed.num_processes}: accepted an integer >= 1")
    if (parsed.num_processes or 1) > 1 and not any(f.split("=")[0] in _DISTRIBUTION_FLAGS for f in flags):
        flags = ["--multi_gpu", *flags]
    if parsed.num_machines is None and "--config_file" not in flags:  # accelerate's defaults, without its warning
        flags += ["--num_machines", "1"]
    if parsed.dynamo_backend is None and "--config_file" not in flags:
        flags += ["--dynamo_backend", "no"]
    if parsed.mixed_precision is None and "--config_file" not in flags:
        flags += ["--mixed_precision", "no"]  # the Trainer sets it from --bf16/--fp16 in each process
    return flags


def _trl_config_names() -> list[str]:
    import importlib.resources as resources

    return sorted(p.name.removesuffix(".yaml") for p in resources.files("trl.accelerate_configs").iterdir()
                  if p.name.endswith(".yaml"))  # fmt: skip


def launch(flags: list[str], training_argv: list[str], prog: str) -> int:
    """Run ``accelerate launch FLAGS -m trl_integration.commands.grpo TRAINING_ARGV``; return the exit status.

    A failed process has printed its own one-line error; the launcher's report of it becomes one more line.
    """
    from accelerate.commands.launch import launch_command
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def refuse(message: str) -> None:
        raise ValueError(message)

    args = _launch_parser(refuse).parse_args([*flags, "-m", MODULE, *training_argv])
    print(
        f"{prog}: accelerate launch {' '.join(flags)} -m {MODULE} {' '.join(training_argv)}".rstrip(), file=sys.stderr
    )
    import torch

    env = {LAUNCHED_ENV: "1"}
    if not torch.cuda.is_available() and "--cpu" not in flags:
        # `--multi_gpu` picked torchrun's launcher; the Trainer in each process must still build a CPU (gloo) state,
        # which transformers does on `use_cpu` or this variable (accelerate's `--cpu` would start one process).
        env["ACCELERATE_USE_CPU"] = "true"
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as err:  # the plain launcher (one process)
        return err.returncode
    except ChildFailedError as err:
        codes = sorted({failure.exitcode for failure in err.failures.values()})
        print(f"{prog}: error: {len(err.failures)} of {args.num_processes} processes failed (exit status "
              f"{', '.join(map(str, codes))}); each process's own message is above", file=sys.stderr)  # fmt: skip
        return codes[0] if len(codes) == 1 and codes[0] > 0 else 1
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0
