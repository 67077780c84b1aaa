"""``safevocab diagnose``: measure a model's training–inference mismatch and check it against the exact bound.

The command line of the mismatch lab (:mod:`trl_integration.lab`): it reads the inputs (``--input FILE``, one text
per line, and/or ``--prompts TEXT ...``; by default problems of the bundled arithmetic task with their answers),
loads the model (default: the bundled tiny model) in float32, runs :func:`~trl_integration.lab.run_diagnose` and
writes ``summary.json`` and two PNG figures into ``--output_dir``. See ``docs/mismatch.md``.

Examples::

    safevocab diagnose --compare float32:bfloat16 --output_dir diag-bf16
    safevocab diagnose --model ./my-model --input texts.txt --noise 0.05 --noise_kind uniform --rule min_p=0.01
    safevocab diagnose --prompts "Once upon a time" --max_new_tokens 64 --num_samples 8
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from safevocab.mismatch import DEFAULT_BUCKETS
from safevocab.rules import parse_rule
from trl_integration.commands.errors import fail
from trl_integration.config import DEFAULT_RULE
from trl_integration.rollout import NOISE_KINDS

__all__ = ["make_parser", "main", "run_parsed"]

PROG = "safevocab diagnose"


def make_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The ``safevocab diagnose`` argument parser."""
    d = argparse.ArgumentParser(
        prog=prog,
        description="Measure a model's training-inference mismatch (two precisions, or injected logit noise "
        "with a hard bound) by teacher forcing, check every token against the bound "
        "log(p + (1 - p) e^(2 eps)), and write summary.json and PNG plots. See docs/mismatch.md.",
    )
    d.add_argument("--model", default=None,
                   help="local model folder (save_pretrained); default: the bundled tiny arithmetic model")
    d.add_argument("--input", default=None, help="text file, one text (or prompt) per line")
    d.add_argument("--prompts", nargs="+", default=None, metavar="TEXT",
                   help="texts (or prompts) on the command line; default without --input: arithmetic problems "
                        "with their answers")
    d.add_argument("--compare", default=None, metavar="TRAIN:ROLLOUT",
                   help="precisions of the two sides, each one of float32, bfloat16, float16, float64 (or fp32, "
                        "bf16, fp16, fp64); default float32:bfloat16, or float32:float32 with --noise")
    d.add_argument("--noise", type=float, default=0.0, metavar="EPS",
                   help="hard bound of an injected logit perturbation |delta| <= EPS on the rollout side "
                        "(default: %(default)s)")
    d.add_argument("--noise_kind", choices=NOISE_KINDS, default="uniform",
                   help="distribution of the injected noise (default: %(default)s)")
    d.add_argument("--seed", type=int, default=0, help="seed of the noise and of the sampling (default: %(default)s)")
    d.add_argument("--eps", type=float, default=None,
                   help="reference eps of frac_within_bound; default: --noise when it is the only mismatch, "
                        "else the measured eps_max")
    d.add_argument("--rule", default=DEFAULT_RULE,
                   help="safe-vocabulary rule to analyse, 'none' to skip (default: %(default)s)")
    d.add_argument("--temperature", type=float, default=1.0,
                   help="temperature dividing the logits on both sides (default: %(default)s)")
    d.add_argument("--buckets", type=float, nargs="+", default=list(DEFAULT_BUCKETS), metavar="EDGE",
                   help="inner edges of the probability buckets, increasing in (0, 1) (default: %(default)s)")
    d.add_argument("--max_new_tokens", type=int, default=0,
                   help="> 0: treat the inputs as prompts and score this many sampled tokens per continuation "
                        "(default: %(default)s)")
    d.add_argument("--num_samples", type=int, default=1,
                   help="continuations per prompt with --max_new_tokens (default: %(default)s)")
    d.add_argument("--batch_size", type=int, default=16, help="texts per forward pass (default: %(default)s)")
    d.add_argument("--max_length", type=int, default=512,
                   help="truncate texts to this many tokens (default: %(default)s)")
    d.add_argument("--device", default=None, help="torch device; default: cuda when available, else cpu")
    d.add_argument("--output_dir", default="safevocab-diagnose",
                   help="where summary.json and the plots go (default: %(default)s)")
    d.add_argument("--no_plots", action="store_true", help="write summary.json only")
    d.add_argument("--quiet", action="store_true", help="no progress bar and no printed summary")
    return d


def _read_inputs(args: argparse.Namespace) -> list[str]:
    from trl_integration.lab.inputs import default_texts

    texts: list[str] = []
    if args.input:
        path = Path(args.input)
        if not path.is_file():
            raise ValueError(f"--input {args.input!r}: no such file")
        texts += [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts += list(args.prompts or [])
    if not texts:
        if args.input:
            raise ValueError(f"--input {args.input!r} has no non-empty line")
        texts = default_texts()
    return texts


def _resolve_model(model: str | None) -> str:
    if model:
        if not Path(model).exists():
            raise ValueError(
                f"--model {model!r}: no such directory (pass a local folder saved with save_pretrained; "
                "diagnose does not download)"
            )
        return str(model)
    from trl_integration.demo.model import tiny_model_path

    try:
        return str(tiny_model_path())
    except FileNotFoundError as err:
        raise ValueError(f"no --model given and the bundled tiny model is not available ({err}): pass --model PATH")


def run_parsed(args: argparse.Namespace, prog: str = PROG) -> int:
    """Run the command on parsed flags; returns the exit status (2 with a one-line message on a bad value)."""
    import torch

    from trl_integration.lab import parse_compare, print_summary, run_diagnose, write_outputs

    try:
        compare = parse_compare(args.compare or ("float32:float32" if args.noise > 0 else "float32:bfloat16"))
        if args.noise < 0 or not math.isfinite(args.noise):
            raise ValueError(f"--noise {args.noise!r} is out of range: accepted a finite float >= 0")
        if args.max_new_tokens < 0 or args.num_samples < 1 or args.batch_size < 1 or args.max_length < 2:
            raise ValueError("--max_new_tokens must be >= 0, --num_samples and --batch_size >= 1, --max_length >= 2")
        rule = parse_rule(args.rule)
        model_path = _resolve_model(args.model)
        texts = _read_inputs(args)
    except ValueError as err:
        return fail(prog, str(err))

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if args.quiet:
        hf_logging.disable_progress_bar()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    try:
        result = run_diagnose(
            model,
            tokenizer,
            texts,
            compare=compare,
            noise=args.noise,
            noise_kind=args.noise_kind,
            seed=args.seed,
            temperature=args.temperature,
            rule=str(rule),
            buckets=args.buckets,
            eps=args.eps,
            batch_size=args.batch_size,
            max_length=args.max_length,
            max_new_tokens=args.max_new_tokens,
            num_samples=args.num_samples,
            progress=not args.quiet,
        )
    except ValueError as err:
        return fail(prog, str(err))
    result.summary["model"] = model_path
    files = write_outputs(result, args.output_dir, plots=not args.no_plots)
    if not args.quiet:
        print_summary(result.summary, files)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``safevocab diagnose ARGS`` (``argv``: the arguments after ``diagnose``; default ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_parsed(make_parser().parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
