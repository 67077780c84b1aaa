"""One rule for the tests on the real vLLM engine: skipped only where vLLM is not installed; with
``SAFEVOCAB_REQUIRE_VLLM=1`` (set by ``scripts/test.sh`` when the extras include vllm, as in CI) a missing vLLM fails
the run instead, so a broken install cannot pass as skipped tests."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest


def require_vllm(module_level: bool = False) -> None:
    """Fail or skip (the whole module with ``module_level=True``) unless ``vllm`` can be imported."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("SAFEVOCAB_REQUIRE_VLLM") == "1":
        pytest.fail(
            "SAFEVOCAB_REQUIRE_VLLM=1 but vLLM is not installed: install the vllm extra (scripts/setup_env.sh does)",
            pytrace=False,
        )
    pytest.skip(
        "vLLM is not installed (the vllm extra; scripts/setup_env.sh installs it)", allow_module_level=module_level
    )


def release_vllm_process_state() -> None:
    """Leave no vLLM engine state in this process for the next test module: finalise the engines it dropped, then
    forget vLLM's process-wide parallel groups (``vllm.distributed.parallel_state``).

    A colocated trainer's ``Trainer.end()`` destroys torch's default process group, and with it the groups vLLM
    holds; the dropped engine's own clean-up (run by the garbage collector) then raises ``Invalid process group
    specified`` half way and leaves the stale groups set, so the next engine built in the process skips their set-up
    and fails ("Process group ... is not initialized in the world group map"). Which module ran before another in the
    same process depends on the order (and, under pytest-xdist, on the worker), so each module starts clean.
    """
    import gc

    import torch
    from vllm.distributed import parallel_state

    gc.collect()
    try:
        parallel_state.cleanup_dist_env_and_memory()
    except ValueError:  # the groups were destroyed with the default group already: forget them
        for name in ("_ETP", "_TP", "_ENGRAM_DP", "_DCP", "_PCP", "_PP", "_DP", "_EP", "_EPLB", "_WORLD"):
            if hasattr(parallel_state, name):
                setattr(parallel_state, name, None)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def shared_engines():
    """While open, trl's ``LLM(...)`` returns the engine already built for the same checkpoint and dtype (a module's
    trainers share one real engine, each pushing its own weights into it); yields the ``{(model, dtype): engine}``
    dict, released on exit."""
    import gc

    from trl_integration._private import wrapped_engine_builder
    from trl_integration.grpo.vllm_engine import reusing_engines

    built: dict[tuple, object] = {}
    # A free port for this worker's rendezvous (trl keeps a MASTER_PORT already set; tests/conftest.py puts the
    # variable back after the module): two pytest-xdist workers building engines at once otherwise both reached
    # torch's default 29500 (EADDRINUSE in test_lora_vllm_sync.py beside test_vllm_engine.py).
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    try:
        with wrapped_engine_builder(reusing_engines(built)):
            yield built
    finally:
        built.clear()
        gc.collect()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
