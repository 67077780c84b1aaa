"""Keeps docs/architecture.md true: layers, import direction, no circles, no product file over the code-line cap, the
homes of the fused op's backends and of Triton, a core root that holds what a user imports.

The import graph is read from the source (``ast``: every ``import``/``from ... import`` in a module, also
those inside functions), so a lazy import that would close a circle counts too.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("safevocab", "trl_integration")
#: Third-party packages the core must never import (it depends on torch only).
NOT_IN_CORE = ("trl", "transformers", "accelerate", "datasets", "vllm", "peft", "trl_integration")
#: The most lines of *code* a product file may hold: statements only. Docstrings, comments and blank lines are not
#: counted, so documentation never competes with code for room (the 500-line cap it replaces invited compacting
#: docstrings: three commits did so to get "back to 500").
MAX_CODE_LINES = 350
#: Product files allowed above it, each with its reason (path -> why); empty by design, and kept so.
LONG_FILES: dict[str, str] = {}
#: Where the core may import Triton (at import time), as module prefixes: the kernel ops and the Triton backend (a
#: package) that drives them. A torch-only helper may sit there too (the selection kernel's candidate phase).
TRITON_MODULES = ("safevocab.kernels.", "safevocab.backends.triton")
#: The modules of ``safevocab/backends/`` that are not a backend.
BACKEND_INFRA = ("safevocab.backends", "safevocab.backends.registry")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Product modules imported by ``module`` (resolved to the longest known module name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    resolved = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            resolved.add(name)
    return resolved


def _third_party(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_every_product_module_imports():
    # package by package, not pkgutil.walk_packages: that imports every package to walk into it, the Triton backend too
    pending = [importlib.import_module(package) for package in PRODUCT]
    while pending:
        mod = pending.pop()
        for info in pkgutil.iter_modules(mod.__path__, prefix=f"{mod.__name__}."):
            if info.name.startswith(TRITON_MODULES) or ".__main__" in info.name:
                continue  # they import Triton, whose kernels need its interpreter or CUDA (tests/safevocab/test_kernels.py)
            imported = importlib.import_module(info.name)
            if info.ispkg:
                pending.append(imported)


def test_core_never_imports_trl_or_its_stack():
    offenders = {
        module: sorted(_third_party(path) & set(NOT_IN_CORE))
        for module, path in _modules().items()
        if module.split(".")[0] == "safevocab"
    }
    assert not {m: bad for m, bad in offenders.items() if bad}
    code = (
        "import sys, safevocab, safevocab.mismatch, safevocab.bounds, safevocab.support; "
        f"print(sorted(m for m in {NOT_IN_CORE!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    known = set(modules)
    graph = {m: _imports(p, m, known) for m, p in modules.items()}
    # a package's __init__ re-exporting its submodules is not a circle: drop edges from a package to its own children
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_core_never_imports_the_integration_layer():
    modules = _modules()
    known = set(modules)
    for module, path in modules.items():
        if module.split(".")[0] == "safevocab":
            assert not [d for d in _imports(path, module, known) if d.startswith("trl_integration")], module


def code_lines(path: Path) -> int:
    """Lines of ``path`` that hold code: any line with a token that is not a comment, a docstring (the string that
    opens a module, class or function) or whitespace."""
    import io
    import tokenize

    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skipped = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(line for line in range(token.start[0], token.end[0] + 1) if line not in docstrings)
    return len(lines)


def oversized_files(paths) -> dict[str, int]:
    """``{path: code lines}`` of the files over :data:`MAX_CODE_LINES` and not in :data:`LONG_FILES`."""
    found = {}
    for path in paths:
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        if name not in LONG_FILES and (n := code_lines(path)) > MAX_CODE_LINES:
            found[name] = n
    return found


def test_no_product_file_over_the_code_line_cap():
    """No product file holds more than MAX_CODE_LINES lines of code (docstrings and comments do not count), unless
    LONG_FILES names it with a reason; and every name there still needs its exception."""
    assert not oversized_files(_modules().values())
    for name in LONG_FILES:
        assert code_lines(ROOT / name) > MAX_CODE_LINES, f"{name} no longer needs its LONG_FILES entry"


def test_the_cap_counts_code_not_documentation(tmp_path):
    """The rule catches a deliberately oversized file, and leaves a well-documented one of the same code alone."""
    body = "".join(f"x{i} = {i}  # a comment\n" for i in range(MAX_CODE_LINES))
    documented = tmp_path / "documented.py"
    documented.write_text('"""' + "A docstring line.\n" * 400 + '"""\n\n# ' + "a comment\n# " * 100 + "\n" + body)
    oversized = tmp_path / "oversized.py"
    oversized.write_text('"""Short."""\n' + body + "y = (\n    1,\n)\n")
    assert code_lines(documented) == MAX_CODE_LINES and code_lines(oversized) == MAX_CODE_LINES + 3
    assert oversized_files([documented, oversized]) == {str(oversized): MAX_CODE_LINES + 3}


def _import_time_names(path: Path, module: str) -> set[str]:
    """Dotted names ``module`` imports when it is imported: its module-level imports (not those inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.update([base, *(f"{base}.{alias.name}" for alias in node.names)])
        elif isinstance(node, (ast.If, ast.Try)):  # module-level branches run at import too
            pending.extend(ast.iter_child_nodes(node))
    return names


def test_only_the_kernels_and_the_triton_backend_import_triton():
    """``import safevocab`` works without Triton: the modules that import it when imported (directly or through
    another one) are all kernel ops or modules of the Triton backend (``TRITON_MODULES``, which the import test
    skips), the backend among them; a torch-only helper may sit beside the kernels without importing it.
    """
    core = {module: path for module, path in _modules().items() if module.split(".")[0] == "safevocab"}
    imports = {module: _import_time_names(path, module) for module, path in core.items()}
    needs_triton = {m for m, names in imports.items() if any(n.split(".")[0] == "triton" for n in names)}
    while True:  # and every module that imports one of them at import time
        more = {m for m, names in imports.items() if m not in needs_triton and names & needs_triton}
        if not more:
            break
        needs_triton |= more
    triton_side = {m for m in core if m.startswith(TRITON_MODULES)}
    assert needs_triton <= triton_side, sorted(needs_triton - triton_side)
    assert "safevocab.backends.triton" in needs_triton  # the backend, and through it every kernel op, is found


def test_each_backend_is_one_module_or_package_in_the_registry():
    """Every module or package directly in ``safevocab/backends/`` but the protocol and the registry is a backend the
    registry builds, and no module of a backend imports the registry or the autograd function that drives it (nor its
    entry point)."""
    modules = _modules()
    known = set(modules)
    # a backend is a module of safevocab/backends/, or a package there (safevocab.backends.NAME and its modules)
    backends = sorted({".".join(m.split(".")[:3]) for m in known if m.startswith("safevocab.backends.")})
    backends = [b for b in backends if b not in BACKEND_INFRA]
    registry = "safevocab.backends.registry"
    assert backends and set(backends) <= _imports(modules[registry], registry, known), backends
    for backend in backends:
        for module in sorted(m for m in known if m == backend or m.startswith(backend + ".")):
            imported = _imports(modules[module], module, known)
            assert not imported & {registry, "safevocab.backends", "safevocab.fused.op", "safevocab.logprobs"}, module


# ----------------------------------------------------------------------------------------------------------------
# trl_integration's folders (docs/architecture.md: one job per folder, imports point down)

#: The integration layer's sub-packages, bottom to top; the root modules (leaves) sit below them all.
INTEGRATION_LAYERS = ("rollout", "grpo", "harness", "demo", "lab", "study", "commands")
#: At most this many modules at trl_integration's root (the face and the leaves).
MAX_ROOT_MODULES = 10


def _integration_place(module: str) -> tuple[int, str]:
    """``(layer, name)`` of an integration module: -1 for the root's leaves, else its sub-package's index."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in INTEGRATION_LAYERS:
        return INTEGRATION_LAYERS.index(parts[1]), parts[1]
    return -1, "<root>"


def test_integration_folders_import_only_down():
    modules = _modules()
    known = set(modules)
    upward = []
    for module, path in modules.items():
        if not module.startswith("trl_integration.") or module == "trl_integration":
            continue
        layer, name = _integration_place(module)
        for dep in _imports(path, module, known):
            if not dep.startswith("trl_integration.") or dep == "trl_integration":
                continue
            dep_layer, dep_name = _integration_place(dep)
            if dep_name != name and dep_layer >= layer:
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports up or sideways between trl_integration's folders:\n" + "\n".join(sorted(upward))


#: What the config may not reach, lazily or not: the modules implementing its settings (the trainer and the drop-in's
#: step, head, replay and engine; the rollout side, the harness, the commands, the lab and the study).
CONFIG_MUST_NOT_REACH = tuple(
    f"trl_integration.{name}"
    for name in (
        "grpo.trainer", "grpo.step", "grpo.head", "grpo.replay", "grpo.vllm_engine", "grpo.batch", "grpo.metric_rows",
        "grpo.entropy_metrics", "rollout", "harness", "commands", "lab", "study", "demo",
    )
)  # fmt: skip


def _reached_from(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen, pending = set(), [start]
    while pending:
        for dep in graph[pending.pop()] - seen:
            seen.add(dep)
            pending.append(dep)
    return seen


def test_the_config_is_a_leaf():
    """The config reads what it accepts from ``options`` and its checks; it imports (through any chain, a lazy import
    inside a function included) none of the modules implementing its settings: they import the config, not the
    other way round. From the source, so it needs no interpreter importing trl."""
    modules = _modules()
    known = set(modules)
    graph = {m: _imports(p, m, known) for m, p in modules.items()}
    reached = _reached_from("trl_integration.grpo.config", graph)
    assert any(m.startswith("trl_integration.grpo.") for m in reached)  # the graph is read: its checks are there
    assert not sorted(m for m in reached if m.startswith(CONFIG_MUST_NOT_REACH))


def test_integration_root_is_small_and_has_every_folder_in_a_layer():
    package = ROOT / "trl_integration"
    root_modules = sorted(p.name for p in package.glob("*.py"))
    assert len(root_modules) <= MAX_ROOT_MODULES, root_modules
    folders = sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file())
    assert folders == sorted(INTEGRATION_LAYERS), "a folder outside INTEGRATION_LAYERS (add it to its layer)"


def test_demo_imports_nothing_from_study():
    modules = _modules()
    known = set(modules)
    for module, path in modules.items():
        if module.startswith("trl_integration.demo"):
            assert not [d for d in _imports(path, module, known) if d.startswith("trl_integration.study")], module


def test_the_fence_names_the_trl_range_pyproject_pins():
    """``trl_integration/trl_version.py`` (the fence's and the config's check) holds the range the ``trl`` extra
    installs."""
    import re

    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trl"]
    pinned = next(req for req in extras if re.match(r"trl\b", req))
    fence = (ROOT / "trl_integration" / "trl_version.py").read_text()
    low = re.search(r'^TRL_MIN = "([^"]+)"', fence, re.M).group(1)
    high = re.search(r'^TRL_MAX = "([^"]+)"', fence, re.M).group(1)
    assert pinned.replace(" ", "") == f"trl>={low},<{high}", (pinned, low, high)


def _environ_writes_at_import(path: Path) -> list[int]:
    """Lines of ``path`` that change the process environment when the module is imported: a call of
    ``os.environ.setdefault/update/pop/popitem/clear``, ``os.putenv`` or ``os.unsetenv``, or an assignment to or
    deletion of ``os.environ[...]``, anywhere but inside a function (which runs only when called)."""
    writers = {"setdefault", "update", "pop", "popitem", "clear"}

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id == "os")  # fmt: skip

    def writes(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr in writers and is_environ(func.value):
                return True
            return func.attr in ("putenv", "unsetenv") and isinstance(func.value, ast.Name) and func.value.id == "os"
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])  # fmt: skip
        return any(isinstance(t, ast.Subscript) and is_environ(t.value) for t in targets)

    found: list[int] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if writes(child):
                found.append(child.lineno)
            walk(child)

    walk(ast.parse(path.read_text(), filename=str(path)))
    return found


def test_no_product_module_sets_the_environment_at_import():
    """Importing the library must not change the caller's environment (issue 29: two demo/ modules set
    TOKENIZERS_PARALLELISM, the benchmark TRL_EXPERIMENTAL_SILENCE); scripts and examples may, being programs."""
    offenders = {
        str(path.relative_to(ROOT)): lines for path in _modules().values() if (lines := _environ_writes_at_import(path))
    }
    assert not offenders, offenders


#: The command-line entry points, which print what the library returns (as trl's and transformers' ``commands``).
CONSOLE_PACKAGES = ("trl_integration.commands",)


def _console_writes(path: Path) -> list[str]:
    """``line: call`` of each console write in ``path`` outside an ``if __name__ == "__main__":`` block (the
    ``python -m`` entry point, a program): ``print(...)``, ``pprint(...)``, a ``.print(...)`` method (rich's
    ``Console``) and ``sys.stdout.write`` / ``sys.stderr.write``. Logging and tqdm bars are not console writes."""

    def name(node: ast.AST) -> str:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return f"{name(node.value)}.{node.attr}"
        return "(...)"

    def is_main_guard(node: ast.AST) -> bool:
        test = node.test if isinstance(node, ast.If) else None
        return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))  # fmt: skip

    found: list[str] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if is_main_guard(child):
                continue
            if isinstance(child, ast.Call):
                called = name(child.func)
                if called in ("print", "pprint", "pprint.pprint", "sys.stdout.write", "sys.stderr.write") or (
                    called.endswith(".print")
                ):
                    found.append(f"{child.lineno}: {called}(...)")
            walk(child)

    walk(ast.parse(path.read_text(), filename=str(path)))
    return found


def test_no_console_writes_in_library_code():
    """Issue 39: the library returns text (or a table) and logs through a logger; only the command-line entry
    points (``trl_integration/commands/``, a ``python -m`` module's ``__main__`` block) print."""
    offenders = {
        str(path.relative_to(ROOT)): lines
        for module, path in _modules().items()
        if not module.startswith(CONSOLE_PACKAGES) and (lines := _console_writes(path))
    }
    assert not offenders, offenders
