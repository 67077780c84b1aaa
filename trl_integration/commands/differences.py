"""The settings of a run that differ from trl's own defaults, so that none of them changes silently.

``safevocab-grpo`` layers its defaults: the bundled job (no ``--model_name_or_path``, no ``--config``) gets the tiny
job's settings (``trl_integration.demo.config``), any other run trl's ``GRPOConfig`` defaults; ``--help`` shows the
defaults of the case it is asked in (``safevocab-grpo --help`` the bundled job's, ``safevocab-grpo
--model_name_or_path M --help`` trl's). Each run prints the fields of ``GRPOConfig`` whose value is not trl's default
(:func:`settings_that_differ`), whichever layer set them: the bundled job, ``--config``, a flag, or this project
(``bf16`` off without a GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DERIVED_FIELDS", "format_differences", "settings_that_differ"]

#: ``GRPOConfig`` fields filled from others in ``__post_init__`` (not settings a user chose).
DERIVED_FIELDS = frozenset({"output_dir", "logging_dir", "run_name", "hub_model_id", "per_gpu_train_batch_size",
                            "per_gpu_eval_batch_size", "distributed_state"})  # fmt: skip


def settings_that_differ(training_args) -> list[tuple[str, Any, Any]]:
    """``(name, value, trl's default)`` for each field of trl's ``GRPOConfig`` whose value in ``training_args``
    differs from a ``GRPOConfig`` built with trl's defaults on this machine (both through ``__post_init__``, so
    values trl resolves itself, e.g. ``generation_batch_size``, compare resolved), in declaration order; derived
    fields (:data:`DERIVED_FIELDS`) are left out."""
    import warnings

    from trl import GRPOConfig

    common = {"output_dir": training_args.output_dir, "use_cpu": training_args.use_cpu}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            reference = GRPOConfig(**common)
        except ValueError:  # trl's bf16 default on a machine without bf16 support: compare with it turned off
            reference = GRPOConfig(**common, bf16=False)
    differ = []
    for field in dataclasses.fields(GRPOConfig):
        if field.name in DERIVED_FIELDS or field.name.startswith("_") or not field.init:
            continue
        value, default = getattr(training_args, field.name, None), getattr(reference, field.name, None)
        if value != default:
            differ.append((field.name, value, default))
    return differ


def format_differences(differences: list[tuple[str, Any, Any]]) -> str:
    """One line: ``name=value (trl: default), ...``."""
    show = lambda v: getattr(v, "value", v)  # noqa: E731  (enum members print as their value)
    return ", ".join(f"{name}={show(value)!r} (trl: {show(default)!r})" for name, value, default in differences)
