"""Fuzz: fused gradients of targets outside the safe set that receive a gradient, and fp16 gradients at
``1 / T > 65504`` (torch backend; the Triton backend runs the same cases in ``test_kernels.py``).

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
from out_of_set_cases import check_fp16_case, fp16_near_tie_case, run_cases

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


def fp16_cases(backend: str, temperature: float, count: int) -> None:
    """``count`` near-tie fp16 cases: finite and close wherever the true gradients fit fp16; most of them must
    have a logits gradient beyond 65504 (the ones that gave NaN/inf before)."""
    outcomes = [check_fp16_case(fp16_near_tie_case(seed, temperature), backend) for seed in range(count)]
    overflowing = sum(o is True for o in outcomes)
    compared = sum(o is not None for o in outcomes)
    print(
        f"{backend} fp16 T={temperature:g}: {compared} of {count} compared, {overflowing} with a logits gradient > 65504"
    )
    assert overflowing >= 0.3 * count, f"only {overflowing} of {count} cases exercise a logits gradient beyond fp16"


@pytest.mark.parametrize("temperature", [1e-5, 1e-6])
def test_fp16_gradients_are_finite_wherever_the_true_ones_fit(temperature):
    fp16_cases("torch", temperature, CASES)
