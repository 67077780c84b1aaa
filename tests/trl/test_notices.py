"""Issue 31: the third-party notices that are wrong for this install (trl's vLLM range, Triton's missing CPU backend,
torch's pin_memory without an accelerator, vLLM's use of ``torch.distributed.reduce_op``) are not shown, while the
user's own warnings and the libraries' other warnings still are (``trl_integration.notices``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import warnings
import trl_integration  # installs the filters, as every entry point does
import torch
import torch.distributed
import trl.generation.vllm_client, trl.generation.vllm_generation  # trl checks the vLLM version in each
try:
    import vllm.triton_utils  # logs the Triton notice on CPU
except ImportError:
    pass
list(torch.utils.data.DataLoader(list(range(4)), pin_memory=True))
torch.distributed.reduce_op.SUM
warnings.warn("the user's own warning")
warnings.warn("another library's notice", FutureWarning)
"""


def test_known_notices_are_filtered_and_others_shown():
    pytest.importorskip("vllm")
    from trl_integration.notices import PINNED_VLLM, _installed_vllm

    if _installed_vllm() != PINNED_VLLM:
        pytest.skip(f"trl's vLLM-range warning is kept for vLLM {_installed_vllm()} (pinned: {PINNED_VLLM})")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for notice in ("TRL currently supports vLLM", "doesn't include CPU backend", "pin_memory", "reduce_op"):
        assert notice not in proc.stderr, proc.stderr
    assert "the user's own warning" in proc.stderr and "another library's notice" in proc.stderr
