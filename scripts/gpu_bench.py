"""GPU truth in one run: correctness on CUDA, the fused op against trl's kernel, a kernel profile, GRPO steps.

Writes one results file (JSON, plus the same as Markdown beside it) with the sections chosen by ``--sections``:

1. **correctness**: the reference tests (``tests/safevocab/test_core_regressions.py``, ``tests/safevocab/test_reference_fuzz.py``,
   ``tests/safevocab/test_support.py``, ``tests/safevocab/test_kernels.py``, or ``--tests``) on the device, both backends, every dtype,
   rule and support replay (``SAFEVOCAB_TEST_DEVICE``; the Triton kernels compiled, not interpreted);
2. **op**: ``python -m safevocab.bench`` per rule at N=16384 (``--n``), H=4096, V=151936, bf16 (``--preset gpu``), on
   each logits profile of ``--profiles`` (``synthetic``: flat N(0, 9) logits; ``lm``: a Zipf prior plus a context
   term, kept sets of tens to hundreds of tokens, :mod:`safevocab.bench.inputs`): fused vs trl's
   ``ChunkedLogProbFunction`` vs the floor, time (forward + backward), peak memory and the kept sets' median size,
   and support replay at ``|S| = 64`` (on the Triton backend, as ``fused``: the rule's fold, a gather of the ids and
   the Triton sparse backward);
3. **profile**: ``scripts/profile_fused_vs_trl.py``: per-kernel device times of ``fused`` and trl's kernel for none,
   min_p, top_k and top_p in one process;
4. **grpo**: ``SafeVocabGRPOTrainer`` vs stock ``GRPOTrainer`` on a locally built Qwen2-shaped model of about
   0.5 B parameters (random weights, Qwen2.5's vocabulary size), step time and peak memory, bf16 and fp16
   with loss scaling (or ``--grpo-ablation``);
5. **pairs**: the same two trainers interleaved step by step in one process (``scripts/grpo_pairs.py``,
   ``--grpo-pairs`` pairs): the median per-pair ratio and its 95 % interval.

Usage (the GPU machine has no trl/datasets: carry their wheels, see ``scripts/gpu_bench.sh``)::

    bash scripts/gpu_bench.sh                      # on a CUDA machine: the issue-41 measurement, under 9 minutes
    bash scripts/gpu_bench.sh --small --out /tmp/gpu_results.json   # CPU, small shapes: tests the script

This is tooling, not product code: it drives the public API and the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = ("none", "min_p=0.001", "min_prob=0.001", "top_k=50", "top_p=0.9", "top_k=50,min_p=0.01")
TEST_FILES = (
    "tests/safevocab/test_core_regressions.py",
    "tests/safevocab/test_reference_fuzz.py",
    "tests/safevocab/test_support.py",
    "tests/safevocab/test_kernels.py",
)


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``cmd`` in the repository root; past ``timeout`` it is stopped and returns code 124 with what it printed
    (one slow section must not lose the others' results)."""
    full_env = {**os.environ, **(env or {})}
    try:
        return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        return subprocess.CompletedProcess(
            cmd, 124, text(err.stdout), text(err.stderr) + f"\n[timed out after {timeout} s]"
        )


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    for name in ("triton", "trl", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except Exception as err:  # absent on the machine: say so in the results
            info[name] = f"absent ({type(err).__name__})"
    return info


def correctness(
    device: str,
    small: bool,
    timeout: float,
    log: Path,
    examples: int | None = None,
    files: tuple[str, ...] = TEST_FILES,
) -> dict:
    """The reference tests on ``device``; returns pytest's closing line and return code (full output in ``log``).
    ``examples``: fuzz examples per property (default 200 with ``--small``, else 500)."""
    examples = str(examples or (200 if small else 500))
    env = {
        "SAFEVOCAB_TEST_DEVICE": device,
        "SAFEVOCAB_FUZZ_EXAMPLES": examples,
        "SAFEVOCAB_FUZZ_EXAMPLES_TRITON": examples,
        "SAFEVOCAB_BOUNDARY_CASES": "300" if small else "2000",
    }
    started = time.perf_counter()
    proc = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfE",
            "--tb=short",
            "-m",
            "not slow",
            "-p",
            "no:cacheprovider",
            *files,
        ],
        env,
        timeout,
    )
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if " passed" in line or " failed" in line]
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else proc.stdout[-500:],
        "failed": failed[:50],
        "seconds": round(time.perf_counter() - started, 1),
    }


def op_bench(
    small: bool,
    timeout: float,
    n: int | None = None,
    rules: tuple[str, ...] = RULES,
    naive: bool = True,
    profile: str = "synthetic",
    variants: str = "floor,fused,fused_torch,trl,liger",
    replay: str | None = None,
) -> list[dict]:
    """``python -m safevocab.bench`` per rule on ``profile`` logits (:mod:`safevocab.bench.inputs`), plus support
    replay at |S| = 64; the naive materialised path (tens of GB at the GPU shape) for the unmasked and the default
    rule only."""
    size = (
        ["--device", "cpu", "--n", "256", "--h", "64", "--v", "3000", "--dtype", "float32", "--repeats", "1"]
        if small
        else ["--preset", "gpu", "--repeats", "3"]
    )
    if n is not None:
        size += ["--n", str(n)]  # after the preset: an explicit flag overrides it
    size += ["--logits-profile", profile]
    with_naive = {"none", "min_p=0.001"} if naive else set()
    runs = [(rule, variants + (",naive" if rule in with_naive else "")) for rule in rules]
    if replay or rules == RULES:
        runs.append((replay or "top_k=64", "floor,fused,fused_replay"))
    rows = []
    for rule, chosen in runs:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            proc = _run(
                [
                    sys.executable,
                    "-m",
                    "safevocab.bench",
                    *size,
                    "--rule",
                    rule,
                    "--variants",
                    chosen,
                    "--json",
                    f.name,
                ],
                timeout=timeout,
            )
            if proc.returncode != 0:
                rows.append({"rule": rule, "logits_profile": profile, "error": proc.stderr[-400:]})
                continue
            rows.append({"rule": rule, "logits_profile": profile, **json.load(open(f.name))})
    return rows


def kernel_profile(small: bool, timeout: float, n: int | None, profiles: list[str], out: Path) -> list[dict] | dict:
    """``scripts/profile_fused_vs_trl.py``: per-kernel device times of ``fused`` and trl's kernel for none, min_p,
    top_k and top_p, in one process per call (its JSON beside ``out``)."""
    cmd = [sys.executable, "scripts/profile_fused_vs_trl.py", "--profiles", ",".join(profiles), "--out", str(out)]
    cmd += ["--small"] if small else ["--n", str(n or 8192)]
    proc = _run(cmd, timeout=timeout)
    rows = json.loads(out.read_text()) if out.exists() else []
    for row in rows:
        for name in ("fused", "trl"):
            row.get(name, {}).pop("table", None)  # the printed tables stay in the log, the kernels in the rows
    if proc.returncode != 0:
        return {"error": proc.stderr[-400:], "rows": rows}
    return rows


# ---------------------------------------------------------------------------------------------- GRPO step


def _tokenizer(vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` synthetic tokens ``t0 .. t{V-1}`` plus specials (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"t{i}" for i in range(vocab_size - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",
    )


def _model_dir(small: bool):
    """A Qwen2-shaped causal LM with random weights, saved to a temporary directory (trl loads the model by
    path), and its tokenizer object (passed as ``processing_class``: loaded by path, ``AutoTokenizer`` would
    take the Qwen2 BPE class from the model type)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 2000 if small else 151936
    tokenizer = _tokenizer(vocab)
    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        if small
        else dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
    )  # Qwen2.5-0.5B
    config = Qwen2Config(
        vocab_size=vocab,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **shape,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    path = tempfile.mkdtemp(prefix="safevocab-qwen2-")
    model.save_pretrained(path)
    return path, tokenizer


def make_grpo_trainer(
    model_path: str,
    tokenizer,
    trainer_kind: str,
    precision: str,
    small: bool,
    steps: int,
    overrides: dict | None = None,
    callbacks: list | None = None,
):
    """A stock ``GRPOTrainer`` or a ``SafeVocabGRPOTrainer`` (``overrides``: more ``SafeVocabGRPOConfig`` fields) for
    ``steps`` GRPO steps on the benchmark's prompts, with ``callbacks``."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer

    cuda = torch.cuda.is_available() and not small
    prompts = [" ".join(f"t{(7 * i + j) % 1000}" for j in range(16)) for i in range(64)]
    dataset = Dataset.from_dict({"prompt": prompts})

    def reward(completions, **_):
        return [float(len(c) % 7) for c in completions]

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="safevocab-grpo-"),
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=16 if small else 64,
        max_steps=steps,
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=not cuda,
        disable_tqdm=True,
        bf16=cuda and precision == "bf16",
        fp16=cuda and precision == "fp16",
    )
    if trainer_kind == "stock":
        args, trainer_cls = GRPOConfig(**common), GRPOTrainer
    else:
        args = SafeVocabGRPOConfig(**common, **{"safe_vocab_rule": "min_p=0.001", **(overrides or {})})
        trainer_cls = SafeVocabGRPOTrainer
    return trainer_cls(
        model=model_path,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks or [],
    )


def grpo_step(
    model_path: str,
    tokenizer,
    trainer_kind: str,
    precision: str,
    small: bool,
    steps: int = 3,
    overrides: dict | None = None,
) -> dict:
    """Median step time (after the first) and peak memory of ``steps`` GRPO steps (``overrides``: more
    ``SafeVocabGRPOConfig`` fields, for ``trainer_kind="safevocab"``)."""
    import torch
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available() and not small

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimer()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = make_grpo_trainer(model_path, tokenizer, trainer_kind, precision, small, steps, overrides, [timer])
    trainer.train()
    out = {
        "trainer": trainer_label(trainer_kind, overrides),
        "precision": precision if cuda else "fp32 (cpu)",
        "step_seconds": round(statistics.median(timer.times[1:] or timer.times), 4),
        "steps": len(timer.times),
    }
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    del trainer
    return out


def grpo_pairs(small: bool, pairs: int) -> dict:
    """Stock and SafeVocab GRPO steps interleaved in one process (``scripts/grpo_pairs.py``): per-pair ratios, their
    median and 95 % interval (bf16 on CUDA)."""
    import torch
    from grpo_pairs import run_pairs

    path, tokenizer = _model_dir(small)
    cuda = torch.cuda.is_available() and not small
    precision = "bf16" if cuda else "fp32"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def make(kind, steps, callbacks):
        return make_grpo_trainer(path, tokenizer, kind, precision, small, steps, callbacks=callbacks)

    try:
        return {"precision": precision if cuda else "fp32 (cpu)", **run_pairs(make, pairs, sync)}
    except Exception as err:  # record and go on
        return {"precision": precision, "pairs": pairs, "error": f"{type(err).__name__}: {err}"[:400]}


def trainer_label(trainer_kind: str, overrides: dict | None) -> str:
    """``stock``, ``safevocab``, or ``safevocab`` followed by the config fields it overrides (``name=value``)."""
    return trainer_kind + "".join(f" {k}={v}" for k, v in (overrides or {}).items())


def grpo_row(
    model_path: str,
    tokenizer,
    trainer_kind: str,
    precision: str,
    small: bool,
    steps: int,
    overrides: dict | None = None,
) -> dict:
    """``grpo_step``'s row, or the error it raised as a row: one failure must not hide the other measurements."""
    try:
        return grpo_step(model_path, tokenizer, trainer_kind, precision, small, steps, overrides)
    except Exception as err:  # record and go on
        return {
            "trainer": trainer_label(trainer_kind, overrides),
            "precision": precision,
            "error": f"{type(err).__name__}: {err}"[:400],
        }


def grpo(small: bool, steps: int = 3) -> list[dict]:
    path, tokenizer = _model_dir(small)
    return [
        grpo_row(path, tokenizer, kind, precision, small, steps)
        for precision in (("fp32",) if small else ("bf16", "fp16"))
        for kind in ("stock", "safevocab")
    ]


#: Where SafeVocab's step time goes: the trainer with the generate path's sampler rule and its log-prob recording
#: switched off, part by part (bf16 only).
ABLATION = (
    None,
    {"rollout_logprobs": False, "log_mismatch_metrics": False},
    {"rollout_logprobs": False, "log_mismatch_metrics": False, "safe_vocab_in_sampler": False},
)


def grpo_ablation(small: bool, steps: int = 3, rounds: int = 2) -> list[dict]:
    """Stock trl, then SafeVocab with each row of ``ABLATION``, ``rounds`` times (stock, variants, stock,
    variants), so that a drift of the machine shows as a difference between the stock rows."""
    path, tokenizer = _model_dir(small)
    precision = "fp32" if small else "bf16"
    trainers = [("stock", None), *[("safevocab", overrides) for overrides in ABLATION]]
    return [
        grpo_row(path, tokenizer, kind, precision, small, steps, overrides)
        for _ in range(rounds)
        for kind, overrides in trainers
    ]


# ---------------------------------------------------------------------------------------------- report


def markdown(results: dict) -> str:
    lines = [
        "# safevocab GPU results",
        "",
        "```",
        json.dumps(results["environment"], indent=1),
        "```",
        "",
        f"Correctness: `{results['correctness'].get('summary', 'skipped')}`",
        "",
        *[f"- {line}" for line in results["correctness"].get("failed", [])],
        "",
        "| rule | variant | time (s) | peak (MiB) | / floor | / trl |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in results.get("op", []):
        if "error" in row:
            lines.append(f"| {row['rule']} | error | {row['error'][:80]} | | | |")
            continue
        res = row["results"]
        floor, trl = res.get("floor", {}).get("seconds"), res.get("trl", {}).get("seconds")
        kept = row.get("kept_set")
        label = f"{row['rule']} ({row.get('logits_profile', 'synthetic')}" + (
            f", |S| ~ {kept['median']:.0f})" if kept else ")"
        )
        for variant, r in res.items():
            if "seconds" not in r:
                lines.append(f"| {label} | {variant} | {r.get('error', '')[:60]} | | | |")
                continue
            ratio = lambda d, r=r: f"{r['seconds'] / d:.2f}" if d else ""  # noqa: E731
            lines.append(
                f"| {label} | {variant} | {r['seconds']:.4f} | {r['peak_bytes'] / 2**20:.0f} | "
                f"{ratio(floor)} | {ratio(trl)} |"
            )
    if results.get("grpo"):
        lines += ["", "| trainer | precision | step (s) | peak (GiB) |", "|---|---|---:|---:|"]
    for row in results.get("grpo", []):
        lines.append(
            f"| {row['trainer']} | {row['precision']} | {row.get('step_seconds', row.get('error', ''))} | "
            f"{row.get('peak_gib', '')} |"
        )
    profile_rows = results.get("profile", [])
    if isinstance(profile_rows, list) and profile_rows:
        lines += [
            "",
            "| rule (logits) | fused (s) | trl (s) | fused / trl | fused's top kernel |",
            "|---|---:|---:|---:|---|",
        ]
        for row in profile_rows:
            if "error" in row:
                lines.append(f"| {row['rule']} ({row['logits_profile']}) | {row['error'][:60]} | | | |")
                continue
            top = row["fused"]["top"][0]
            lines.append(
                f"| {row['rule']} ({row['logits_profile']}) | {row['fused']['mean_seconds']:.4f} | "
                f"{row['trl']['mean_seconds']:.4f} | {row['fused_over_trl']:.2f} | {top['name'][:50]} |"
            )
    pairs = results.get("pairs")
    if pairs:
        lines += ["", "GRPO steps, stock vs SafeVocab interleaved in one process:"]
        lines.append(
            f"- error: {pairs['error']}"
            if "error" in pairs
            else f"- {pairs['pairs']} pairs ({pairs['precision']}): SafeVocab / stock median {pairs['median_ratio']}, "
            f"95 % interval {pairs['ratio_95']} (stock {pairs['stock_median_seconds']} s, SafeVocab "
            f"{pairs['safevocab_median_seconds']} s); goal <= 1.03 at the upper end: "
            f"{'met' if pairs['overhead_goal_met'] else 'not met'}"
        )
    return "\n".join(lines) + "\n"


SECTIONS = ("correctness", "op", "profile", "grpo", "pairs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes (tests the script without a GPU)")
    parser.add_argument("--out", default="gpu_results.json", help="results file (JSON; Markdown beside it)")
    parser.add_argument(
        "--sections",
        default="correctness,op,grpo",
        help=f"comma list of sections to run, of {','.join(SECTIONS)} (default: %(default)s; "
        "scripts/gpu_bench.sh runs correctness,op,profile,pairs)",
    )
    parser.add_argument("--skip", default="", help="comma list of sections to leave out of --sections")
    parser.add_argument("--correctness-timeout", type=float, default=600, help="seconds for the reference tests")
    parser.add_argument(
        "--fuzz-examples",
        type=int,
        default=None,
        help="fuzz examples per property in the correctness section (default 500; 200 with --small)",
    )
    parser.add_argument("--op-timeout", type=float, default=300, help="seconds for each rule's op benchmark")
    parser.add_argument(
        "--op-variants",
        default="floor,fused,fused_torch,trl,liger",
        help="variants of the op benchmark (default: %(default)s)",
    )
    parser.add_argument(
        "--profiles",
        default="synthetic",
        help="','-separated logits profiles of the op and profile sections: synthetic, lm "
        "(safevocab/bench/inputs.py; default synthetic)",
    )
    parser.add_argument("--profile-timeout", type=float, default=300, help="seconds for the kernel profile section")
    parser.add_argument(
        "--grpo-steps",
        dest="grpo_steps",
        type=int,
        default=3,
        help="GRPO steps per trainer (the median leaves out the first); 3 left +-20 %% noise on an H200",
    )
    parser.add_argument(
        "--grpo-pairs",
        dest="grpo_pairs",
        type=int,
        default=30,
        help="pairs section: interleaved stock/SafeVocab step pairs (default 30)",
    )
    parser.add_argument(
        "--n", type=int, default=None, help="tokens for the op benchmark (default: the gpu preset's 16384)"
    )
    parser.add_argument("--rules", default=None, help="';'-separated rules for the op benchmark (default: all)")
    parser.add_argument(
        "--lm-rules", default=None, help="';'-separated rules for the op benchmark on the lm profile (default: --rules)"
    )
    parser.add_argument(
        "--replay",
        default=None,
        help="also time support replay of this rule's sets (default: top_k=64 when --rules is not given)",
    )
    parser.add_argument(
        "--tests",
        default=",".join(TEST_FILES),
        help="comma list of test files of the correctness section (default: %(default)s)",
    )
    parser.add_argument("--no-naive", action="store_true", help="leave out the materialised path (tens of GB, slow)")
    parser.add_argument(
        "--grpo-ablation",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="grpo section: ROUNDS of stock, then SafeVocab without its sampler rule/log-prob "
        "recording, part by part (0: the precision comparison instead)",
    )
    args = parser.parse_args(argv)
    if args.grpo_ablation < 0:
        parser.error(f"--grpo-ablation must be a number of rounds >= 0, got {args.grpo_ablation}")
    if args.grpo_pairs < 1:
        parser.error(f"--grpo-pairs must be a number of pairs >= 1, got {args.grpo_pairs}")
    chosen = [name for name in filter(None, args.sections.split(",")) if name not in set(args.skip.split(","))]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; accepted {','.join(SECTIONS)}")
    profiles = [p for p in args.profiles.split(",") if p]
    device = "cpu" if args.small else "cuda"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # before minutes of measurement, not after
    rules = tuple(args.rules.split(";")) if args.rules else RULES
    runs = {
        "correctness": lambda: correctness(
            device,
            args.small,
            args.correctness_timeout,
            out.with_suffix(".pytest.log"),
            args.fuzz_examples,
            tuple(filter(None, args.tests.split(","))),
        ),
        "op": lambda: [
            row
            for profile in profiles
            for row in op_bench(
                args.small,
                args.op_timeout,
                args.n,
                tuple(args.lm_rules.split(";")) if profile == "lm" and args.lm_rules else rules,
                not args.no_naive,
                profile,
                args.op_variants,
                args.replay,
            )
        ],
        "profile": lambda: kernel_profile(
            args.small, args.profile_timeout, args.n, profiles, out.with_suffix(".profile.json")
        ),
        "grpo": lambda: (
            grpo_ablation(args.small, args.grpo_steps, args.grpo_ablation)
            if args.grpo_ablation
            else grpo(args.small, args.grpo_steps)
        ),
        "pairs": lambda: grpo_pairs(args.small, args.grpo_pairs),
    }
    results: dict = {"environment": environment(), "small": args.small, "correctness": {}, "sections": chosen}
    started = time.perf_counter()
    for name in SECTIONS:
        if name not in chosen:
            continue
        print(f"[gpu_bench] {name} ... ({time.perf_counter() - started:.0f} s so far)", file=sys.stderr, flush=True)
        results[name] = runs[name]()
        out.write_text(json.dumps(results, indent=2))  # what is done so far is never lost
    results["seconds"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
