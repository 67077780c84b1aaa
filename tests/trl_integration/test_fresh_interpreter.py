"""The checks that need a fresh interpreter, in one (issue 53: each fresh Python that imports trl costs ~8 CPU-seconds).

Each check needs a process no test has touched: what ``import trl_integration`` changes process-wide (issue 39),
trl's vLLM-range notice and the entry points' filters (issue 31), the experimental packages' once-per-process
warning, and accelerate's mixed-precision wrapper (its state is process-wide and the test session already has one).
One script runs them in the order in which none disturbs the next (four interpreters did before), and prints a
marker line between them on stderr; each test reads its own section:

1. ``import trl_integration`` changes no process-wide setting (the first thing the process does);
2. trl's "supports vLLM versions from 0.22.0 to 0.31.0" notice, which from Python printed four times without vLLM in
   use, is fenced: trl imports with the notice ignored for that import only; no filter of ours stays behind, and a
   later identical warning of the caller's own still shows (only with the pinned vLLM installed);
3. the stable faces and the commands import without an experimental warning; the entry points' filters hide the
   known notices (vLLM's Triton notice, logged at the trainer's import before the filters, is logged again by
   reloading its module) and show the user's and other libraries' warnings;
4. each experimental package warns once (imported with its ``report`` module, reloaded: still once), with the
   once-per-process record cleared and the variable the commands set for their own process removed; with the
   variable set and the record cleared again, re-importing them gives none;
5. accelerate's ``prepare_model`` under mixed precision keeps the forward it wrapped (``rollout_precision`` unwraps
   it).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from trl_helpers import user_env

import trl_integration
from trl_integration.experimental import SILENCE_VARIABLE

ROOT = pathlib.Path(trl_integration.__file__).resolve().parents[1]
PACKAGES = ("trl_integration.lab", "trl_integration.study")

SETTINGS = """
import json, logging, sys, warnings
import torch
def settings():
    return (list(warnings.filters), torch.get_num_threads(), torch.get_num_interop_threads(),
            torch.get_default_dtype(), list(logging.getLogger("vllm.triton_utils.importing").filters))
before = settings()
import trl_integration
after = settings()
print(json.dumps({"settings_changed": [i for i, (a, b) in enumerate(zip(before, after)) if a != b]}), flush=True)
import trl_integration.grpo.trainer
"""

NOTICE_FENCE = """
import trl.generation.vllm_client, trl.generation.vllm_generation  # trl checks the vLLM version in each
print(json.dumps({"our_filter_left": [f[1].pattern for f in warnings.filters if f[1] is not None
                                      and 'TRL currently' in f[1].pattern]}), flush=True)
warnings.warn('TRL currently supports vLLM versions (the caller)', UserWarning)
"""

STABLE_FACES = """
print("-- the entry points --", file=sys.stderr)
import contextlib, importlib, io, os
import trl_integration.harness
from trl_integration.commands import main  # the entry points' package: installs the filters
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main(['study', '--help'])
"""

NOTICE_FILTERS = """
import torch.distributed
import vllm.triton_utils.importing
importlib.reload(vllm.triton_utils.importing)  # logs the Triton notice on CPU
list(torch.utils.data.DataLoader(list(range(4)), pin_memory=True))
torch.distributed.reduce_op.SUM
warnings.warn("the user's own warning")
warnings.warn("another library's notice", FutureWarning)
"""

REIMPORT = "; ".join(
    f"importlib.reload(importlib.import_module({p!r})); importlib.import_module({p + '.report'!r}); "
    f"importlib.reload(importlib.import_module({p!r}))"
    for p in PACKAGES
)
EXPERIMENTAL = f"""
import trl_integration.experimental as experimental
print('-- the packages --', file=sys.stderr)
experimental._warned.clear()
os.environ.pop({SILENCE_VARIABLE!r}, None)
{REIMPORT}
print('-- silenced --', file=sys.stderr)
experimental._warned.clear()
os.environ[{SILENCE_VARIABLE!r}] = '1'
{REIMPORT}
print('-- accelerate --', file=sys.stderr)
"""

ACCELERATE = """
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM
from trl_integration._private import mixed_precision_forward
config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)
model = LlamaForCausalLM(config)
before = mixed_precision_forward(model)
model = Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)
original = mixed_precision_forward(model)
print(json.dumps({"accelerate": [before is None, original is not None and original is not model.forward]}))
"""


def pinned_vllm() -> str | None:
    """Why the notice checks cannot run here, or ``None`` when they can (trl's vLLM-range warning is kept for another
    vLLM than the pinned one)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed"
    from trl_integration.notices import PINNED_VLLM, _installed_vllm

    if _installed_vllm() != PINNED_VLLM:
        return f"trl's vLLM-range warning is kept for vLLM {_installed_vllm()} (pinned: {PINNED_VLLM})"
    return None


@pytest.fixture(scope="module")
def fresh():
    """The script's ``(stdout values, stderr sections)``: one fresh interpreter for the module."""
    notices = pinned_vllm() is None
    script = SETTINGS + (NOTICE_FENCE if notices else "") + STABLE_FACES
    script += (NOTICE_FILTERS if notices else "") + EXPERIMENTAL + ACCELERATE
    env = {k: v for k, v in user_env().items() if k != SILENCE_VARIABLE}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    values = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            values.update(json.loads(line))
    fenced, rest = done.stderr.split("-- the entry points --")
    entry_points, rest = rest.split("-- the packages --")
    warned, rest = rest.split("-- silenced --")
    silenced, accelerate = rest.split("-- accelerate --")
    sections = dict(fenced=fenced, entry_points=entry_points, warned=warned, silenced=silenced, accelerate=accelerate)
    return values, sections, done.stderr


def test_import_changes_no_process_wide_setting(fresh):
    """``import trl_integration`` leaves the warning filters, torch's thread counts and default dtype and vLLM's logger
    filters as they were: only the entry points install the notice filters."""
    values, _, stderr = fresh
    assert values["settings_changed"] == [], stderr[-3000:]


def test_trls_notice_is_fenced_then_known_notices_are_filtered_and_others_shown(fresh):
    reason = pinned_vllm()
    if reason is not None:
        pytest.skip(reason)
    values, sections, stderr = fresh
    assert values["our_filter_left"] == []
    assert stderr.count("TRL currently supports vLLM versions") == 1 and "(the caller)" in sections["fenced"]
    for notice in ("doesn't include CPU backend", "pin_memory", "reduce_op"):
        assert notice not in sections["entry_points"], stderr
    assert "the user's own warning" in sections["entry_points"]
    assert "another library's notice" in sections["entry_points"]


def test_the_stable_faces_do_not_warn_each_package_warns_once_and_the_variable_silences_them(fresh):
    _, sections, stderr = fresh
    stable = sections["fenced"] + sections["entry_points"]
    assert "is experimental" not in stable and sections["warned"], stderr
    for package in PACKAGES:
        assert sections["warned"].count(f"{package} is experimental") == 1, sections["warned"]
    assert sections["warned"].count("ExperimentalWarning") == len(PACKAGES) and SILENCE_VARIABLE in sections["warned"]
    assert "is experimental" not in sections["silenced"], sections["silenced"]


def test_accelerate_keeps_the_unwrapped_forward_under_mixed_precision(fresh):
    """accelerate's prepare_model under mixed precision keeps the forward it wrapped (rollout_precision unwraps it);
    an unprepared model has none."""
    values, _, stderr = fresh
    assert values["accelerate"] == [True, True], stderr[-3000:]
