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


def test_byte_flags_refuse_what_the_fused_op_would_refuse_in_one_line(capsys):
    """A negative ``--keep-logits-bytes`` or a zero ``--max-chunk-bytes`` ran until the fused variant raised: a
    42-line traceback after "measuring"; now argparse's one line, before anything runs."""
    import pytest

    for flag, value, says in (
        ("keep-logits-bytes", "-1", "accepted an integer >= 0"),
        ("max-chunk-bytes", "0", "accepted an integer >= 1"),
        ("keep-logits-bytes", "1.5", "'1.5' is not an integer"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            _bench_args(**{flag: value})
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("python -m safevocab.bench: error: argument --" + flag) and says in err, err
    assert _bench_args(**{"keep-logits-bytes": "0"}).keep_logits_bytes == 0
