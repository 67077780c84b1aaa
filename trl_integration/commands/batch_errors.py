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

__all__ = ["reword_generation_batch_error", "generation_batch_errors"]

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
    batch, generations = int(found[1]), int(found[2])
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
