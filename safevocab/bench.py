"""Benchmark of ``fused_safe_logprobs`` against the matmul floor, a naive masked log-softmax and trl.

Run ``python -m safevocab.bench`` (``--help`` for sizes). Every variant runs forward + backward on the
same seeded inputs, in one fresh subprocess:

- ``floor``: the three bare LM-head GEMMs (``h W^T`` forward, ``G W`` and ``G^T h`` backward);
- ``fused``: :func:`safevocab.fused_safe_logprobs` with the chosen rule;
- ``naive``: materialised ``h W^T`` followed by :func:`safevocab.safe_log_softmax` under autograd;
- ``trl``: trl's unmasked ``ChunkedLogProbFunction`` (only when trl is installed; on CUDA it runs trl's
  Triton fold kernels);
- ``fused_torch`` (CUDA default): the fused path forced to ``backend="torch"``, so ``fused / fused_torch`` is
  what the Triton kernels buy (``fused`` uses ``--backend``, default ``auto``: Triton on CUDA);
- ``fused_replay``: the fused path with a replayed :class:`~safevocab.support.SafeSupport` (the sets ``--rule``
  keeps on these logits, built once outside the timing) and no rule: what exact support replay costs (with
  ``--backend``, as ``fused``: the Triton backend replays too);
- ``liger`` (CUDA default, when ``liger_kernel`` imports): Liger-Kernel's ``LigerFusedLinearGRPOLoss``
  (temperature only, no pruning; ``beta=0``, on-policy) on the same rows viewed as ``[N / T, T]`` sequences.

``--preset gpu`` sets ``--device cuda --n 16384 --h 4096 --v 151936 --dtype bfloat16``, a 1 GiB chunk
budget and the variants ``floor,fused,fused_torch,trl,liger`` (explicit flags still win). Comparison
variants that fail (missing package, out of memory) are reported in the table instead of stopping the run.

It reports time (best of ``--repeats``, taken round-robin across variants, the usual guard against a busy
machine; the JSON has the median too) and peak extra memory of each (tensor storage allocated during one
step and alive at once, inputs excluded: see :class:`LiveTensorBytes`; ``torch.cuda.max_memory_allocated``
on GPU), and the
ratios of ``fused`` to each other variant that ran. Timings are ratios from one run on one
machine; tests never assert them.

This module imports trl lazily, and only to time it: ``safevocab`` itself never depends on trl. It prints nothing
itself: :func:`run` returns the report, progress lines go to this module's logger (INFO), and the entry points
(``python -m safevocab.bench``, ``safevocab bench``) print the report and show the progress (:func:`show_progress`).

**Experimental** (as ``trl.experimental``): this module's names may change or go in any release without
deprecation; the stable API is listed in ``docs/api.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch

from safevocab.bench_inputs import PROFILES, draw_logit_factors, kept_set_sizes, replay_support, sample_targets
from safevocab.bench_measure import peak_bytes, timed

VARIANTS = ("floor", "fused", "fused_torch", "fused_replay", "naive", "trl", "liger")
#: Variants run when ``--variants`` is not given, per device type.
DEFAULT_VARIANTS = {
    "cpu": ("floor", "fused", "naive", "trl"),
    "cuda": ("floor", "fused", "fused_torch", "naive", "trl", "liger"),
}
#: Comparison variants whose failure is reported in the table rather than raised.
_OPTIONAL = ("naive", "trl", "liger")
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
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)
#: The loggers of the benchmark's progress lines (this module's and :mod:`safevocab.bench_matrix`'s).
PROGRESS_LOGGERS = (__name__, "safevocab.bench_matrix")


def _inputs(args: argparse.Namespace, device: torch.device):
    """Each variant's own leaves over one set of inputs, built once per process on ``device``.

    Built where they are used, with the device's generator: built on the CPU (a 151936 x 4096 weight drawn on one
    core, targets drawn by CPU ``multinomial`` over softmaxes copied back) and rebuilt for every variant, the GPU
    preset's setup took about 55 s per variant on an H200 against 0.06 s for the step it sets up. Fresh leaves
    (``detach().requires_grad_()``, storage shared) give each variant its own ``.grad``, so its peak memory
    still counts allocating the gradients. The logits follow ``--logits-profile`` (:mod:`safevocab.bench_inputs`).
    """
    key = (args.n, args.h, args.v, args.dtype, args.rule, args.seed, str(device), args.logits_profile)
    if key not in _INPUTS:
        _INPUTS.clear()  # one shape at a time: a GPU holds a few GB per set
        gen = torch.Generator(device=device).manual_seed(args.seed)
        dtype = _DTYPES[args.dtype]
        hidden, weight = draw_logit_factors(args.n, args.h, args.v, profile=args.logits_profile, generator=gen,
                                            device=device)  # fmt: skip
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        targets = sample_targets(hidden, weight, args.rule, gen)
        grad_out = torch.randn(args.n, generator=gen, device=device)
        _INPUTS[key] = (hidden, weight, targets, grad_out)
    hidden, weight, targets, grad_out = _INPUTS[key]
    return hidden.detach().requires_grad_(), weight.detach().requires_grad_(), targets, grad_out


_INPUTS: dict[tuple, tuple[torch.Tensor, ...]] = {}
_sample_targets = sample_targets  # the name tests/safevocab/test_bench.py checks the draws by


def _make_step(variant: str, args: argparse.Namespace, device: torch.device) -> Callable[[], None]:
    from safevocab.logprobs import fused_safe_logprobs, safe_log_softmax

    hidden, weight, targets, grad_out = _inputs(args, device)
    if variant == "floor":
        grad_logits = torch.randn(args.n, args.v, device=device).to(hidden.dtype)
        h, w = hidden.detach(), weight.detach()

        def step() -> None:
            h @ w.t()
            grad_logits @ w
            grad_logits.t() @ h

        return step
    if variant in ("fused", "fused_torch"):
        backend = args.backend if variant == "fused" else "torch"

        def step() -> None:
            out = fused_safe_logprobs(
                hidden, weight, targets, args.rule, max_chunk_bytes=args.max_chunk_bytes, backend=backend
            ).logprobs
            out.backward(grad_out)

        return step
    if variant == "fused_replay":
        # The engine's kept ids replayed (here: the rule's own sets, built once outside the timing) with no rule.
        support = replay_support(hidden.detach(), weight.detach(), args.rule)

        def step() -> None:
            out = fused_safe_logprobs(
                hidden,
                weight,
                targets,
                None,
                max_chunk_bytes=args.max_chunk_bytes,
                support=support,
                backend=args.backend,
            ).logprobs
            out.backward(grad_out)

        return step
    if variant == "naive":

        def step() -> None:
            logits = hidden @ weight.t()
            safe_log_softmax(logits, targets, args.rule).logprobs.backward(grad_out)

        return step
    if variant == "trl":
        chunked = _trl_function()

        def step() -> None:
            logprobs = chunked.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, ())[0]
            logprobs.backward(grad_out)

        return step
    if variant == "liger":
        return _liger_step(args, hidden, weight, targets)
    raise ValueError(f"variant={variant!r}: accepted one of {VARIANTS}")


def _liger_step(args: argparse.Namespace, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Liger's fused linear GRPO loss on the same rows, as ``[B, T]`` sequences (``T = --liger-seq-len``).

    ``beta=0`` (no reference model) and no old log-probabilities (on-policy ratio 1), so the head's work is
    what is timed: Liger streams 2048-token x 4096-vocab tiles and computes the gradients inside its forward;
    ``backward`` only scales them. ``compiled=False``: its loss math is elementwise on ``[B, T]``, negligible
    next to the GEMMs, and skipping ``torch.compile`` keeps the comparison free of compile-time effects.
    """
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    seq = args.liger_seq_len if args.n % args.liger_seq_len == 0 else args.n
    batch = args.n // seq
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False, loss_type="grpo")
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    advantages = torch.randn(batch, generator=gen).to(hidden.device)
    mask = torch.ones(batch, seq, device=hidden.device, dtype=torch.long)
    h3, y2 = hidden.view(batch, seq, -1), targets.view(batch, seq)

    def step() -> None:
        loss, _metrics = loss_fn(h3, weight, y2, mask, advantages)
        loss.backward()

    return step


def _trl_function():
    import importlib

    return importlib.import_module("trl.kernels").ChunkedLogProbFunction


def _trl_available() -> bool:
    try:
        _trl_function()
    except Exception:  # trl missing or broken: the comparison is skipped, and the table says so
        return False
    return True


def _liger_available() -> bool:
    try:
        import importlib

        importlib.import_module("liger_kernel.chunked_loss")
    except Exception:  # liger_kernel missing or broken: the comparison is skipped, and the table says so
        return False
    return True


def _measure(variants: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Runs in the worker subprocess: each variant's peak memory, then timed repeats taken round-robin
    (variant by variant within each repeat), so that a machine whose load changes slows all alike."""
    device = torch.device(args.device)
    return _measure_steps({v: (lambda v=v: _make_step(v, args, device)) for v in variants}, args)


def _measure_steps(factories: dict[str, Callable[[], Callable[[], None]]], args: argparse.Namespace) -> dict[str, dict]:
    """:func:`_measure` over named step factories (``fused[RULE]`` entries of :mod:`safevocab.bench_matrix` too)."""
    device = torch.device(args.device)
    steps: dict[str, Callable[[], None]] = {}
    results: dict[str, dict] = {}
    for variant, factory in factories.items():
        torch.manual_seed(args.seed)
        try:
            steps[variant] = factory()
            results[variant] = {"variant": variant, "peak_bytes": peak_bytes(steps[variant], device)}
        except Exception as err:  # a comparison that cannot run here (e.g. out of memory): say so in the table
            if variant.split("[")[0] not in _OPTIONAL:
                raise
            steps.pop(variant, None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            logger.warning("benchmark variant %r failed: %r", variant, err)
            results[variant] = {"variant": variant, "error": f"{type(err).__name__}: {err}"[:200]}
    times: dict[str, list[float]] = {variant: [] for variant in steps}
    for _ in range(args.repeats):
        for variant, step in steps.items():
            times[variant].append(timed(step, device))
    for variant, values in times.items():
        results[variant].update(seconds=min(values), median_seconds=statistics.median(values))
    return results


def _run_worker(variants: list[str], argv: list[str]) -> dict[str, dict]:
    """Measure ``variants`` in one fresh subprocess (the inputs of earlier runs never count)."""
    cmd = [sys.executable, "-m", "safevocab.bench", *argv, "--_worker", ",".join(variants)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_parser(prog: str = "python -m safevocab.bench") -> argparse.ArgumentParser:
    """The benchmark's argument parser (also ``safevocab bench``'s)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096, help="tokens (rows), default 4096")
    p.add_argument("--h", type=int, default=512, help="hidden size, default 512")
    p.add_argument("--v", type=int, default=32000, help="vocabulary size, default 32000")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--rule", default="min_p=0.001", help="safe-vocabulary rule, default min_p=0.001")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repeats after the memory run (best is kept), default 3"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--max-chunk-bytes",
        dest="max_chunk_bytes",
        type=int,
        default=None,
        help="fused chunk budget in bytes (default: the library default)",
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma list of {','.join(VARIANTS)}; default {','.join(DEFAULT_VARIANTS['cpu'])} "
        f"on CPU, {','.join(DEFAULT_VARIANTS['cuda'])} on CUDA",
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
        dest="liger_seq_len",
        type=int,
        default=1024,
        help="sequence length T of the `liger` variant's [N / T, T] batch, default 1024",
    )
    p.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--rules",
        default=None,
        help="several rules in one run, separated by ';' (a rule's parts by ','), e.g. "
        '"none;min_p=0.001;top_k=50,min_p=0.01": the floor, trl and fused under each rule, per thread count',
    )
    p.add_argument(
        "--threads",
        default=None,
        help="comma list of intra-op thread counts, one worker each (e.g. 1,2); with --rules/--busy-cores",
    )
    p.add_argument(
        "--busy-cores",
        dest="busy_cores",
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
        dest="logits_profile",
        choices=PROFILES,
        default="synthetic",
        help="synthetic: N(0, 9) logits (flat, kept sets of 1-4 %% of V); lm: a Zipf prior plus a context "
        "term, kept sets of tens to hundreds of tokens (safevocab.bench_inputs); default synthetic",
    )
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_threads", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _format_table(args: argparse.Namespace, results: dict[str, dict], kept_set: dict | None = None) -> str:
    lines = [
        f"safevocab.bench  N={args.n} H={args.h} V={args.v} dtype={args.dtype} rule={args.rule} "
        f"device={_device_name(args.device)} threads={torch.get_num_threads()} repeats={args.repeats} "
        f"backend={args.backend} max_chunk_bytes={args.max_chunk_bytes} logits={args.logits_profile}",
        *([f"kept set |S|: median {kept_set['median']:.0f}, p99 {kept_set['p99']:.0f}"] if kept_set else []),
        "",
        "| variant | fwd+bwd time (s) | peak extra memory (MiB) |",
        "|---|---:|---:|",
    ]
    for name in VARIANTS:
        if name in results:
            r = results[name]
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error']} | |")
            else:
                lines.append(f"| {name} | {r['seconds']:.3f} | {r['peak_bytes'] / 2**20:.0f} |")
    lines += ["", "| ratio | time | peak memory |", "|---|---:|---:|"]
    fused = results.get("fused")
    if fused and "error" in fused:
        fused = None
    for other in ("floor", "fused_torch", "naive", "trl", "liger"):
        if fused and other in results and "error" not in results[other]:
            r = results[other]
            mem = fused["peak_bytes"] / r["peak_bytes"] if r["peak_bytes"] > 0 else float("nan")
            lines.append(f"| fused / {other} | {fused['seconds'] / r['seconds']:.2f} | {mem:.3f} |")
    for other, package in (("trl", "trl"), ("liger", "liger_kernel")):
        if other not in results and other in args.variants.split(","):
            lines.append(f"| fused / {other} | ({package} not installed) | |")
    return "\n".join(lines)


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def _parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = make_parser(prog)
    preset = parser.parse_args(argv).preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])  # explicit flags still override these
    args = parser.parse_args(argv)
    if args.variants is None:
        args.variants = ",".join(DEFAULT_VARIANTS["cuda" if args.device.startswith("cuda") else "cpu"])
    return args


class _ProgressHandler(logging.StreamHandler):
    """The handler :func:`show_progress` adds (found again by its type, so a second call adds none)."""


def show_progress(stream=None) -> None:
    """Show the benchmark's progress lines (INFO and up of :data:`PROGRESS_LOGGERS`) on ``stream`` (default:
    ``sys.stderr``), as their bare message. For the entry points: a library caller configures logging."""
    for name in PROGRESS_LOGGERS:
        progress_logger = logging.getLogger(name)
        progress_logger.setLevel(logging.INFO)
        if not any(isinstance(handler, _ProgressHandler) for handler in progress_logger.handlers):
            handler = _ProgressHandler(stream)
            handler.setFormatter(logging.Formatter("%(message)s"))
            progress_logger.addHandler(handler)
        progress_logger.propagate = False


def run(argv: list[str] | None = None, prog: str = "python -m safevocab.bench") -> str:
    """Run the benchmark and return its report: the table (or, in a worker process, the results as one JSON line).

    ``argv``: default ``sys.argv[1:]``; ``prog`` names the command in ``--help``. Progress goes to this module's
    logger. Raises ``SystemExit`` on ``--help`` and on a bad flag (argparse's, and one line for ``--variants``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv, prog)
    if args.max_chunk_bytes is None:
        from safevocab.logprobs import DEFAULT_MAX_CHUNK_BYTES

        args.max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES
    if args._threads is not None:
        torch.set_num_threads(args._threads)
    if args._worker == "matrix":
        from safevocab.bench_matrix import measure_matrix

        with_trl = "trl" in args.variants.split(",") and _trl_available()
        return json.dumps(measure_matrix(args, _make_step, _measure_steps, with_trl))
    if args._worker:
        results = _measure(args._worker.split(","), args)
        hidden, weight, _, _ = _inputs(args, torch.device(args.device))
        results["_kept_set"] = kept_set_sizes(hidden.detach(), weight.detach(), args.rule)  # |S| of the timed rows
        return json.dumps(results)
    if args.rules is not None or args.threads is not None or args.busy_cores:
        return _run_matrix(args, argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; accepted {','.join(VARIANTS)}")
    if "trl" in variants and not _trl_available():
        variants.remove("trl")
    if "liger" in variants and not _liger_available():
        variants.remove("liger")
    from safevocab.rules import parse_rule

    parse_rule(args.rule)  # fail fast on a bad rule, before any worker starts
    logger.info("measuring %s (%d round-robin repeats) ...", ", ".join(variants), args.repeats)
    results = _run_worker(variants, argv)
    kept_set = results.pop("_kept_set", None)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "_worker"}, "results": results,
                       "kept_set": kept_set}, f, indent=2)  # fmt: skip
    return _format_table(args, results, kept_set)


def _run_matrix(args: argparse.Namespace, argv: list[str]) -> str:
    from safevocab.bench_matrix import format_matrix, run_matrix, split_rules
    from safevocab.rules import parse_rule

    if args.rules is None:
        args.rules = args.rule
        argv = [*argv, "--rules", args.rule]
    if args.threads is None:
        args.threads = str(torch.get_num_threads())
        argv = [*argv, "--threads", args.threads]
    for rule in split_rules(args.rules) + ([args.replay] if args.replay else []):
        parse_rule(rule)  # fail fast on a bad rule, before any worker starts
    load = os.getloadavg()
    results = run_matrix(args, argv)
    if args.json_path:
        with open(args.json_path, "w") as f:
            state = {"load_average": load, "busy_cores": args.busy_cores}
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "machine": state,
                       "results": results}, f, indent=2)  # fmt: skip
    return format_matrix(args, results, load)


if __name__ == "__main__":  # the `python -m safevocab.bench` entry point (a worker process runs it too)
    show_progress()
    print(run(), flush=True)
