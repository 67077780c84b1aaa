"""Shared pytest configuration: hypothesis profiles, the helpers' import path and the tiny-model fixtures.

The test folders mirror the packages: ``tests/safevocab/`` tests ``safevocab/``, ``tests/trl_integration/grpo/``
``trl_integration/grpo/`` (and so ``rollout/``, ``commands/``, ``lab/``, ``study/``, ``demo/``; the top-level modules'
tests, such as the private-API fence's, directly in ``tests/trl_integration/``); ``tests/`` itself holds the
project-wide checks (architecture, docs, the test script). The core is collected first, as its name sorts first:
``tests/safevocab/test_kernels.py`` must import Triton (under its interpreter) before any module imports trl.

Modules the tests share (``trl_helpers``, ``safevocab_reference``, the plugins the command line names as
``rollout_plugins:...``) live in ``tests/helpers/``, put on ``sys.path`` here: they keep their plain import names
(which the tests also pass to the command line as strings) whatever folder imports them and whichever import mode
pytest uses, and the scripts among them (``kill_during_save.py``, ``multiprocess_check.py``) run by path import their
neighbours from their own folder.

``CI=true`` (or ``HYPOTHESIS_PROFILE=ci``) selects a derandomized profile, so CI runs are reproducible;
locally the default profile explores new examples each run.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from trl_integration.notices import filter_known_notices

HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

# trl_helpers sets trl's/transformers' quiet-run variables (TRL_EXPERIMENTAL_SILENCE, ...) at import: for the session.
from trl_helpers import DISTRIBUTED, build_model, build_tokenizer  # noqa: E402
from vllm_required import release_vllm_process_state  # noqa: E402

#: ``--compile-for sm_90``: the interpreted Triton launches compiled for a GPU too (tests/helpers/offline_compile_plugin.py)
pytest_plugins = ["offline_compile_plugin"]

#: The folder whose tests need trl.
TRL_TESTS = Path(__file__).resolve().parent / "trl_integration"

# Without the trl extra installed these tests cannot run: skip the folder instead of failing collection.
if importlib.util.find_spec("trl") is None:  # pragma: no cover
    collect_ignore = ["trl_integration"]

# The command-line entry points' notice filters (trl_integration/notices.py), before a test imports trl or vLLM:
# `import trl_integration` no longer installs them.
filter_known_notices()

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# One intra-op thread unless OMP_NUM_THREADS says otherwise: what scripts/test.sh and the trainer's thread policy
# (trl_integration/harness/threads.py) choose for the tiny test models. With two, a bare `pytest` ran trl's stock trainer
# on two threads and SafeVocabGRPOTrainer on one (the policy lowers it when the trainer is built, for the rest of the
# process), and the stock-vs-ours comparisons saw two reduction orders (weights 6.5e-5 apart, limit 1e-6).
if not os.environ.get("OMP_NUM_THREADS"):
    torch.set_num_threads(1)


# torch.distributed's rendezvous variables (trl_helpers.DISTRIBUTED): trl's colocated vLLM
# (``trl.trainer.utils.ensure_master_addr_port``) and an in-process vLLM engine set them in ``os.environ``; left behind,
# a later module's child process joins that rendezvous, and under pytest-xdist two workers' children took the same port
# (EADDRINUSE on trl's 23456).


@pytest.fixture(autouse=True, scope="module")
def _module_leaves_no_rendezvous_and_no_engine_behind():
    """What one test module leaves to the next in this process: the rendezvous variables as they were, and no vLLM
    engine or parallel state (:func:`vllm_required.release_vllm_process_state`): left behind, they broke the next
    module's engine ("Process group ... is not initialized in the world group map"), depending on which modules a
    worker happened to run before."""
    saved = {name: os.environ.get(name) for name in sorted(DISTRIBUTED)}
    yield
    if "vllm" in sys.modules:
        release_vllm_process_state()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of a saved tiny Llama + tokenizer (session-wide: built once)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory):
    """Path of a saved tiny Gemma-2 (final-logit softcap 5.0) + tokenizer."""
    path = tmp_path_factory.mktemp("tiny-gemma2")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, arch="gemma2", head_scale=20.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def pytest_collection_modifyitems(config, items):
    # transformers 5.23 warns on every TrainingArguments about trl's `gradient_checkpointing` default: not ours.
    for item in items:
        if item.path.is_relative_to(TRL_TESTS):
            item.add_marker(pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"))


def pytest_collection_finish(session):
    """Freeze what the imports made (torch, trl, transformers, vLLM and every test module: millions of objects) out of
    the garbage collector's reach. accelerate ends every ``Trainer.train`` with a full ``gc.collect()``
    (``free_memory``), which otherwise walks them all: 0.45 s a training, 12.4 of the 13.8 s of
    ``test_conformance.py::test_loss_types`` (cProfile). Objects the tests create are collected as before."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def no_full_collection_at_the_end_of_each_training():
    """Without an accelerator, accelerate's ``release_memory`` (``Trainer.train``'s last step) has no device cache
    to empty, only its full ``gc.collect()``: 0.4-1 s a training in a worker that has run hundreds of tests, for the
    suite's hundreds of trainings. The tests skip that collection (Python's own collector still runs, and a test
    that needs one calls ``gc.collect()`` itself); with an accelerator, accelerate's function is left as it is."""
    if torch.cuda.is_available() or importlib.util.find_spec("accelerate") is None:  # (the core suite runs without it)
        yield
        return
    from accelerate.utils import memory

    clear_device_cache = memory.clear_device_cache
    memory.clear_device_cache = lambda garbage_collection=False: clear_device_cache(False)
    yield
    memory.clear_device_cache = clear_device_cache


@pytest.fixture(scope="session", autouse=True)
def eager_vllm_engines():
    """The colocated engines trl builds in the tests run eagerly (``enforce_eager=True`` unless a test passes it):
    vLLM's graph compilation makes the same model's code faster, and costs more than it saves on a tiny model and a few
    steps (test_vllm_engine.py: 60 CPU-seconds with a cold compile cache, 41 warm, 28 eager). The compiled engine that
    trl builds by default is what the slow tier's command test runs (``test_the_colocate_command_ends_without_a_
    traceback``, in a process of its own) and docs/vllm.md's example."""
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("trl") is None:
        yield
        return
    import trl.generation.vllm_generation as vllm_generation

    build = vllm_generation.LLM
    vllm_generation.LLM = lambda *args, **kwargs: build(*args, **{"enforce_eager": True, **kwargs})
    yield
    vllm_generation.LLM = build
