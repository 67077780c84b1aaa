"""The benchmark's flags: :func:`make_parser` (also ``safevocab bench``'s), the ``--preset`` values, and
:func:`parse_args`, which applies a preset under the explicit flags and the device's default variants."""

from __future__ import annotations

import argparse

import torch

from safevocab.bench.inputs import PROFILES
from safevocab.bench.variants import DEFAULT_VARIANTS, DTYPES, VARIANTS
from safevocab.logprobs import DEFAULT_MAX_CHUNK_BYTES

__all__ = ["DESCRIPTION", "PRESETS", "make_parser", "parse_args"]

#: The first line of ``--help`` (the first sentence of :mod:`safevocab.bench`'s docstring).
DESCRIPTION = "Benchmark of ``fused_safe_logprobs`` against the matmul floor, a naive masked log-softmax and trl."
#: ``--preset`` values: defaults for the size flags (explicit flags override them).
PRESETS = {
    # naive left out: its materialised fp32 [N, V] logits and temporaries alone exceed 40 GB at this size
    "gpu": {
        "device": "cuda",
        "n": 16384,
        "h": 4096,
        "v": 151936,
        "dtype": "bfloat16",
        "max_chunk_bytes": 2**30,
        "variants": "floor,fused,fused_torch,trl,liger",
    },
}


def _integer_at_least(low: int):
    """An argparse type: an integer ``>= low``, else argparse's one-line error naming the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is out of range: accepted an integer >= {low}")
        return value

    return parse


def make_parser(prog: str = "python -m safevocab.bench") -> argparse.ArgumentParser:
    """The benchmark's argument parser (also ``safevocab bench``'s)."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    p.add_argument("--n", type=int, default=4096, help="tokens (rows), default 4096")
    p.add_argument("--h", type=int, default=512, help="hidden size, default 512")
    p.add_argument("--v", type=int, default=32000, help="vocabulary size, default 32000")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--rule", default="min_p=0.001", help="safe-vocabulary rule, default min_p=0.001")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repeats after the memory run (best is kept), default 3"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--max-chunk-bytes",
        type=_integer_at_least(1),
        default=DEFAULT_MAX_CHUNK_BYTES,
        help="fused chunk budget in bytes (default: the library default)",
    )
    p.add_argument(
        "--keep-logits-bytes",
        type=_integer_at_least(0),
        default=0,
        help="fused: bytes of chunk logits the forward keeps for the backward instead of recomputing them "
        "(fused_safe_logprobs' keep_logits_bytes), default 0: recompute",
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma list of {','.join(VARIANTS)}; default {','.join(DEFAULT_VARIANTS['cpu'])} "
        f"on CPU, {','.join(DEFAULT_VARIANTS['cuda'])} on CUDA. With --rules/--threads the floor and fused always "
        "run, and of the others only trl and recompute_floor are read",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="backend of the `fused` variant (default auto: Triton on CUDA, torch on CPU)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="gpu: --device cuda --n 16384 --h 4096 --v 151936 --dtype bfloat16 --max-chunk-bytes 2**30 "
        "--variants floor,fused,fused_torch,trl,liger (explicit flags override)",
    )
    p.add_argument(
        "--liger-seq-len",
        type=int,
        default=1024,
        help="sequence length T of the `liger` variant's [N / T, T] batch, default 1024",
    )
    p.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--rules",
        default=None,
        help="several rules in one run, separated by ';' (a rule's parts by ','), e.g. "
        '"none;min_p=0.001;top_k=50,min_p=0.01": the floor, trl and fused under each rule, per thread count (and '
        "the recompute floor when --variants names recompute_floor)",
    )
    p.add_argument(
        "--threads",
        default=None,
        help="comma list of intra-op thread counts, one worker each (e.g. 1,2); with --rules/--busy-cores",
    )
    p.add_argument(
        "--busy-cores",
        type=int,
        default=0,
        help="spinning processes (one busy core each) that run during the measurement, default 0",
    )
    p.add_argument(
        "--replay",
        default=None,
        help="with --rules: also time support replay of this rule's sets (the fused_replay variant)",
    )
    p.add_argument(
        "--logits-profile",
        choices=PROFILES,
        default="synthetic",
        help="synthetic: N(0, 9) logits (flat, kept sets of 1-4 %% of V); lm: a Zipf prior plus a context "
        "term, kept sets of tens to hundreds of tokens (safevocab.bench.inputs); default synthetic",
    )
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_threads", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    """``argv`` parsed: a ``--preset``'s values under the explicit flags, and ``--variants`` defaulted to the
    device's :data:`~safevocab.bench.variants.DEFAULT_VARIANTS` (spaces around its names dropped)."""
    parser = make_parser(prog)
    preset = parser.parse_args(argv).preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])  # explicit flags still override these
    args = parser.parse_args(argv)
    if args.variants is None:
        args.variants = ",".join(DEFAULT_VARIANTS["cuda" if args.device.startswith("cuda") else "cpu"])
    args.variants = ",".join(v.strip() for v in args.variants.split(",") if v.strip())  # "floor, trl" too
    return args
