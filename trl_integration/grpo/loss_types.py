"""The ``loss_type`` values trl's ``GRPOConfig`` accepts, read from its own field help.

trl keeps no list of them ("Supported values are 'grpo', ... and 'vespo'." in the field's help) and checks the value
only inside the loss, after the model, the dataset and the first generation batch: the config checks it when it is
built (:func:`check_loss_type`), and the command line before anything heavy is imported. A leaf: regular expressions
and ``dataclasses`` only.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["accepted_loss_types", "check_loss_type", "loss_types_in"]


def accepted_loss_types(config_cls: type) -> tuple[str, ...]:
    """The ``loss_type`` values trl's ``GRPOConfig`` documents ("Supported values are 'grpo', ... and 'vespo'" in the
    field's help: trl keeps no list of them, and checks the value only in the loss); ``()`` if the help changed."""
    text = next((f.metadata.get("help", "") for f in dataclasses.fields(config_cls) if f.name == "loss_type"), "")
    return loss_types_in(text)


def loss_types_in(help_text: str) -> tuple[str, ...]:
    """The values listed in the help of trl's ``loss_type`` field ("Supported values are 'grpo', ..., and 'vespo'."),
    also as the quick pass reads it from trl's source (``early_checks.training_fields``); ``()`` if not listed."""
    listed = re.search(r"Supported values are (.*?)\.(\s|$)", help_text)
    return tuple(re.findall(r"'(\w+)'", listed.group(1))) if listed else ()


def check_loss_type(config) -> None:
    """Raise ``ValueError`` (one line) when ``config.loss_type`` is not among the values trl documents; nothing when
    trl's help no longer lists them (trl's loss then answers)."""
    accepted = accepted_loss_types(type(config))
    if accepted and config.loss_type not in accepted:
        raise ValueError(f"loss_type={config.loss_type!r}: accepted one of {', '.join(accepted)} (trl's GRPOConfig)")
