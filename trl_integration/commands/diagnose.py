"""``safevocab diagnose``: measure a model's training–inference mismatch and check it against the exact bound.

The command line of the mismatch lab (:mod:`trl_integration.lab`): it loads the model (``--model``, default the
task's: the bundled tiny model for ``--task arithmetic``) in float32 and writes into ``--output_dir``:

1. the **tail diagnostic** (:func:`~trl_integration.lab.tail_mismatch`), its first output: continuations *sampled*
   from the rollout side (``--tail_samples`` per prompt, ``--tail_new_tokens`` long) for the task's held-out prompts
   (``--tail_prompts`` of them) and for free text (the lines of ``--input``, else standard-library prose), and per
   bucket of training probability the signed mean ``log mu - log pi`` of the sampled tokens: ``summary.json``'s
   ``"tail"``, the figure ``tail_mismatch.png``, and the first rows of the printed summary (``--no_tail`` skips it);
2. the **teacher-forced comparison** (:func:`~trl_integration.lab.run_diagnose`) of the inputs (``--input FILE``, one
   text per line, and/or ``--prompts TEXT ...``; by default problems of the bundled arithmetic task with their
   answers) against the exact bound: the rest of ``summary.json`` and two more PNG figures;
3. the **batch-shape control** (:func:`~trl_integration.lab.batch_shape.batch_shape_control`; ``--no_batch_shape``
   skips it): the training side scores the same tokens again, each sequence alone (micro-batch 1) against all of
   them in one padded batch, and that batch against one packed row where the model isolates packed sequences, with
   the comparison's metrics per pair (k3, the shares of ratios outside ``[0.9, 1.1]`` and ``[0.8, 1.25]``, the
   per-bucket gaps and their shares below the rule's cut): ``summary.json``'s ``"batch_shape"``, the figure
   ``batch_shape.png`` and the last rows of the printed summary. The part of the engine mismatch the trainer shows
   against itself.
4. the **precision arms** (:func:`~trl_integration.lab.precision_arms.run_precision_arms`; ``--precision_arms ARM
   ...``, off by default): the training side scores the same tokens in bf16, fp16, fp32 and bf16 with an fp32 LM head
   (trl's ``cast_lm_head_to_fp32``), each against the rollout side and against itself (the batch-shape control's
   pairs), with its scoring seconds: ``summary.json``'s ``"precision_arms"``, the figure ``precision_arms.png`` and a
   printed row per arm. The cost of each precision beside its benefit.

The rollout side differs from the training side by any of: its dtype (``--compare``), its weights rounded to
``--rollout_mantissa_bits`` mantissa bits, an injected perturbation ``--noise EPS`` of kind ``--noise_kind``
(``uniform``, ``clipped_gaussian``, the biased ``lift``, or the ``tail``: ``EPS`` on exactly the tokens ``--rule``
cuts). See ``docs/mismatch.md``.

Examples::

    safevocab diagnose --compare float32:bfloat16 --output_dir diag-bf16
    safevocab diagnose --noise 1 --noise_kind lift --output_dir diag-lift
    safevocab diagnose --task freetext --noise 1 --noise_kind tail --rule min_p=0.01 --max_new_tokens 32
    safevocab diagnose --rollout_mantissa_bits 3 --output_dir diag-3bits
    safevocab diagnose --compare bf16:bf16 --precision_arms all --output_dir diag-arms
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
from safevocab.rules import NoPruning, parse_rule
from trl_integration.commands.errors import fail
from trl_integration.grpo.config import DEFAULT_RULE
from trl_integration.options import NOISE_KINDS

__all__ = ["make_parser", "main", "run_parsed"]

PROG = "safevocab diagnose"


def make_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The ``safevocab diagnose`` argument parser."""
    d = argparse.ArgumentParser(
        prog=prog,
        description="Measure a model's training-inference mismatch (two precisions, weights rounded to k mantissa "
        "bits, or an injected logit perturbation with a hard bound): first the tail diagnostic, the signed mismatch "
        "log mu - log pi per probability bucket on sampled tokens (task prompts and free text), then a "
        "teacher-forced check of every token against the bound log(p + (1 - p) e^(2 eps)); writes summary.json "
        "and PNG plots. See docs/mismatch.md.",
    )
    d.add_argument(
        "--model",
        default=None,
        help="local model folder (save_pretrained) or smollm2-135m (a real pretrained LM, "
        "docs/real_model.md); default: the task's (arithmetic: the bundled tiny model)",
    )
    d.add_argument(
        "--task",
        default="arithmetic",
        metavar="SPEC",
        help="the task whose held-out prompts the tail diagnostic samples from: 'arithmetic', "
        "'freetext' or 'module:function' returning a StudyTask (default: %(default)s)",
    )
    d.add_argument("--input", default=None, help="text file, one text (or prompt) per line")
    d.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="texts (or prompts) on the command line; default without --input: arithmetic problems with their answers",
    )
    d.add_argument(
        "--compare",
        default=None,
        metavar="TRAIN:ROLLOUT",
        help="precisions of the two sides, each one of float32, bfloat16, float16, float64 (or fp32, "
        "bf16, fp16, fp64); default float32:bfloat16, or float32:float32 with --noise or "
        "--rollout_mantissa_bits",
    )
    d.add_argument(
        "--noise",
        type=float,
        default=0.0,
        metavar="EPS",
        help="hard bound of an injected logit perturbation |delta| <= EPS on the rollout side (default: %(default)s)",
    )
    d.add_argument(
        "--noise_kind",
        choices=NOISE_KINDS,
        default="uniform",
        help="uniform, clipped_gaussian, lift (deterministic: EPS*min(1,(z_max-z_i)/10), a heavier "
        "tail) or tail (EPS on exactly the tokens --rule cuts at the rollout's logits, 0 elsewhere) "
        "(default: %(default)s)",
    )
    d.add_argument(
        "--rollout_mantissa_bits",
        type=int,
        default=None,
        metavar="K",
        help="the rollout side's weights rounded to K mantissa bits, 1-23 (7: bfloat16's, 10: "
        "float16's); default: not rounded",
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the noise and of the sampling (default: %(default)s)")
    d.add_argument(
        "--eps",
        type=float,
        default=None,
        help="reference eps of frac_within_bound; default: --noise when it is the only mismatch, "
        "else the measured eps_max",
    )
    d.add_argument(
        "--rule", default=DEFAULT_RULE, help="safe-vocabulary rule to analyse, 'none' to skip (default: %(default)s)"
    )
    d.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="temperature dividing the logits on both sides (default: %(default)s)",
    )
    d.add_argument(
        "--buckets",
        type=float,
        nargs="+",
        default=list(DEFAULT_BUCKETS),
        metavar="EDGE",
        help="inner edges of the probability buckets, increasing in (0, 1) (default: %(default)s)",
    )
    d.add_argument(
        "--max_new_tokens",
        type=int,
        default=0,
        help="> 0: treat the inputs as prompts and score this many sampled tokens per continuation "
        "(default: %(default)s)",
    )
    d.add_argument(
        "--num_samples",
        type=int,
        default=1,
        help="continuations per prompt with --max_new_tokens (default: %(default)s)",
    )
    d.add_argument(
        "--tail_prompts",
        type=int,
        default=64,
        help="tail diagnostic: prompts per source, task and free text (default: %(default)s)",
    )
    d.add_argument(
        "--tail_new_tokens",
        type=int,
        default=16,
        help="tail diagnostic: sampled tokens per continuation (default: %(default)s)",
    )
    d.add_argument(
        "--tail_prompt_tokens",
        type=int,
        default=64,
        help="tail diagnostic: prompts are cut to their first N tokens (default: %(default)s)",
    )
    d.add_argument(
        "--tail_samples", type=int, default=4, help="tail diagnostic: continuations per prompt (default: %(default)s)"
    )
    d.add_argument("--no_tail", action="store_true", help="skip the tail diagnostic")
    d.add_argument(
        "--no_batch_shape",
        action="store_true",
        help="skip the batch-shape control: the training side scores the same tokens again, each sequence alone "
        "(micro-batch 1) vs all N in one padded batch, and padded vs packed into one row (where the model isolates "
        "packed sequences; else skipped with the reason); per pair A vs B, log r = log pi_A - log pi_B: k3 = mean(r - "
        "log r - 1), the shares of r outside [0.9, 1.1] and [0.8, 1.25], mean |log r| per bucket of pi_A, and the "
        "shares of them on tokens outside --rule's set. On by default: three training-side forwards over the scored "
        "tokens, little next to the tail diagnostic's sampling; N: the first sequences that fit in --batch_size x "
        "--max_length padded tokens",
    )
    d.add_argument(
        "--precision_arms",
        nargs="+",
        default=None,
        metavar="ARM",
        help="precision arms (off by default): the training side scores the same tokens again in each ARM of bf16, "
        "fp16, fp32, bf16+fp32_head (bf16 with the LM head as trl's cast_lm_head_to_fp32: linear(h.float(), "
        "W.float())), or all for the four; per arm, log r = log pi_arm - log mu against the rollout side "
        "(vs_rollout) and the batch-shape control's pairs in the arm (vs_itself), each with k3 = mean(r - log r - 1), "
        "the shares of r outside [0.9, 1.1] and [0.8, 1.25], mean |log r| per bucket of pi_arm and the shares below "
        "--rule's cut; seconds = wall time of the arm's scoring forwards (time.perf_counter around each padded batch "
        "of --batch_size, after one untimed warm-up). summary.json's precision_arms, keyed by arm; "
        "precision_arms.png",
    )
    d.add_argument("--batch_size", type=int, default=16, help="texts per forward pass (default: %(default)s)")
    d.add_argument(
        "--max_length", type=int, default=512, help="truncate texts to this many tokens (default: %(default)s)"
    )
    d.add_argument("--device", default=None, help="torch device; default: cuda when available, else cpu")
    d.add_argument(
        "--output_dir", default="safevocab-diagnose", help="where summary.json and the plots go (default: %(default)s)"
    )
    d.add_argument("--no_plots", action="store_true", help="write summary.json only")
    d.add_argument("--quiet", action="store_true", help="no progress bar and no printed summary")
    return d


def _input_lines(args: argparse.Namespace) -> list[str]:
    if not args.input:
        return []
    path = Path(args.input)
    if not path.is_file():
        raise ValueError(f"--input {args.input!r}: no such file")
    lines = [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--input {args.input!r} has no non-empty line")
    return lines


def _read_inputs(args: argparse.Namespace, task) -> list[str]:
    """The teacher-forced texts: ``--input`` and ``--prompts``; by default the arithmetic problems with their answers
    (or, for another task, its held-out prompts)."""
    from trl_integration.lab.inputs import default_texts

    texts = _input_lines(args) + list(args.prompts or [])
    if not texts:
        texts = default_texts() if task.name == "arithmetic" else list(task.held_out_dataset(64)["prompt"])
    return texts


def _tail_sources(args: argparse.Namespace, task) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The tail diagnostic's prompt sources and their labels: the task's held-out prompts, and free text (the lines
    of ``--input``, else standard-library prose)."""
    from trl_integration.lab.inputs import stdlib_texts

    n = args.tail_prompts
    free = _input_lines(args)[:n]
    sources = {"task": list(task.held_out_dataset(n)["prompt"]), "free_text": free or stdlib_texts(n)}
    labels = {
        "task": f"{task.name} prompts",
        "free_text": f"free text ({Path(args.input).name})" if free else "free text (stdlib docstrings)",
    }
    return sources, labels


def _resolve_model(model: str | None) -> str:
    if model:
        from trl_integration.demo.model_alias import resolve_model_alias

        model = resolve_model_alias(model)  # an alias (smollm2-135m) becomes its folder, converted on first use
        if not Path(model).exists():
            from trl_integration.commands.model_names import closest_alias
            from trl_integration.demo.model_alias import MODEL_ALIASES

            guess = closest_alias(model, MODEL_ALIASES)
            raise ValueError(
                f"--model {model!r}: no such directory ({f'did you mean --model {guess}? ' if guess else ''}pass an "
                f"alias ({', '.join(MODEL_ALIASES)}) or a local folder saved with save_pretrained; diagnose does not "
                "download)"
            )
        return str(model)
    from trl_integration.demo.model import tiny_model_path

    try:
        return str(tiny_model_path())
    except FileNotFoundError as err:
        raise ValueError(
            f"no --model given and the bundled tiny model is not available ({err}): pass --model PATH"
        ) from err


def run_parsed(args: argparse.Namespace, prog: str = PROG) -> int:
    """Run the command on parsed flags; returns the exit status (2 with a one-line message on a bad value)."""
    import torch

    from trl_integration.demo.model import is_tiny_model
    from trl_integration.lab import parse_compare, run_diagnose, summary_table, tail_mismatch, write_outputs
    from trl_integration.lab.kept_sets import kept_set_lines, plot_kept_sets
    from trl_integration.lab.precision_arms import parse_precision_arms, run_precision_arms
    from trl_integration.lab.sides import check_mantissa_bits
    from trl_integration.study.tasks import load_task

    try:
        only_injected = args.noise > 0 or args.rollout_mantissa_bits is not None
        compare = parse_compare(args.compare or ("float32:float32" if only_injected else "float32:bfloat16"))
        if args.noise < 0 or not math.isfinite(args.noise):
            raise ValueError(f"--noise {args.noise!r} is out of range: accepted a finite float >= 0")
        if args.max_new_tokens < 0 or args.num_samples < 1 or args.batch_size < 1 or args.max_length < 2:
            raise ValueError("--max_new_tokens must be >= 0, --num_samples and --batch_size >= 1, --max_length >= 2")
        if min(args.tail_prompts, args.tail_new_tokens, args.tail_samples, args.tail_prompt_tokens) < 1:
            raise ValueError("--tail_prompts, --tail_new_tokens, --tail_samples and --tail_prompt_tokens must be >= 1")
        check_mantissa_bits(args.rollout_mantissa_bits, compare[1])
        arms = parse_precision_arms(args.precision_arms)
        rule = parse_rule(args.rule)
        if args.noise > 0 and args.noise_kind == "tail" and isinstance(rule, NoPruning):
            raise ValueError(
                "--noise_kind tail lifts the tokens --rule cuts, and --rule 'none' cuts nothing: "
                "accepted a rule that prunes, e.g. --rule min_p=0.01"
            )
        task = load_task(args.task)
        model_path = _resolve_model(args.model or (None if is_tiny_model(task.model_path) else task.model_path))
        texts = _read_inputs(args, task)
        sources, labels = _tail_sources(args, task) if not args.no_tail else ({}, {})
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
        tail = None
        if not args.no_tail:
            tail = tail_mismatch(
                model, tokenizer, sources, compare=compare, mantissa_bits=args.rollout_mantissa_bits,
                noise=args.noise, noise_kind=args.noise_kind, seed=args.seed, temperature=args.temperature,
                buckets=args.buckets, max_new_tokens=args.tail_new_tokens, num_samples=args.tail_samples,
                batch_size=args.batch_size, max_length=args.tail_prompt_tokens, progress=not args.quiet,
                noise_rule=rule if args.noise_kind == "tail" else None,
            )  # fmt: skip
            tail["labels"] = labels
        result = run_diagnose(
            model,
            tokenizer,
            texts,
            compare=compare,
            noise=args.noise,
            noise_kind=args.noise_kind,
            mantissa_bits=args.rollout_mantissa_bits,
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
        from trl_integration.lab.batch_shape import batch_shape_control

        result.summary["batch_shape"] = None if args.no_batch_shape else batch_shape_control(
            model, result.sequences, dtype=compare[0], temperature=args.temperature, rule=rule, buckets=args.buckets,
            max_tokens=args.batch_size * args.max_length, pad_token_id=tokenizer.pad_token_id or 0,
        )  # fmt: skip
        result.summary["precision_arms"] = run_precision_arms(
            model, result.sequences, result.tokens["rollout_logp"], arms=arms, temperature=args.temperature,
            rule=rule, buckets=args.buckets, batch_size=args.batch_size, max_tokens=args.batch_size * args.max_length,
            pad_token_id=tokenizer.pad_token_id or 0,
        ) if arms else None  # fmt: skip
    except ValueError as err:
        return fail(prog, str(err))
    result.summary["model"] = model_path
    if tail is not None:  # the lab's first output: first in summary.json too
        result.summary = {"tail": tail, **result.summary}
    files = write_outputs(result, args.output_dir, plots=not args.no_plots)
    kept_sets = (result.summary.get("rule") or {}).get("kept_sets")
    if kept_sets is not None and not args.no_plots:
        files.append(Path(args.output_dir) / "kept_sets.png")
        plot_kept_sets(result.tokens, result.summary["rule"]["rule"], files[-1])
    if not args.quiet:
        table = summary_table(result.summary, files)
        if isinstance(table, str):  # pragma: no cover - rich is part of the trl extra
            print(table)
        else:
            from rich.console import Console

            Console().print(table)
        if kept_sets is not None:
            print("\n".join(kept_set_lines(kept_sets)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``safevocab diagnose ARGS`` (``argv``: the arguments after ``diagnose``; default ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_parsed(make_parser().parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
