"""``safevocab bench``: the benchmark of ``fused_safe_logprobs`` (:mod:`safevocab.bench`) as a subcommand.

The same flags and output as ``python -m safevocab.bench``; it needs torch only (trl is timed when installed).

Examples::

    safevocab bench                                   # CPU defaults: N=4096, H=512, V=32000
    safevocab bench --preset gpu --json bench.json    # the GPU size, results also as JSON
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["make_parser", "main"]

PROG = "safevocab bench"


def make_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The benchmark's argument parser (:func:`safevocab.bench.make_parser`) under ``prog``."""
    from safevocab.bench import make_parser as bench_parser

    return bench_parser(prog=prog)


def main(argv: Sequence[str] | None = None) -> int:
    """``safevocab bench ARGS`` (``argv``: the arguments after ``bench``; default ``sys.argv[1:]``): the progress
    lines on stderr, the report on stdout. Returns 0."""
    from safevocab.bench import run, show_progress

    show_progress()
    print(run(list(sys.argv[1:] if argv is None else argv), prog=PROG), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
