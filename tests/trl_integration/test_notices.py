"""Issue 31: the third-party notices that are wrong for this install (trl's vLLM range, Triton's missing CPU backend,
torch's pin_memory without an accelerator, vLLM's use of ``torch.distributed.reduce_op``) are not shown, while the
user's own warnings and the libraries' other warnings still are (``trl_integration.notices``), where the command-line
entry points install the filters; ``import trl_integration`` itself changes no process-wide setting (issue 39)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# One fresh interpreter (each imports trl's whole stack, ~8 CPU-seconds) checks two things in order:
# 1. (issue 53) from Python, trl's "supports vLLM versions from 0.22.0 to 0.31.0" notice printed four times without
#    vLLM in use. The fence imports trl with the notice ignored for that import only: no filter of ours stays behind,
#    and a later identical warning of the caller's own still shows;
# 2. then the entry points' filters (after a marker line): the other notices are hidden, the user's and other
#    libraries' warnings shown. vLLM logged its Triton notice at the trainer's import, before the filters (from Python
#    nothing filters it): its module is reloaded after the marker to log it again.
SCRIPT = """
import importlib, sys, warnings
import trl_integration.grpo.trainer
import trl.generation.vllm_client, trl.generation.vllm_generation  # trl checks the vLLM version in each
assert not [f for f in warnings.filters if f[1] is not None and 'TRL currently' in f[1].pattern]
warnings.warn('TRL currently supports vLLM versions (the caller)', UserWarning)
print("-- the entry points --", file=sys.stderr)
import trl_integration.commands  # the entry points' package: installs the filters
import torch
import torch.distributed
import vllm.triton_utils.importing
importlib.reload(vllm.triton_utils.importing)  # logs the Triton notice on CPU
list(torch.utils.data.DataLoader(list(range(4)), pin_memory=True))
torch.distributed.reduce_op.SUM
warnings.warn("the user's own warning")
warnings.warn("another library's notice", FutureWarning)
"""


def test_trls_notice_is_fenced_then_known_notices_are_filtered_and_others_shown():
    pytest.importorskip("vllm")
    from trl_integration.notices import PINNED_VLLM, _installed_vllm

    if _installed_vllm() != PINNED_VLLM:
        pytest.skip(f"trl's vLLM-range warning is kept for vLLM {_installed_vllm()} (pinned: {PINNED_VLLM})")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fenced, entry_points = proc.stderr.split("-- the entry points --")
    assert proc.stderr.count("TRL currently supports vLLM versions") == 1 and "(the caller)" in fenced
    for notice in ("doesn't include CPU backend", "pin_memory", "reduce_op"):
        assert notice not in entry_points, proc.stderr
    assert "the user's own warning" in entry_points and "another library's notice" in entry_points


IMPORT_SCRIPT = """
import logging, warnings
import torch
def settings():
    return (list(warnings.filters), torch.get_num_threads(), torch.get_num_interop_threads(),
            torch.get_default_dtype(), list(logging.getLogger("vllm.triton_utils.importing").filters))
before = settings()
import trl_integration
after = settings()
assert after == before, f"import trl_integration changed {[i for i, (a, b) in enumerate(zip(before, after)) if a != b]}"
"""


def test_import_changes_no_process_wide_setting():
    """``import trl_integration`` leaves the warning filters, torch's thread counts and default dtype
    and vLLM's logger filters as they were: only the entry points install the notice filters."""
    proc = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
