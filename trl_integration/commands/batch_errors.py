"""trl's "generation batch not divisible by ``num_generations``" error, said in terms of what the user set.

trl's ``GRPOConfig`` derives the generation batch (``per_device_train_batch_size x processes x
steps_per_generation``, ``steps_per_generation`` defaulting to ``gradient_accumulation_steps``) and refuses it with
``generation_batch_size (64) must be divisible by num_generations (3).``: a user who typed only ``--num_generations 3``
is blamed for a batch size they never set. :func:`reword_generation_batch_error` names the flag they did set, where
the batch comes from, its divisors, and the batch sizes that would fit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["reword_generation_batch_error", "generation_batch_message", "check_generations", "generation_batch_errors"]

#: trl's message (``trl/trainer/grpo_config.py``, ``GRPOConfig.__post_init__``).
_TRL_MESSAGE = re.compile(r"generation_batch_size \((\d+)\) must be divisible by num_generations \((\d+)\)")


def reword_generation_batch_error(message: str, set_by_user: set[str], batch_size: tuple[int, str]) -> str | None:
    """The one-line error for trl's ``message``, or ``None`` when it is another error.

    Args:
        message: the text of trl's ``ValueError``.
        set_by_user: the field names given on the command line or in the ``--config`` YAML.
        batch_size: ``(value, origin)`` of ``per_device_train_batch_size`` when the user did not set it (e.g.
            ``(64, "the main job's default")``).
    """
    found = _TRL_MESSAGE.search(message)
    if found is None:
        return None
    return generation_batch_message(int(found[1]), int(found[2]), set_by_user, batch_size)


def generation_batch_message(batch: int, generations: int, set_by_user: set[str], batch_size: tuple[int, str]) -> str:
    """``--num_generations G: a generation batch of B completions (where B comes from) cannot hold whole groups of
    G: accepted a divisor of B (...), or --<the batch flag> a multiple of G`` (arguments as
    :func:`reword_generation_batch_error`'s)."""
    if "generation_batch_size" in set_by_user:
        origin = "--generation_batch_size"
    else:
        origin = "per_device_train_batch_size x processes x steps_per_generation"
        if "per_device_train_batch_size" not in set_by_user:
            value, where = batch_size
            origin += f"; --per_device_train_batch_size {value} is {where}"
    divisors = [d for d in range(2, batch + 1) if batch % d == 0][:6]
    flag = "--generation_batch_size" if "generation_batch_size" in set_by_user else "--per_device_train_batch_size"
    return (
        f"--num_generations {generations}: a generation batch of {batch} completions ({origin}) cannot hold whole "
        f"groups of {generations}: accepted a divisor of {batch} ({', '.join(map(str, divisors))}), or {flag} a "
        f"multiple of {generations}"
    )


def check_generations(values: dict, set_by_user: set[str], batch_size: tuple[int, str], processes: int) -> None:
    """Raise ``ValueError`` (one line) for a ``num_generations`` trl's ``GRPOConfig`` would refuse, before it is built:
    below 2 (trl divides by it first: a ``ZeroDivisionError`` for 0), or not dividing the generation batch, derived
    as trl derives it (``GRPOConfig.__post_init__``) from ``values`` (the settings the run will take; a setting
    missing from it is not checked) and the ``processes`` the run is launched among."""
    generations = values.get("num_generations")
    if not isinstance(generations, int) or isinstance(generations, bool):
        return
    if generations < 2:
        raise ValueError(f"--num_generations {generations}: accepted an integer >= 2 (GRPO compares the completions "
                         "of each prompt with each other)")  # fmt: skip
    names = (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "generation_batch_size",
        "steps_per_generation",
    )
    per_device, accumulation, batch, steps = (values.get(name, ...) for name in names)
    if ... in (per_device, accumulation, batch, steps) or batch is not None and steps is not None:
        return  # unknown, or both set: trl's own error names that
    if batch is None:
        batch = per_device * processes * (accumulation if steps is None else steps)
    elif per_device > 0 and batch % (per_device * processes):
        return  # trl's own error names the global batch size
    if batch > 0 and batch % generations:
        raise ValueError(generation_batch_message(batch, generations, set_by_user, batch_size))


@contextmanager
def generation_batch_errors(argv: list[str], config: str | None, job_defaults: dict | None) -> Iterator[None]:
    """Reword trl's error raised inside (the config being built from ``argv`` and the ``config`` YAML file; the
    main job's ``job_defaults`` when it runs, else trl's defaults) with :func:`reword_generation_batch_error`."""
    try:
        yield
    except ValueError as err:
        given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
        if config is not None:
            import yaml

            with open(config) as f:
                mapping = yaml.safe_load(f)
            given |= set(mapping) if isinstance(mapping, dict) else set()
        if job_defaults is not None:
            size = (job_defaults["per_device_train_batch_size"], "the main job's default")
        else:
            from trl_integration.grpo.config import SafeVocabGRPOConfig

            size = (SafeVocabGRPOConfig.__dataclass_fields__["per_device_train_batch_size"].default, "trl's default")
        message = reword_generation_batch_error(str(err), given, size)
        if message is None:
            raise
        raise ValueError(message) from None
