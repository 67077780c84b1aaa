"""Fuzz: fused gradients of targets outside the safe set that receive a gradient (torch backend; the Triton
backend runs the same cases in ``test_kernels.py``).

The other fuzzers mostly mask out-of-set rows (or draw exact inputs, on which every GEMM layout agrees). Here the
loss is unmasked, inputs are mostly continuous with raw logits up to ~10^3 and the sparse backward is forced, so
the rows of out-of-set targets go through the full-softmax part; see ``out_of_set_cases.py`` for the cases, the
softmax bound and the three checks (within the bound; equal to the materialised path on the same logits; equal
to the float64 reference within the fp32 rounding of the logits).

Cases per temperature: ``SAFEVOCAB_OUT_OF_SET_CASES`` (default 200); the ``slow`` variants run 2,000.
"""

from __future__ import annotations

import os

import pytest
import torch
from out_of_set_cases import run_cases

CASES = int(os.environ.get("SAFEVOCAB_OUT_OF_SET_CASES", "200"))
TEMPERATURES = (1e-2, 1e-3, 1e-6)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread (a second one only waits for the scheduler on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_out_of_set_gradients_match_the_materialised_path_and_reference(temperature):
    run_cases("torch", temperature, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_out_of_set_gradients_match_the_materialised_path_and_reference_2k(temperature):
    run_cases("torch", temperature, 2000, first_seed=10**6)
