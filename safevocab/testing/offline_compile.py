"""Compile the Triton kernels for a GPU on a machine without one, alongside the interpreter that runs them.

Under ``TRITON_INTERPRET=1`` (the CPU tests) Triton runs each kernel as Python, which accepts code the GPU compiler
rejects (a helper without ``@triton.jit``, which it runs as Python; a cast or a sort of a dtype the backend lacks...).
While an :class:`OfflineCompile` is active, every launch the interpreter runs is first **compiled for a GPU target**
(default ``sm_90``, Hopper: the H100/H200 of the device plan) with Triton's own compiler, down to the ``cubin``
(``ptxas`` ships in Triton's wheel; no GPU, no CUDA driver): the same function through Triton's own ``JITFunction``,
with the same arguments, so Triton's specialisation of the launch (dtypes, constexprs, integer and pointer-alignment
specialisations); host code that branches on the interpreter (``INTERPRETED``) launches what it launches there, and
:attr:`OfflineCompile.overrides` puts the GPU's constexprs where they differ.
The interpreter then runs the launch as before, so the test's values and branches are the interpreter's.

Triton's interpreter leaves ``triton.language`` patched after it runs a ``@triton.jit`` helper (its
``InterpretedFunction.__call__`` patches the language's builtins and never restores them: seen in triton 3.9), and the
compiler cannot use the patched builtins. So the state of the language's modules and classes is recorded when the
check starts, before any kernel has run (:class:`OfflineCompile` refuses to start otherwise), put back for each
compilation, and the interpreter's own state restored after it.

Each specialisation is compiled once (``JITFunction``'s cache; :attr:`OfflineCompile.compiled` lists them);
:attr:`OfflineCompile.failures` lists the ones the compiler rejected (kernel, argument types, the error's last line). It checks compilation only: the compiled code's
values, speed and launch limits (shared memory, registers) are for a device to test.

Usage (the tests: ``pytest --compile-for sm_90 tests/safevocab/test_kernels.py ...``,
tests/helpers/offline_compile_plugin.py)::

    from safevocab.testing.offline_compile import OfflineCompile

    with OfflineCompile("sm_90") as compiled:
        run_the_kernels_under_the_interpreter()
    assert not compiled.failures, compiled.report()

Every access to Triton's runtime internals (the interpreter's launch, the active driver, ``JITFunction.warmup``) is
in this module.
"""

from __future__ import annotations

import contextlib
import functools
import re
import types
from dataclasses import dataclass, field

__all__ = ["CompileFailure", "OfflineCompile", "parse_target"]


def parse_target(target: str) -> tuple[str, int]:
    """``"sm_90"`` -> ``("cuda", 90)`` (``sm_80``, ``sm_90``, ``sm_100``, ...); a one-line ``ValueError`` otherwise."""
    match = re.fullmatch(r"sm_(\d{2,3})a?", target)
    if match is None:
        raise ValueError(f"compile target={target!r}: accepted a CUDA architecture such as 'sm_90' (H100/H200)")
    return "cuda", int(match.group(1))


@dataclass(frozen=True)
class CompileFailure:
    """A specialisation the compiler rejected: the kernel, its arguments' types, the error's last line."""

    kernel: str
    signature: str
    error: str

    def __str__(self) -> str:
        return f"{self.kernel}({self.signature}): {self.error}"


class _OfflineDriver:
    """The active driver while compiling: names the target and a device 0; nothing runs."""

    def __init__(self, backend: str, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(backend, arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


@dataclass
class OfflineCompile(contextlib.AbstractContextManager):
    """While active, each interpreted Triton launch is compiled for ``target`` first (module docstring).

    Attributes:
        target: the GPU architecture, ``"sm_90"`` (H100/H200) by default (:func:`parse_target`).
        overrides: constexpr values a GPU launch takes where the interpreter's launch differs, applied to the
            compiled launch where it passes that argument, by keyword or position (e.g. ``{"LIBM": True}``: the decide
            kernel's libdevice ``expf``/``logf``, which the interpreter replaces by float64 ones).
        failures: the :class:`CompileFailure` of each specialisation the compiler rejected (one per kernel and
            argument types: a rejected one is not compiled again).

    Not thread-safe: a compilation swaps process-wide state (the language's attributes, Triton's active driver). A
    kernel's clone is made at its first launch: a global of its module changed later is not seen by the compiler.
    """

    target: str = "sm_90"
    overrides: dict[str, object] = field(default_factory=dict)
    failures: list[CompileFailure] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._backend, self._arch = parse_target(self.target)
        self._clones: dict[object, object] = {}
        self._kernels: dict[str, object] = {}  # launched kernels' clones, by module and name
        self._rejected: set[tuple[str, str]] = set()
        self._patch = None

    @property
    def compiled(self) -> list[tuple[str, str]]:
        """The specialisations compiled without error, ``(kernel, Triton's key)``: each launch is compiled through
        Triton's own ``JITFunction``, whose cache holds one entry per specialisation (dtypes, constexprs, the integer and
        pointer-alignment specialisations)."""
        return [
            (name.rsplit(".", 1)[-1], str(key))
            for name, jit in sorted(self._kernels.items())
            for caches in getattr(jit, "device_caches", {}).values()
            for key in caches[0]
        ]

    def report(self) -> str:
        """One line per failure, then the count of specialisations compiled."""
        lines = [str(failure) for failure in self.failures]
        return "\n".join([*lines, f"{len(self.compiled)} specialisation(s) compiled for {self.target}"])

    def __enter__(self) -> OfflineCompile:
        from triton.runtime.interpreter import InterpretedFunction

        self._clean = _language_state()
        patched = [f"{owner.__name__}.{name}" for owner, attrs in self._clean for name, value in attrs.items()
                   if _from_interpreter(value)]  # fmt: skip
        if patched:
            raise RuntimeError(
                f"OfflineCompile: triton.language is patched by the interpreter already ({', '.join(patched[:3])}, ...):"
                " start the check before any kernel runs in this process"
            )

        original = InterpretedFunction.run
        check = self._check

        def run(interpreted, *args, grid, warmup, **kwargs):
            check(interpreted, args, kwargs, grid)
            return original(interpreted, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        self._patch = (InterpretedFunction, original)
        return self

    def __exit__(self, *exc) -> None:
        owner, original = self._patch
        owner.run = original
        self._patch = None

    def _check(self, interpreted, args: tuple, kwargs: dict, grid) -> None:
        """Compile one launch for the target (Triton's cache skips a specialisation compiled before); a rejection is
        recorded, not raised, and not tried again for the same argument types."""
        from triton.runtime import driver

        fn = interpreted.fn
        name = getattr(fn, "__qualname__", str(fn))
        jit = self._clone(interpreted)
        self._kernels[f"{fn.__module__}.{name}"] = jit
        args, kwargs = _overridden(jit, args, kwargs, self.overrides)
        signature = _signature(jit, args, kwargs)
        if (f"{fn.__module__}.{name}", signature) in self._rejected:
            return
        previous = driver._active  # None off a GPU: reset_active() would look for a driver, and find none
        driver.set_active(_OfflineDriver(self._backend, self._arch))
        interpreted = _language_state()
        _set_language_state(self._clean)
        try:
            jit.warmup(*args, grid=grid, **kwargs)
        except Exception as err:  # noqa: BLE001 - the compiler's error is the finding
            last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            self._rejected.add((f"{fn.__module__}.{name}", signature))
            self.failures.append(CompileFailure(name, signature, f"{type(err).__name__}: {last}"[:300]))
        finally:
            driver._active = previous
            _set_language_state(interpreted)

    def _clone(self, interpreted):
        """A compilable ``JITFunction`` of an interpreted kernel or helper: the same code, with the interpreted
        ``@triton.jit`` helpers it names replaced by their own clones (the compiler inlines ``JITFunction``s only)."""
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        if interpreted in self._clones:
            return self._clones[interpreted]
        fn = interpreted.fn
        scope = dict(fn.__globals__)
        function = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        function.__qualname__, function.__module__, function.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
        function.__annotations__, function.__kwdefaults__ = dict(fn.__annotations__), fn.__kwdefaults__  # constexprs
        jit = JITFunction(function, **interpreted.kwargs)
        self._clones[interpreted] = jit
        for name, value in fn.__globals__.items():  # after registering: helpers that name each other terminate
            if isinstance(value, InterpretedFunction):
                scope[name] = self._clone(value)
            elif isinstance(value, types.ModuleType) and value.__name__.startswith("triton.language"):
                scope[name] = self._language(value)
        return jit

    def _language(self, module: types.ModuleType) -> types.ModuleType:
        """A stand-in for ``triton.language`` (or one of its modules): the same names, its ``@triton.jit`` functions
        (``tl.cdiv``, ``tl.sort``, ``tl.sum``, ... are interpreted too under the interpreter) as clones."""
        from triton.runtime.interpreter import InterpretedFunction

        if module in self._clones:
            return self._clones[module]
        stand_in = types.ModuleType(module.__name__)
        stand_in.__dict__.update(module.__dict__)
        self._clones[module] = stand_in
        for name, value in module.__dict__.items():
            if isinstance(value, InterpretedFunction):
                stand_in.__dict__[name] = self._clone(value)
            elif isinstance(value, types.ModuleType) and value.__name__.startswith("triton.language"):
                stand_in.__dict__[name] = self._language(value)
        return stand_in


def _language_objects() -> list:
    """What Triton's interpreter patches: the language module, its core, and the classes whose methods it replaces."""
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.condition, tl.core.tensor_descriptor_base]


def _language_state() -> list[tuple[object, dict[str, object]]]:
    """The attributes of :func:`_language_objects`, each object's own."""
    return [(owner, dict(vars(owner))) for owner in _language_objects()]


def _set_language_state(state: list[tuple[object, dict[str, object]]]) -> None:
    """Put ``state`` (from :func:`_language_state`) back: changed attributes set, added ones removed."""
    for owner, attrs in state:
        current = vars(owner)
        for name in [name for name in current if name not in attrs]:
            delattr(owner, name)
        for name, value in attrs.items():
            if current.get(name, _MISSING) is not value:
                setattr(owner, name, value)


_MISSING = object()


def _from_interpreter(value: object) -> bool:
    """Whether ``value`` is one of the interpreter's replacements (a function, or a partial of one, of its module)."""
    function = value.func if isinstance(value, functools.partial) else value
    return isinstance(function, types.FunctionType) and function.__module__ == "triton.runtime.interpreter"


def _overridden(jit, args: tuple, kwargs: dict, overrides: dict[str, object]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the overrides of the kernel's parameters applied, given by keyword or position."""
    names = [param.name for param in jit.params]
    args = (
        tuple(overrides.get(name, value) if name in overrides else value for name, value in zip(names, args))
        + args[len(names) :]
    )
    return args, kwargs | {key: value for key, value in overrides.items() if key in kwargs}


def _signature(jit, args: tuple, kwargs: dict) -> str:
    """What makes a launch a specialisation of its own, as Triton keys it: each constexpr's value, each other
    argument's type (:func:`_type_name`), and the launch options (``num_warps``, ...)."""
    constexpr = {param.name: param.is_constexpr for param in jit.params}
    named = dict(zip([param.name for param in jit.params], args)) | kwargs
    parts = [
        f"{key}={value!r}" if constexpr.get(key, True) else f"{key}: {_type_name(value)}"
        for key, value in named.items()
    ]
    return ", ".join(parts)


def _type_name(value: object) -> str:
    """How an argument specialises a launch, short: a tensor's dtype, a number's type and value class."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "data_ptr"):
        return str(dtype).removeprefix("torch.")
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return "int1" if value == 1 else "int16x" if value % 16 == 0 else "int"
    if isinstance(value, float):
        return "float"
    return repr(value)[:40]
