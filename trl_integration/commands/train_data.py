"""The training data of ``safevocab-grpo``: ``--dataset_name`` (built-in tasks, local files and folders, Hub ids)
or trl's dataset mixtures, with one readable error for data that ``datasets`` cannot parse."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from trl_integration.demo.data import SYNTHETIC_DATASET_NAME, synthetic_dataset

if TYPE_CHECKING:
    from trl import DatasetMixtureConfig, ScriptArguments

__all__ = ["ARITHMETIC_DATASET_NAME", "load_train_dataset", "unreadable_data", "local_columns", "check_prompt_column"]

#: ``--dataset_name arithmetic``: the bundled model's task (``trl_integration.demo.arithmetic``).
ARITHMETIC_DATASET_NAME = "arithmetic"


@contextmanager
def _without_progress_bars() -> Iterator[None]:
    """No ``datasets`` progress bars on stderr while local data loads (it takes a moment); the caller's setting is
    put back after."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


@contextmanager
def unreadable_data() -> Iterator[None]:
    """A data file ``datasets`` cannot parse (a bad JSON line, columns that differ between files) as a ValueError
    with the parser's own reason, which ``datasets`` keeps as the error's cause."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    # datasets logs the parser's error before raising it ("Failed to load JSON from file ..."): the one-line error
    # below carries the same reason, so its log is off while the data loads (the caller's verbosity is put back).
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    except DatasetGenerationError as err:
        reason = err.__cause__ or err
        raise ValueError(f"the data cannot be read: {type(reason).__name__}: {reason}") from err
    finally:
        datasets.logging.set_verbosity(verbosity)


def load_train_dataset(script_args: ScriptArguments, dataset_args: DatasetMixtureConfig | None = None):
    """``(train, eval-or-None)`` datasets for ``--dataset_name``, or for the mixture of ``dataset_args``.

    ``script_args`` is the command's ``SafeVocabScriptArguments`` (trl's ``ScriptArguments`` with the prompt counts
    of the built-in tasks).

    ``synthetic`` (the default when neither is given) is the built-in task; a local directory
    written by ``save_to_disk`` is loaded with ``load_from_disk``; a local ``.json/.jsonl/.csv/.parquet`` file with
    the matching ``datasets`` builder; anything else (a directory of data files, a Hub id) goes to
    ``datasets.load_dataset``. A mixture (``datasets:`` in the YAML) is loaded by trl's own ``get_dataset``, as
    ``trl grpo`` does (its ``test`` split, with ``test_split_size``, is the eval set); it replaces
    ``--dataset_name``.
    """
    import datasets

    name = script_args.dataset_name
    if dataset_args is not None and dataset_args.datasets:
        from trl import get_dataset

        with _without_progress_bars():  # local files load in a moment: no bars on stderr
            dataset = get_dataset(dataset_args)
        name = "datasets: in --config"
    elif name == SYNTHETIC_DATASET_NAME:
        return synthetic_dataset(script_args.synthetic_num_prompts), None
    if name == ARITHMETIC_DATASET_NAME:
        from trl_integration.demo.arithmetic import make_dataset

        return make_dataset(script_args.arithmetic_num_prompts, seed=0, split="train"), None
    builders = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    if dataset_args is not None and dataset_args.datasets:
        pass  # loaded above
    elif os.path.isdir(name) and any(
        os.path.exists(os.path.join(name, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    ):
        dataset = datasets.load_from_disk(name)
    elif os.path.isdir(name):  # a folder of data files, read by datasets' packaged builders
        with _without_progress_bars():
            dataset = datasets.load_dataset(name, name=script_args.dataset_config)
    elif os.path.isfile(name) and os.path.splitext(name)[1] in builders:
        if os.path.getsize(name) == 0:
            raise ValueError(f"{name!r} is empty")
        with _without_progress_bars():
            dataset = datasets.load_dataset(builders[os.path.splitext(name)[1]], data_files=name)
    else:
        dataset = datasets.load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if dataset_args is not None and dataset_args.datasets:  # get_dataset names its splits train and test
            return _with_prompt(dataset["train"], name), dataset.get("test")
        if script_args.dataset_train_split not in dataset:
            raise ValueError(
                f"dataset {name!r} has no split {script_args.dataset_train_split!r} (--dataset_train_split): "
                f"it has {list(dataset)}"
            )
        train = dataset[script_args.dataset_train_split]
        test = dataset.get(script_args.dataset_test_split)
    else:
        train, test = dataset, None
    return _with_prompt(train, name), test


def _with_prompt(train, name: str):
    columns = train.column_names or []
    if "prompt" not in columns:
        raise ValueError(_no_prompt_column(name, columns))
    return train


def _no_prompt_column(name: str, columns: list[str]) -> str:
    return f"dataset {name!r} needs a 'prompt' column; it has {columns}"


#: A local JSON file larger than this is not read twice: its columns are checked when ``datasets`` loads it.
_SNIFF_LIMIT = 64 * 2**20


def local_columns(name: str, train_split: str = "train") -> list[str] | None:
    """The column names of the local dataset ``name`` read without ``datasets`` (which imports in seconds): a
    ``.csv`` file's header, a ``.jsonl``/``.json`` file's keys (every record's, as ``datasets`` unites them), a
    ``.parquet`` file's schema, a ``save_to_disk`` folder's features (``train_split``'s for a ``DatasetDict``);
    ``None`` when it cannot tell (not such a file, too large, not parsable: loading it names the problem)."""
    import json

    suffix = os.path.splitext(name)[1]
    try:
        if os.path.isdir(name):
            info = os.path.join(name, "dataset_info.json")
            if not os.path.isfile(info) and os.path.isfile(os.path.join(name, "dataset_dict.json")):
                info = os.path.join(name, train_split, "dataset_info.json")
            with open(info, encoding="utf-8") as f:
                features = json.load(f)["features"]
            return list(features) if isinstance(features, dict) else None
        if not os.path.isfile(name) or os.path.getsize(name) == 0:
            return None
        if suffix == ".csv":
            import csv

            with open(name, newline="", encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not in the name
                return next(csv.reader(f), None)
        if suffix == ".parquet":
            import pyarrow.parquet

            return list(pyarrow.parquet.read_schema(name).names)
        if suffix in (".json", ".jsonl") and os.path.getsize(name) <= _SNIFF_LIMIT:
            with open(name, encoding="utf-8") as f:
                text = f.read()
            try:
                records = json.loads(text)
            except ValueError:  # JSON lines
                records = [json.loads(line) for line in text.splitlines() if line.strip()]
            records = records if isinstance(records, list) else [records]
            if not all(isinstance(r, dict) for r in records):
                return None
            return list(dict.fromkeys(key for record in records for key in record))
    except Exception:  # noqa: BLE001 - unreadable, not JSON, pyarrow's own errors: loading the file names them
        return None
    return None


def check_prompt_column(name: str, train_split: str = "train") -> None:
    """Raise ``ValueError`` (``_with_prompt``'s line) when the local dataset ``name`` has columns but no ``prompt``
    (:func:`local_columns`), before ``datasets`` is imported."""
    columns = local_columns(name, train_split)
    if columns and "prompt" not in columns:
        raise ValueError(_no_prompt_column(name, columns))


def check_prompts_fit_tokenizer(model_name_or_path: str, model_args, training_args, train_dataset) -> None:
    """Conversational prompts need a chat template: the model's processor is loaded (as trl loads it; no weights)
    and checked with the trainer's own check, before the model loads."""
    from trl_integration.grpo.trainer_checks import check_chat_template, first_example

    example = first_example(train_dataset)
    if not isinstance(example, dict) or isinstance(example.get("prompt"), str):
        return
    from transformers import AutoProcessor

    processing_class = AutoProcessor.from_pretrained(
        model_name_or_path, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
    )
    check_chat_template(processing_class, train_dataset, f"the tokenizer of --model_name_or_path {model_name_or_path}")
