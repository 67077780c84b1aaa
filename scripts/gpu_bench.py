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

The device plan of 2026-11-28 (``../shared/GPU_DESIGN.md``; ``scripts/gpu_plan.py``, in this process, at N = 8192,
H = 4096, V = 151936, bf16, 1 GiB chunks; every fused row records which backward ran and the forward's fallbacks):

6. **gate**: flat logits, ``min_p=0.001``, ``top_p=0.9``, ``top_k=50`` (``--gate-rules``) with the gate's backward,
   then dense, per-id and union forced, beside the floor, trl and Liger;
7. **topk_sweep**: ``top_k`` 64-512 (``--topk``) on both profiles, each backward forced;
8. **lm_table**: LM-like logits, ``min_p=0.01``, ``top_k=50``, ``top_p=0.9``, ``none`` and the replay of 64 ids beside
   the floor, trl and Liger (Liger's Hopper per-token kernel where this device and wheel have it, else its Triton
   fused linear cross-entropy; the row names which);
9. **compact**: the kept-entry micro-benchmark (the fold with and without its pool, packing, the re-reading
   compaction at column blocks 1024-8192);
10. **trace**: torch.profiler traces of ``min_p=0.01`` (LM) and ``none``, with the GPU's idle gaps inside one call.

For the kernels' own tests on the device: ``--sections correctness --tests kernels --workers 8`` (the kernel test
files with pytest-xdist, ``TRITON_INTERPRET`` unset: compiled). Sections run in the order given; past ``--budget_s``
(default 570 s for the whole call; a later ``correctness`` keeps its time box, at most half the budget) the remaining
rows and sections are skipped and say so. A section that records nothing (or a fused row that does not say which
backward ran) is reported under ``problems`` and the script exits 1.

Usage (the GPU machine has no trl/datasets/hypothesis/xdist: carry their wheels, see ``scripts/gpu_bench.sh``)::

    bash scripts/gpu_bench.sh                      # on a CUDA machine: the issue-41 measurement, under 9 minutes
    bash scripts/gpu_bench.sh --small --out /tmp/gpu_results.json   # CPU, small shapes: tests the script
    bash scripts/gpu_bench.sh --sections gate,topk_sweep,lm_table,compact,trace,fallback,correctness --tests kernels \
        --workers 8 --correctness-timeout 300 --budget_s 540 --out plan.json   # the device plan: one 9.5-min call
    python scripts/gpu_bench.py --small --sections gate,topk_sweep,lm_table,compact,trace,fallback --out /tmp/plan.json

This is tooling, not product code: it drives the public API and the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpu_plan  # scripts/gpu_plan.py: the device plan's sections (this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
RULES = ("none", "min_p=0.001", "min_prob=0.001", "top_k=50", "top_p=0.9", "top_k=50,min_p=0.01")
TEST_FILES = (
    "tests/safevocab/test_core_regressions.py",
    "tests/safevocab/test_reference_fuzz.py",
    "tests/safevocab/test_support.py",
    "tests/safevocab/test_kernels.py",
)
#: ``--tests kernels``: the Triton kernels' test files (the union backward's where present).
KERNEL_TEST_FILES = tuple(
    path
    for path in (
        "tests/safevocab/test_kernels.py",
        "tests/safevocab/test_sparse_backward_kernel.py",
        "tests/safevocab/test_threshold_select_kernel.py",
        "tests/safevocab/test_kept_entries_kernel.py",
        "tests/safevocab/test_union_backward_kernel.py",
        "tests/safevocab/test_radix_select_kernel.py",
        "tests/safevocab/test_candidate_decide_kernel.py",
        "tests/safevocab/test_keep_logits_triton.py",
    )
    if (ROOT / path).exists()
)
#: ``TRITON_INTERPRET`` as this process found it: the plan's sections set it for a CPU run, the subprocesses of the
#: other sections get it back as it was.
_INHERITED_INTERPRET = os.environ.get("TRITON_INTERPRET")


def _run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600, unset: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``cmd`` in the repository root, with ``env`` added and ``unset`` removed; past ``timeout`` it is stopped (with
    every process it started: pytest-xdist's workers) and returns code 124 with what it printed (one slow section must
    not lose the others' results)."""
    full_env = dict(os.environ)
    full_env.pop("TRITON_INTERPRET", None)
    if _INHERITED_INTERPRET is not None:
        full_env["TRITON_INTERPRET"] = _INHERITED_INTERPRET
    full_env.update(env or {})
    for name in unset:
        full_env.pop(name, None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the command and what it started
        stdout, stderr = proc.communicate()
        return subprocess.CompletedProcess(cmd, 124, stdout, stderr + f"\n[timed out after {timeout} s]")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def trl_backward_context() -> str:
    """Make trl's ``ChunkedLogProbFunction`` run its backward where ``trl.trainer.utils`` does not import.

    trl's backward imports ``maybe_gather_lm_head_ctx`` from ``trl.trainer.utils`` at call time, and that module imports
    pandas and datasets, which the GPU machine lacks (and which are too large to carry for every CPython). Where it
    does not import, a stand-in module gives the function's value without DeepSpeed ZeRO-3, ``nullcontext()`` (a
    single process: trl's own code returns that), so the trl rows time trl's kernel unchanged. Returns what the
    results record: ``"trl's"`` or the stand-in's description. Every use of trl's private module is here."""
    import contextlib
    import importlib
    import importlib.util
    import types

    if importlib.util.find_spec("trl") is None:
        return "trl absent"
    try:
        importlib.import_module("trl.trainer.utils")
        return "trl's"
    except Exception as err:  # noqa: BLE001 - whatever keeps it from importing, the bench must still run
        why = f"needs {err.name}, absent" if isinstance(err, ModuleNotFoundError) else f"{type(err).__name__}: {err}"
    stand_in = types.ModuleType("trl.trainer.utils")
    stand_in.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
    sys.modules["trl.trainer.utils"] = stand_in
    return f"stand-in (trl.trainer.utils {why[:200]}): maybe_gather_lm_head_ctx -> nullcontext(), no ZeRO-3"


def environment() -> dict:
    import platform
    from importlib.metadata import version

    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "python": platform.python_version()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                    sm_count=props.multi_processor_count, cuda_runtime=torch.version.cuda)  # fmt: skip
    for name in ("triton", "trl", "transformers", "liger-kernel"):
        try:
            info[name] = version(name)
        except Exception as err:  # absent on the machine: say so in the results
            info[name] = f"absent ({type(err).__name__})"
    info["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    info["trl_backward_context"] = trl_backward_context()
    return info


def correctness(
    device: str,
    small: bool,
    timeout: float,
    log: Path,
    examples: int | None = None,
    files: tuple[str, ...] = TEST_FILES,
    workers: int = 0,
) -> dict:
    """The reference tests on ``device``; returns pytest's closing line and return code (full output in ``log``).
    ``examples``: fuzz examples per property (default 200 with ``--small``, else 500). ``workers``: pytest-xdist
    processes (``-n``; 0: none). On CUDA the Triton kernels run compiled (``TRITON_INTERPRET`` unset); without a CUDA
    device (and without ``--small``) skipped, with a note."""
    import torch

    files = tuple(f for name in files for f in (KERNEL_TEST_FILES if name == "kernels" else (name,)))
    if device == "cuda" and not torch.cuda.is_available():
        note = "no CUDA device: these tests run compiled on a GPU only (CPU CI runs them under the interpreter)"
        return {"skipped": note, "files": list(files)}
    xdist = []
    if workers > 0:
        import importlib.util

        xdist = ["-n", str(workers)] if importlib.util.find_spec("xdist") else []
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
            *xdist,
            *files,
        ],
        env,
        timeout,
        unset=("TRITON_INTERPRET",) if device == "cuda" else (),
    )
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if " passed" in line or " failed" in line]
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    out = {
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else proc.stdout[-500:],
        "failed": failed[:50],
        "seconds": round(time.perf_counter() - started, 1),
        "timeout_s": round(timeout),
        "files": list(files),
    }
    if workers > 0:
        out["workers"] = workers if xdist else "0 (pytest-xdist not installed: one process)"
    return out


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
        f"Command: `{results.get('command', '')}`",
        "",
        f"Correctness: `{results['correctness'].get('summary', results['correctness'].get('skipped', 'skipped'))}`",
        "",
        *[f"- {line}" for line in results["correctness"].get("failed", [])],
    ]
    if results.get("op"):
        lines += ["", "| rule | variant | time (s) | peak (MiB) | / floor | / trl |", "|---|---|---:|---:|---:|---:|"]
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
    lines += gpu_plan.markdown(results)
    for name, note in results.get("skipped", {}).items():
        lines.append(f"- {name}: skipped, {note}")
    for name, problems in results.get("problems", {}).items():
        lines += [f"- PROBLEM {name}: {problem}" for problem in problems]
    return "\n".join(lines) + "\n"


SECTIONS = ("correctness", "op", "profile", "grpo", "pairs", *gpu_plan.PLAN_SECTIONS)


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
        "--workers", type=int, default=0, help="correctness section: pytest-xdist processes (-n; default 0: none)"
    )
    parser.add_argument(
        "--budget_s",
        "--budget-s",
        dest="budget_s",
        type=float,
        default=570,
        help="wall-clock seconds for the whole call: past them the remaining rows and sections are skipped, and "
        "say so (default %(default)s: one 9.5-minute device call; 0: no limit)",
    )
    parser.add_argument(
        "--gate-rules", default=";".join(gpu_plan.GATE_RULES),
        help="';'-separated rules of the gate section (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--topk", default=None, help="comma list of top_k values of the topk_sweep section (default 64,128,256,512; "
        "--small: 4,16)",
    )  # fmt: skip
    parser.add_argument(
        "--lm-table-rules", default=";".join(gpu_plan.LM_RULES),
        help="';'-separated rules of the lm_table section (default: %(default)s; plus the replay of top_k=64)",
    )  # fmt: skip
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
        "--n",
        type=int,
        default=None,
        help="tokens for the op benchmark (default: the gpu preset's 16384) and the plan's sections (default 8192; "
        "--small: 16)",
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
        help="comma list of test files of the correctness section; 'kernels': the Triton kernels' test files "
        f"({','.join(KERNEL_TEST_FILES)}) (default: %(default)s)",
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
    if not args.budget_s >= 0:  # also NaN
        parser.error(f"--budget_s must be a number of seconds >= 0 (0: no limit), got {args.budget_s}")
    if args.workers < 0:
        parser.error(f"--workers must be a number of processes >= 0 (0: none), got {args.workers}")
    chosen = [name for name in filter(None, args.sections.split(",")) if name not in set(args.skip.split(","))]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; accepted {','.join(SECTIONS)}")
    profiles = [p for p in args.profiles.split(",") if p]
    device = "cpu" if args.small else "cuda"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # before minutes of measurement, not after
    rules = tuple(args.rules.split(";")) if args.rules else RULES
    if args.small and set(chosen) & set(gpu_plan.PLAN_SECTIONS):
        # the plan's sections run the Triton kernels in this process: on a CPU only under the interpreter, which
        # Triton reads when it is first imported (the other sections' subprocesses get the variable as it was)
        os.environ["TRITON_INTERPRET"] = "1"
    started = time.time()
    budget_end = started + args.budget_s if args.budget_s > 0 else float("inf")

    def left() -> float:
        return budget_end - time.time()

    def plan(name: str) -> gpu_plan.Plan:
        # rows stop where a later correctness section's time box (at most half the budget) begins
        later = chosen[chosen.index(name) + 1 :]
        reserve = min(args.correctness_timeout, args.budget_s / 2) if "correctness" in later else 0.0
        return gpu_plan.make_plan(args.small, args.n, budget_end - reserve, out)

    topk = tuple(int(k) for k in args.topk.split(",")) if args.topk else ((4, 16) if args.small else gpu_plan.TOPK)
    runs = {
        "correctness": lambda: correctness(
            device,
            args.small,
            max(1.0, min(args.correctness_timeout, left() - 5)),
            out.with_suffix(".pytest.log"),
            args.fuzz_examples,
            tuple(filter(None, args.tests.split(","))),
            args.workers,
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
        "gate": lambda: gpu_plan.gate(plan("gate"), tuple(filter(None, args.gate_rules.split(";")))),
        "topk_sweep": lambda: gpu_plan.topk_sweep(plan("topk_sweep"), topk),
        "lm_table": lambda: gpu_plan.lm_table(plan("lm_table"), tuple(filter(None, args.lm_table_rules.split(";")))),
        "compact": lambda: gpu_plan.compact(plan("compact")),
        "trace": lambda: gpu_plan.trace(plan("trace")),
        "fallback": lambda: gpu_plan.fallback(plan("fallback")),
    }
    results: dict = {
        "environment": environment(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "small": args.small,
        "budget_s": args.budget_s,
        "correctness": {},
        "sections": chosen,
    }
    for name in chosen:
        if left() <= 0:
            results.setdefault("skipped", {})[name] = f"--budget_s {args.budget_s:g} s spent before it started"
            print(f"[gpu_bench] {name}: skipped, the budget is spent", file=sys.stderr, flush=True)
            continue
        print(f"[gpu_bench] {name} ... ({time.time() - started:.0f} s so far)", file=sys.stderr, flush=True)
        results[name] = runs[name]()
        problems = gpu_plan.section_problems(name, results[name])
        if problems:
            results.setdefault("problems", {})[name] = problems
            print(f"[gpu_bench] {name}: " + "; ".join(problems), file=sys.stderr, flush=True)
        out.write_text(json.dumps(results, indent=2))  # what is done so far is never lost
    results["seconds"] = round(time.time() - started, 1)
    out.write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 1 if results.get("problems") else 0


if __name__ == "__main__":
    sys.exit(main())
