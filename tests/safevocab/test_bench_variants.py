"""``safevocab.bench.variants``: the variants' inputs are built once per process, each variant with its own leaves."""

import torch

from safevocab.bench.cli import make_parser
from safevocab.bench.variants import shared_inputs


def _bench_args(**overrides):
    return make_parser().parse_args(
        ["--device", "cpu", "--n", "64", "--h", "16", "--v", "300", *[f"--{k}={v}" for k, v in overrides.items()]]
    )


def test_inputs_are_built_once_per_process_and_each_variant_gets_its_own_leaves():
    # On an H200 the GPU preset's setup took ~55 s per variant (CPU draws, rebuilt per variant) for a 0.06 s step:
    # the per-rule time limit ran out before any figure. One set of inputs, fresh leaves (own .grad) per variant.
    args = _bench_args()
    first, second = shared_inputs(args, torch.device("cpu")), shared_inputs(args, torch.device("cpu"))
    for a, b in zip(first, second):
        assert a.data_ptr() == b.data_ptr()  # the same storage: built once
    first[1].sum().backward()
    assert first[1].grad is not None and second[1].grad is None  # own gradients: peak memory still counts them
    other = shared_inputs(_bench_args(rule="top_k=3"), torch.device("cpu"))
    assert other[0].data_ptr() != first[0].data_ptr()
