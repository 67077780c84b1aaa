"""The short ``safevocab-grpo --help``: the safe-vocabulary flags first, then the flags a first run uses.

trl's parser lists about 300 flags (1,500 lines; the safe-vocabulary ones from line 1,345) and needs transformers'
``TrainingArguments`` imported. The short help is built from the field list of
:mod:`trl_integration.commands.early_checks` (read from the installed sources, nothing heavy imported) and points to
``--help-all``, trl's full listing.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from trl_integration.commands.early_checks import FieldSpec

__all__ = ["COMMON_FLAGS", "short_help"]

#: The trl / transformers flags a first run sets, in the order listed.
COMMON_FLAGS = (
    "model_name_or_path", "dataset_name", "reward_funcs", "output_dir", "max_steps", "learning_rate",
    "per_device_train_batch_size", "num_generations", "max_completion_length", "temperature", "loss_type", "beta",
    "use_vllm", "vllm_mode", "vllm_importance_sampling_mode", "logging_steps", "save_strategy", "report_to", "seed", "resume_from_checkpoint",
)  # fmt: skip

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'(])")


def _first_sentences(text: str, limit: int = 240) -> str:
    """The help text's first sentences, up to about ``limit`` characters (trl's are paragraphs long)."""
    text = " ".join(text.split())
    out = ""
    for sentence in _SENTENCE_END.split(text):
        if out and len(out) + len(sentence) > limit:
            break
        out = f"{out} {sentence}".strip()
    return out.replace("%", "%%")


def _add(group, spec: FieldSpec, defaults: dict) -> None:
    default = defaults.get(spec.name, spec.default)
    shown = "" if default is dataclasses.MISSING else f" (default: {default!r})"
    group.add_argument(f"--{spec.name}", metavar=spec.name.upper(), help=_first_sentences(spec.help) + shown)


def short_help(prog: str, description: str, safe_vocab: list[FieldSpec], specs: dict[str, FieldSpec],
               defaults: dict, epilog: str, aliases: dict[str, str] | None = None) -> str:  # fmt: skip
    """The short help text: ``--model`` and its ``aliases`` (name -> what it is), ``safe_vocab`` (the safe-vocabulary
    fields, in source order), then :data:`COMMON_FLAGS` (found in ``specs``, every flag's field), each with its default
    (``defaults`` first: the bundled job's)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        add_help=False,
        epilog=epilog,
        usage=f"{prog} [--help | --help-all] [--config FILE.yaml] [--FLAG VALUE ...]",
    )
    parser.add_argument("-h", "--help", action="store_true", help="this help (the flags a first run uses)")
    parser.add_argument("--help-all", action="store_true", help=f"every flag ({len(specs)}: trl's GRPOConfig, "
                        "transformers' TrainingArguments, trl's ModelConfig and ScriptArguments), as trl lists them")  # fmt: skip
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of flag values (keys: the flag names "
                        "without the dashes); flags given on the command line override it")  # fmt: skip
    if aliases:
        listed = "; ".join(f"{name}: {what}" for name, what in aliases.items()).replace("%", "%%")
        parser.add_argument("--model", metavar="NAME", help=f"a model by alias, with a job sized for it ({listed}); "
                            "anything else is --model_name_or_path (a local folder, or a Hub id)")  # fmt: skip
    group = parser.add_argument_group("safe-vocabulary flags (SafeVocabGRPOConfig)")
    for spec in safe_vocab:
        _add(group, spec, defaults)
    group = parser.add_argument_group("common flags (trl / transformers; --help-all lists every one)")
    for name in COMMON_FLAGS:
        if name in specs:
            _add(group, specs[name], defaults)
    return parser.format_help()
