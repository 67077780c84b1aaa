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


def test_the_recompute_floor_runs_one_forward_gemm_more_than_the_floor():
    """``recompute_floor`` is the limit of a head that recomputes its logits (four GEMMs); ``floor`` that of one
    that keeps them (three). Counted in FLOPs, not timed: ``2 N H V`` per GEMM."""
    from torch.utils.flop_counter import FlopCounterMode

    from safevocab.bench.variants import make_step

    args = _bench_args()
    gemm = 2 * args.n * args.h * args.v
    for variant, gemms in (("floor", 3), ("recompute_floor", 4)):
        step = make_step(variant, args, torch.device("cpu"))
        with FlopCounterMode(display=False) as counter:
            step()
        assert counter.get_total_flops() == gemms * gemm, variant


def test_the_matrix_shows_the_recompute_floor_column_only_when_measured():
    from safevocab.bench.matrix import format_matrix

    args = _bench_args(rules="none;top_k=5", threads="1")
    row = {"seconds": 2.0, "peak_bytes": 2**20}
    res = {"floor": {"seconds": 1.0, "peak_bytes": 0}, "fused[none]": row, "fused[top_k=5]": {**row, "seconds": 0.5}}
    plain = format_matrix(args, {"1": res}, (0.0, 0.0, 0.0))
    assert "recompute_floor" not in plain and "| `none` | 2.000 | 2.00 | n/a | 1 |" in plain
    res["recompute_floor"] = {"seconds": 1.25, "peak_bytes": 0}
    table = format_matrix(args, {"1": res}, (0.0, 0.0, 0.0))
    assert "floor 1.000 s, recompute_floor 1.250 s" in table
    assert "| rule | fused fwd+bwd (s) | fused / floor | fused / recompute_floor | fused / trl |" in table
    assert (
        "| `none` | 2.000 | 2.00 | 1.60 | n/a | 1 |" in table
        and "| `top_k=5` | 0.500 | 0.50 | 0.40 | n/a | 1 |" in table
    )
    assert all(line.count("|") == 7 for line in table.splitlines() if line.startswith("|"))


def test_a_misspelt_variant_is_refused_in_the_matrix_too():
    """The rules matrix reads ``--variants`` for ``trl`` and ``recompute_floor``: a misspelt name (or one with a space
    after its comma) was dropped there without a word, leaving the column out."""
    import pytest

    from safevocab.bench.cli import parse_args
    from safevocab.bench.run import run

    for mode in ([], ["--rules", "none", "--threads", "1"]):
        with pytest.raises(SystemExit, match=r"^--variants: unknown \['recompute-floor'\]; accepted floor,"):
            run(["--device", "cpu", *mode, "--variants", "floor,recompute-floor,fused"])
    assert (
        parse_args(["--variants", "floor, recompute_floor ,fused"], "bench").variants == "floor,recompute_floor,fused"
    )
