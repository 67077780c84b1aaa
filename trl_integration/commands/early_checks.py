"""The quick pass of ``safevocab-grpo`` over its command line, before trl's training stack is imported.

Importing :class:`~trl_integration.grpo.config.SafeVocabGRPOConfig` imports transformers' ``TrainingArguments``,
which imports peft, and trl's trainer imports vLLM: 15-30 s on a loaded laptop, about 5x ``import torch``. A typo
should not wait for that. This pass reads the *names* of every flag from the installed sources instead:

- the fields of ``TrainingArguments`` -> trl's ``_BaseConfig`` -> ``GRPOConfig`` -> ``SafeVocabGRPOConfig`` are read
  with :mod:`ast` from each installed file (a dataclass field is a class-level annotated assignment; ``init=False``
  fields are not flags), the chain checked base by base;
- the light dataclasses (trl's ``ModelConfig``, ``ScriptArguments``, ``DatasetMixtureConfig``, the command's own
  script arguments) are imported and read with :func:`dataclasses.fields`;
- ``accelerate launch``'s flags come from accelerate's own parser (the command passes unknown flags to it).

Each field ``x_y`` is a flag ``--x_y`` and ``--x-y``, a boolean defaulting to true also ``--no_x_y`` and
``--no-x-y`` (transformers' ``HfArgumentParser`` rules). With these names the pass refuses an unknown flag or an
unknown ``--config`` YAML key with a did-you-mean (:mod:`difflib`), a value an ``int``/``float`` field (in the YAML
also a ``bool`` field) cannot take, and an invalid safe-vocabulary rule or mode (the config's own checks, :mod:`trl_integration.grpo.checks`). It
accepts everything else: trl's ``TrlParser`` then parses the command line for real. If the sources cannot be read
as expected (another trl or transformers layout), the pass checks nothing and the full parse answers, as before.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import os
import re
from collections.abc import Callable, Iterable

from trl_integration.grpo.field_help import docstring_help

__all__ = [
    "FieldSpec",
    "training_fields",
    "dataclass_fields",
    "option_strings",
    "value_kind",
    "converted",
    "check_command_line",
    "check_yaml",
]

#: The classes ``SafeVocabGRPOConfig`` derives from, base first: (module, class, the base it must name).
CONFIG_CHAIN = (
    ("transformers.training_args", "TrainingArguments", None),
    ("trl.trainer.base_config", "_BaseConfig", "TrainingArguments"),
    ("trl.trainer.grpo_config", "GRPOConfig", "_BaseConfig"),
    ("trl_integration.grpo.config", "SafeVocabGRPOConfig", "GRPOConfig"),
)

#: Flags of the command itself (not dataclass fields); ``--config`` takes a value.
COMMAND_FLAGS = ("--config", "--debug", "--help", "-h", "--help-all", "--accelerate_config")

#: The fields whose value is a safe-vocabulary rule string (``safe_vocab_rule`` may not be empty).
RULE_FIELDS = ("safe_vocab_rule", "rollout_tail_rule", "safe_vocab_effective_rule")

_NUMBER = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)  # a negative number is a value, not a flag


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One flag's field: its name, annotation (as written), default (``MISSING`` when not a literal) and help."""

    name: str
    annotation: str
    default: object = dataclasses.MISSING
    help: str = ""


def _source(module: str) -> str:
    """The installed source file of ``module``, found without importing it (only its top package's location)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(f"{top} is not installed as a package")
    path = os.path.join(next(iter(spec.submodule_search_locations)), *rest) + ".py"
    with open(path, encoding="utf-8") as f:
        return f.read()


def _literal(node: ast.AST | None, constants: dict[str, object] | None = None) -> object:
    """``node``'s value when it is a literal, or a name of one of the module's ``constants``; else ``MISSING``."""
    if isinstance(node, ast.Name) and constants and node.id in constants:
        return constants[node.id]  # e.g. default=DEFAULT_RULE
    try:
        return ast.literal_eval(node) if node is not None else dataclasses.MISSING
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return dataclasses.MISSING


def _module_constants(tree: ast.Module) -> dict[str, object]:
    """The module-level ``NAME = literal`` assignments of ``tree``."""
    constants: dict[str, object] = {}
    for item in tree.body:
        if isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
            value = _literal(item.value)
            if value is not dataclasses.MISSING:
                constants[item.targets[0].id] = value
    return constants


def _class_fields(module: str, class_name: str, base: str | None) -> dict[str, FieldSpec | None]:
    """The dataclass fields ``class_name`` declares in ``module``'s source (``None``: a non-``init`` field)."""
    tree = ast.parse(_source(module))
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if node is None or (base is not None and not any(ast.unparse(b).endswith(base) for b in node.bases)):
        raise LookupError(f"{module}.{class_name} (deriving from {base}) is not where this check expects it")
    found: dict[str, FieldSpec | None] = {}
    constants = _module_constants(tree)
    described = docstring_help(ast.get_docstring(node) or "")  # a field's help may live in the class docstring only
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        annotation = ast.unparse(item.annotation)
        if "ClassVar" in annotation or "InitVar" in annotation:
            continue
        default, help_text, init = _literal(item.value, constants), described.get(item.target.id, ""), True
        call = item.value
        if isinstance(call, ast.Call) and ast.unparse(call.func).split(".")[-1] == "field":
            keywords = {k.arg: k.value for k in call.keywords}
            default = _literal(keywords.get("default"), constants)
            init = _literal(keywords.get("init")) is not False
            metadata = keywords.get("metadata")
            if isinstance(metadata, ast.Dict):
                for key, value in zip(metadata.keys, metadata.values):
                    if _literal(key) == "help" and isinstance(_literal(value), str):
                        help_text = _literal(value)
        found[item.target.id] = FieldSpec(item.target.id, annotation, default, help_text) if init else None
    return found


def training_fields() -> dict[str, FieldSpec]:
    """Every ``init`` field of ``SafeVocabGRPOConfig``, read from the installed sources (a subclass's field replaces
    its base's). Raises ``LookupError``/``OSError``/``SyntaxError`` when a source is not laid out as expected."""
    merged: dict[str, FieldSpec | None] = {}
    for module, class_name, base in CONFIG_CHAIN:
        merged.update(_class_fields(module, class_name, base))
    return {name: spec for name, spec in merged.items() if spec is not None}


def own_fields(module: str = CONFIG_CHAIN[-1][0], class_name: str = CONFIG_CHAIN[-1][1]) -> list[FieldSpec]:
    """The fields ``SafeVocabGRPOConfig`` itself declares (the safe-vocabulary flags), in source order."""
    return [spec for spec in _class_fields(module, class_name, None).values() if spec is not None]


def dataclass_fields(classes: Iterable[type]) -> dict[str, FieldSpec]:
    """The ``init`` fields of imported dataclasses (the light ones: no need to read their source)."""
    specs = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.init:
                default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
                specs[f.name] = FieldSpec(f.name, _annotation(cls, f.name), default, f.metadata.get("help", ""))
    return specs


def _annotation(cls: type, name: str) -> str:
    """The annotation of field ``name`` as its class wrote it: the class's ``__annotations__``, not the field's
    ``type``, which transformers' ``HfArgumentParser`` replaces (``list[str] | None`` becomes ``list``)."""
    for klass in cls.__mro__:
        written = vars(klass).get("__annotations__", {}).get(name)
        if written is not None:
            plain = isinstance(written, type) and not hasattr(written, "__origin__")  # str, not list[str]
            return written if isinstance(written, str) else written.__name__ if plain else str(written)
    return ""


def _is_bool(annotation: str) -> bool:
    return annotation.replace(" ", "") in ("bool", "bool|None", "None|bool", "Optional[bool]", "typing.Optional[bool]")


def option_strings(spec: FieldSpec) -> list[str]:
    """The flags transformers' ``HfArgumentParser`` makes of a field."""
    names = [f"--{spec.name}", f"--{spec.name.replace('_', '-')}"]
    if _is_bool(spec.annotation) and spec.default is True:
        names += [f"--no_{spec.name}", f"--no-{spec.name.replace('_', '-')}"]
    return list(dict.fromkeys(names))


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def value_kind(annotation: str) -> tuple[str, bool]:
    """``(the annotation without None, whether None is accepted)``: ``"int | None"`` -> ``("int", True)``."""
    kind = annotation.replace(" ", "").replace("typing.", "")
    if kind.startswith("Optional[") and kind.endswith("]"):
        kind = kind[len("Optional[") : -1] + "|None"
    parts = kind.split("|")
    return "|".join(p for p in parts if p != "None"), "None" in parts


_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false"}
_TRUE, _FALSE = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")  # transformers' string_to_bool


def converted(spec: FieldSpec, value: object) -> object:
    """``value`` as trl's parser gives it to an ``int``/``float``/``bool``/``str`` field (a string converted as
    argparse converts a flag's value or a YAML default; a number kept as it is); ``dataclasses.MISSING`` when the
    field cannot take it (the caller names it) or its annotation is another."""
    kind, optional = value_kind(spec.annotation)
    if value is None:
        return None if optional else dataclasses.MISSING
    if kind not in ("int", "float", "bool", "str"):
        return dataclasses.MISSING
    if kind == "str":
        return value if isinstance(value, str) else dataclasses.MISSING
    if isinstance(value, str):
        if kind == "bool":
            text = value.lower()
            return True if text in _TRUE else False if text in _FALSE else dataclasses.MISSING
        try:
            return int(value) if kind == "int" else float(value)
        except ValueError:
            return dataclasses.MISSING
    if kind == "bool":
        return value if isinstance(value, bool) or value in (0, 1) and isinstance(value, int) else dataclasses.MISSING
    if isinstance(value, bool) or not isinstance(value, (int, float)) or kind == "int" and not isinstance(value, int):
        return dataclasses.MISSING  # max_steps: 2.7, max_steps: [2], seed: true
    return value


def _check_value(spec: FieldSpec, flag: str, value: str) -> None:
    """The checks that need no trl: a number an ``int``/``float`` field cannot take, a safe-vocabulary rule or mode."""
    kind, _ = value_kind(spec.annotation)
    if kind in ("int", "float") and converted(spec, value) is dataclasses.MISSING:
        raise ValueError(f"{flag} {value!r}: accepted {_WORDS[kind]}")
    _check_safe_vocab_value(spec.name, value)


@functools.lru_cache(maxsize=1)
def _own_field_names() -> frozenset[str]:
    return frozenset(spec.name for spec in own_fields())


def _check_safe_vocab_value(name: str, value: object) -> None:
    if not isinstance(value, str) or name not in _own_field_names():
        return  # grpo.checks imports torch: only for the safe-vocabulary fields it checks (all of them our own)
    from trl_integration.grpo.checks import STRING_CHOICES, check_rule_text, one_of

    if name in RULE_FIELDS and (name == "safe_vocab_rule" or value.strip()):
        check_rule_text(name, value)
    elif name in STRING_CHOICES:
        one_of(name, value, STRING_CHOICES[name])


def check_command_line(argv: list[str], specs: dict[str, FieldSpec], launcher_takes: Callable[[str], bool]) -> None:
    """Raise ``ValueError`` (one line) for the first flag neither a field nor ``launcher_takes`` (``accelerate
    launch``) knows, or a value :func:`_check_value` refuses."""
    by_flag = {flag: spec for spec in specs.values() for flag in option_strings(spec)}
    for i, token in enumerate(argv):
        if not token.startswith("-") or token == "--" or _NUMBER.match(token):
            continue
        flag, has_value, value = token.partition("=")
        if flag not in by_flag and flag not in COMMAND_FLAGS and not launcher_takes(flag):
            raise ValueError(
                f"unrecognized argument {flag}{_did_you_mean(flag, by_flag)}: "
                "accepted this command's flags (--help) and `accelerate launch` flags such as --num_processes N or "
                "--accelerate_config NAME"
            )
        if flag in by_flag and not flag.startswith(("--no_", "--no-")):
            if not has_value:
                following = argv[i + 1] if i + 1 < len(argv) else None
                if following is None or following.startswith("--"):
                    continue  # a boolean flag without its value, or a missing value: the full parse answers
                value = following
            _check_value(by_flag[flag], flag, value)


def check_yaml(path: str, config: object, specs: dict[str, FieldSpec], launcher_takes: Callable[[str], bool]) -> None:
    """Raise ``ValueError`` naming the file for an unknown key of a ``--config`` YAML mapping, a value an ``int``,
    ``float`` or ``bool`` field cannot take (``max_steps: 2.7``: trl's parser takes YAML values as they are, and the
    run fails on them later), or a safe-vocabulary value the config refuses. Keys are field names (trl's ``TrlParser``), ``env``, or ``accelerate launch`` flags."""
    if not isinstance(config, dict):  # trl's parser would refuse it too, once its training stack is imported
        kind = "nothing" if config is None else f"a {type(config).__name__}"
        raise ValueError(f"--config {path}: holds {kind}: accepted a YAML mapping (key: value lines)")
    for key, value in config.items():
        if key in specs:
            kind, optional = value_kind(specs[key].annotation)
            if kind in _WORDS and converted(specs[key], value) is dataclasses.MISSING:
                raise ValueError(f"--config {path}: {key} {value!r}: accepted {_WORDS[kind]}"
                                 f"{' or null' if optional else ''}")  # fmt: skip
            _check_safe_vocab_value(key, value)
        elif key != "env" and not launcher_takes(f"--{key}"):
            raise ValueError(
                f"--config {path}: unknown key {key!r}{_did_you_mean(str(key), specs)}: "
                "accepted the flags' names without the dashes (--help) and `accelerate launch` flags"
            )
