"""Torch's intra-op thread count for a CPU training run, chosen when the trainer is built.

Why: with ``T`` intra-op threads every parallel torch op ends at an OpenMP barrier. When another process holds a core,
the OS preempts one of the ``T`` threads and the others spin at the barrier until it runs again, so a step slows down by
far more than the lost core: a GRPO step of the bundled 0.5M-parameter model took 0.415 s on one thread and 13.3 s on
two on this project's 2-core machine at load average 4.7 (``python examples/bench_threads.py``). On an idle machine a
model that small gains nothing from a second thread (each op is too small to split).

The rule, first match wins (``T0`` = torch's count when the trainer is built, ``C`` = the cores this process may run
on, ``L`` = the 1-minute load average):

1. ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` is set: ``T0`` is kept (the user chose).
2. ``T0`` differs from torch's start-up default (the machine's physical cores) and from the count this module set
   earlier: ``torch.set_num_threads`` was called, ``T0`` is kept. Calling it *with* the default is indistinguishable
   from not calling it; set ``OMP_NUM_THREADS`` to pin that count.
3. The model has fewer than :data:`SMALL_MODEL_PARAMETERS` parameters: 1 thread.
4. Fewer cores are idle than threads would run, ``C - round(L) < T0``: ``max(1, C - round(L))`` threads.
5. Otherwise ``T0`` is kept.

Only CPU runs are touched (on a GPU the intra-op threads do not carry the step). The choice is process-wide, as
``torch.set_num_threads`` is, and stays after training; one ``[safevocab] torch threads: ...`` line says what was
chosen and why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["SMALL_MODEL_PARAMETERS", "THREAD_VARIABLES", "ThreadChoice", "apply_thread_policy", "choose_threads"]

#: Models below this many parameters train on one thread: the bundled tiny model (0.50M) gained nothing from a second
#: thread on an idle 2-core machine (issue 31: 40 steps in ~10.5 s on one and on two) and lost 30x on a busy one.
SMALL_MODEL_PARAMETERS = 1_000_000
#: The variables that fix torch's thread count at start-up: when one is set, its value is the user's choice.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: The count this module last set in this process (a second trainer must not read it as the user's choice).
_chosen: int | None = None


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count to use and the reason, as one readable clause."""

    threads: int
    reason: str

    def line(self, before: int) -> str:
        change = f"{before} -> {self.threads}" if self.threads != before else f"{self.threads} (kept)"
        return f"[safevocab] torch threads: {change}: {self.reason}"


def choose_threads(
    *, current: int, default: int, chosen_before: int | None, parameters: int, load: float, cores: int,
    environ: dict[str, str],
) -> ThreadChoice:  # fmt: skip
    """The rule of this module's docstring, as a pure function of what it reads."""
    for name in THREAD_VARIABLES:
        if environ.get(name, "").strip():
            return ThreadChoice(current, f"{name}={environ[name]} is set")
    if current not in (default, chosen_before):
        return ThreadChoice(current, f"torch.set_num_threads({current}) was called (torch's default here: {default})")
    hint = "; OMP_NUM_THREADS=N chooses for you"
    if current > 1 and parameters < SMALL_MODEL_PARAMETERS:
        return ThreadChoice(
            1, f"the model has {parameters / 1e6:.2f}M parameters (< {SMALL_MODEL_PARAMETERS / 1e6:g}M): a second "
            f"thread gains nothing and stalls whenever another process holds a core{hint}"
        )  # fmt: skip
    idle = cores - round(load)
    if idle < current:
        threads = max(1, idle)
        return ThreadChoice(
            threads, f"load average {load:.1f} on {cores} cores leaves {max(idle, 0)} idle: threads beyond the idle "
            f"cores wait for each other at every op{hint}"
        )  # fmt: skip
    return ThreadChoice(current, f"{parameters / 1e6:.2f}M parameters, load average {load:.1f} on {cores} cores")


def _torch_default_threads() -> int:
    """Torch's start-up count without a thread variable: its physical-core count (``os.cpu_count`` if unknown)."""
    try:
        import psutil  # an accelerate dependency

        physical = psutil.cpu_count(logical=False)
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        physical = None
    return physical or os.cpu_count() or 1


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def apply_thread_policy(model: torch.nn.Module, device: torch.device, announce: bool = True) -> ThreadChoice | None:
    """Choose and set torch's intra-op threads for training ``model`` on ``device``; ``None`` (nothing done) off CPU.

    ``announce``: print the one line saying what was chosen and why (the main process does).
    """
    global _chosen
    if device.type != "cpu":
        return None
    current = torch.get_num_threads()
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 shards: full sizes
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    choice = choose_threads(
        current=current, default=_torch_default_threads(), chosen_before=_chosen, parameters=parameters, load=load,
        cores=_usable_cores(), environ=dict(os.environ),
    )  # fmt: skip
    if choice.threads != current:
        torch.set_num_threads(choice.threads)
        _chosen = choice.threads
    if announce:
        print(choice.line(current), flush=True)
    return choice
