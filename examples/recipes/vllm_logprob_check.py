"""Measure a colocated vLLM engine against the trainer: per-token log-probabilities of the same sampled tokens.

Builds ``SafeVocabGRPOTrainer(use_vllm=True, vllm_mode="colocate")`` on the bundled tiny model (trl builds the real
engine), trains ``--steps`` GRPO steps (weights synced into the engine every step), syncs the final weights, samples
``--prompts`` x 4 completions with the engine and prints, over every sampled token:

* ``max |engine - safe head|``: vLLM's processed log-probs vs the trainer's safe log-probs ``log pi_S`` (the rule);
* ``max |engine - stock head|``: vs trl's full log-softmax, which differs by ``log(kept mass)`` (trl#6789);
* ``max |engine - (stock - log kept mass)|``: the same offset, accounted for.

Run with the vLLM venv (docs/vllm.md)::

    VLLM_CPU_KVCACHE_SPACE=1 python examples/recipes/vllm_logprob_check.py --rule top_k=3,min_p=0.05
    VLLM_CPU_KVCACHE_SPACE=1 python examples/recipes/vllm_logprob_check.py --dtype bfloat16   # bf16 engine
"""

from __future__ import annotations

import argparse
import tempfile

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rule", default="top_k=3,min_p=0.05", help="safe_vocab_rule (also the sampler's rule)")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps before the measurement")
    parser.add_argument("--prompts", type=int, default=64, help="prompts sampled 4 times each for the measurement")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="checkpoint (= engine) dtype"
    )
    cli = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from safevocab import safe_log_softmax
    from trl_integration import SafeVocabGRPOTrainer
    from trl_integration.demo import arithmetic_reward, make_dataset, tiny_grpo_config, tiny_model_path

    work = tempfile.mkdtemp(prefix="vllm-check-")
    model_path = str(tiny_model_path())
    if cli.dtype != "float32":  # the engine runs in the checkpoint's dtype; the trainer stays in fp32
        model_path = f"{work}/checkpoint-{cli.dtype}"
        AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=getattr(torch, cli.dtype)).save_pretrained(
            model_path
        )
        AutoTokenizer.from_pretrained(str(tiny_model_path())).save_pretrained(model_path)
    args = tiny_grpo_config(
        output_dir=f"{work}/run", use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
        max_steps=cli.steps, per_device_train_batch_size=16, num_generations=4, safe_vocab_rule=cli.rule,
        model_init_kwargs={"dtype": "float32"},
    )  # fmt: skip
    trainer = SafeVocabGRPOTrainer(
        model=model_path, reward_funcs=arithmetic_reward, args=args, train_dataset=make_dataset(256, seed=0)
    )
    trainer.train()

    trainer.vllm_generation.sync_weights()
    problems = make_dataset(cli.prompts, seed=1, split="test")["prompt"]
    ids = trainer.processing_class(text=[p for p in problems for _ in range(4)])["input_ids"]
    prompt_ids, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
        prompts=ids, images=None, num_generations=1
    )

    engine, safe, stock, log_kept = [], [], [], []
    with torch.no_grad():
        for p, c, lp in zip(prompt_ids, completion_ids, logprobs):
            logits = trainer.model(torch.tensor([list(p) + list(c)])).logits[0, len(p) - 1 : len(p) + len(c) - 1]
            targets = torch.tensor(list(c))
            out = safe_log_softmax(logits.float(), targets, trainer.safe_vocab_rule, temperature=trainer.temperature)
            full = (logits.float() / trainer.temperature).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
            engine.append(torch.tensor([x[0] for x in lp]))
            safe.append(out.logprobs)
            stock.append(full)
            log_kept.append(out.log_kept_mass)
    engine, safe, stock, log_kept = (torch.cat(t) for t in (engine, safe, stock, log_kept))
    print(f"engine dtype {cli.dtype}, trainer fp32, rule {trainer.safe_vocab_rule}, {engine.numel()} tokens")
    print(f"max |engine - safe head|                  = {(engine - safe).abs().max().item():.3g}")
    print(f"mean |engine - safe head|                 = {(engine - safe).abs().mean().item():.3g}")
    print(f"max |engine - stock head|                 = {(engine - stock).abs().max().item():.3g}")
    print(f"max |engine - (stock - log kept mass)|    = {(engine - (stock - log_kept)).abs().max().item():.3g}")
    print(f"mean log kept mass                        = {log_kept.mean().item():.3g}")


if __name__ == "__main__":
    main()
