#!/usr/bin/env python
"""LoRA + a colocated vLLM engine: after the trainer's weight sync, does the engine sample from the trainer's model?

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 python scripts/check_lora_sync.py

For each head structure (``--heads``: the checkpoint's tied LM head, and an untied copy of it whose ``lm_head.weight``
is a clone of the embedding matrix) and each adapter (``--cases``, :data:`CASES`), builds a
``SafeVocabGRPOTrainer(use_vllm=True, vllm_mode="colocate", peft_config=LoraConfig(...))`` on ``--model`` (default:
the ``smollm2-135m`` alias, fp32; trainers of one checkpoint share one engine, as in the real-engine tests), makes
the adapter change the model (LoRA B is zero-initialised: every trainable tensor that is all zeros gets
``N(0, --lora-std)``, every other one ``+ 0.05 std N(0, 1)``), runs the trainer's own weight sync
(``trainer.vllm_generation.sync_weights()``: trl's PEFT merge and renaming, the project's CPU reload), samples
``--max-tokens`` tokens of each prompt with the engine and scores the sampled tokens with the trainer
(``trainer.score_completion_tokens``: the safe head the loss uses, fp32). Prints, per case, max and mean
``|engine log p - trainer log p|`` (nats per token), and the same against two references that locate a gap:

* ``merged``: the PEFT model with its adapter merged (``merge_adapter``), a plain forward: what the sync pushes;
* ``unmerged``: the PEFT model's own forward (the adapter applied as a side branch), which the trainer must match.

Then the negative control: the first case again with ``merge_adapter`` made a no-op during the sync (the engine
gets the base weights, not the adapter's): its gap must be far above the 1e-4 target.

A case the trainer refuses (trl rejects an adapter on ``lm_head``) is reported with its error, a case whose sync fails
(PEFT's ``trainable_token_indices``: trl keeps ``token_adapter`` in the name) with vLLM's.

Measured on SmolLM2 (fp32; docs/real_model.md, "LoRA with vLLM"; record docs/data/real_model/lora_sync_smollm2.json):
at most 7.2e-5 nats wherever the engine can hold the trainer's model; 0.48 to 1.47 (max) for ``modules_to_save`` of a
tied head without ``ensure_weight_tying`` and 16.9 for a LoRA on its tied ``embed_tokens`` (the trainer warns at start
for both: ``trl_integration/grpo/tied_adapters.py``); 0.78 for the negative control. ``--model tiny``: under a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

for key, value in dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", RANK="0", LOCAL_RANK="0",
                       WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534").items():  # fmt: skip
    os.environ.setdefault(key, value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

#: The projections LoRA targets in every case (Llama's attention and MLP linears).
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: ``name -> LoraConfig keyword arguments`` (with ``r=8, lora_alpha=16``); ``proj`` first (the negative control's).
CASES: dict[str, dict] = {
    "proj": dict(target_modules=PROJECTIONS),
    "proj+save_embed_head": dict(target_modules=PROJECTIONS, modules_to_save=["embed_tokens", "lm_head"]),
    "proj+save_embed_head+tying": dict(
        target_modules=PROJECTIONS, modules_to_save=["embed_tokens", "lm_head"], ensure_weight_tying=True
    ),
    "proj+save_embed": dict(target_modules=PROJECTIONS, modules_to_save=["embed_tokens"]),
    "proj+save_embed+tying": dict(
        target_modules=PROJECTIONS, modules_to_save=["embed_tokens"], ensure_weight_tying=True
    ),
    "proj+save_head": dict(target_modules=PROJECTIONS, modules_to_save=["lm_head"]),
    "proj+save_head+tying": dict(target_modules=PROJECTIONS, modules_to_save=["lm_head"], ensure_weight_tying=True),
    "proj+lora_embed": dict(target_modules=[*PROJECTIONS, "embed_tokens"]),
    "proj+lora_embed+tying": dict(target_modules=[*PROJECTIONS, "embed_tokens"], ensure_weight_tying=True),
    "proj+lora_head": dict(target_modules=[*PROJECTIONS, "lm_head"]),
    # PEFT's trainable tokens (rows of the embedding matrix): the ids of the prompts' tokens
    "proj+tokens": dict(target_modules=PROJECTIONS, trainable_token_indices="prompts"),
}

PROMPTS = {
    "smollm2": [
        "The quick brown fox",
        "def fibonacci(n):",
        "The capital of France is",
        "Water boils at",
        "Once upon a time, there was",
        "What is 13+29? The answer is",
        "import numpy as np\n",
        "The best way to learn a language is",
    ],
    "tiny": ["37+48=", "5-71=", "4+7=", "587-926=", "12+9=", "300-1=", "8-9=", "65+65="],
}


def resolve_model(name: str) -> str:
    """A folder for ``name``: the ``smollm2-135m`` alias, ``tiny`` (the bundled tiny model), or a local folder."""
    if name == "tiny":
        from trl_integration.demo import tiny_model_path

        return str(tiny_model_path())
    if name == "smollm2-135m":
        from trl_integration.demo.model_alias import model_alias_path

        return str(model_alias_path(name))
    return name


def with_heads(path: str, tied: bool, folder: Path) -> str:
    """``path`` if its LM head is already tied (``tied``) or untied (not ``tied``), else a copy saved under ``folder``
    whose head is tied to the embeddings, or untied (``lm_head.weight`` a clone of the embedding matrix)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if bool(AutoConfig.from_pretrained(path).tie_word_embeddings) == tied:
        return path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.tie_word_embeddings = tied
    if tied:
        model.tie_weights()
    else:
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    out = folder / ("tied" if tied else "untied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return str(out)


def perturb_adapter(model, lora_std: float, seed: int = 0) -> int:
    """Make the adapter change the model: every trainable tensor that is all zeros (LoRA B, an embedding LoRA's A)
    gets ``N(0, lora_std)``, every other one (LoRA A, a ``modules_to_save`` copy) ``+ 0.05 std N(0, 1)``.
    Returns the number of tensors changed."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for _, param in model.named_parameters():
            if not param.requires_grad:
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if not param.any():
                param.copy_(lora_std * noise)
            else:
                param.add_(0.05 * param.float().std() * noise)
            count += 1
    return count


def engine_rollouts(trainer, prompts: list[str]) -> tuple[list, list, list]:
    """Sample one completion of each prompt with the trainer's engine (no sync): ``(prompt_ids, completion_ids,
    the engine's log-probs of the sampled tokens)``."""
    ids = trainer.processing_class(text=prompts)["input_ids"]
    prompt_ids, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
        prompts=ids, images=None, num_generations=1
    )
    return prompt_ids, completion_ids, [[lp[0] for lp in seq] for seq in logprobs]


def trainer_logprobs(trainer, prompt_ids, completion_ids):
    """The trainer's fp32 log-probabilities of the completion tokens (its loss's scoring path, one sequence at a
    time, no padding), concatenated."""
    import torch

    out = []
    with torch.no_grad():
        for p, c in zip(prompt_ids, completion_ids, strict=True):
            ids = torch.tensor([list(p) + list(c)])
            logps, _, _ = trainer.score_completion_tokens(trainer.model, ids, torch.ones_like(ids), len(c))
            out.append(logps[0].float())
    return torch.cat(out)


def forward_logprobs(model, rule, temperature, prompt_ids, completion_ids):
    """Plain-forward log-probabilities of the completion tokens under ``model``, renormalised over ``rule``'s set as
    the engine's processed log-probabilities are, concatenated."""
    import torch

    from safevocab import safe_log_softmax

    out = []
    with torch.no_grad():
        for p, c in zip(prompt_ids, completion_ids, strict=True):
            logits = model(torch.tensor([list(p) + list(c)])).logits[0, len(p) - 1 : len(p) + len(c) - 1].float()
            out.append(safe_log_softmax(logits, torch.tensor(list(c)), rule, temperature=temperature).logprobs)
    return torch.cat(out)


def gap(a, b) -> dict[str, float]:
    delta = (a - b).abs()
    return {"max": float(delta.max()), "mean": float(delta.mean())}


class _NoMerge:
    """While active, ``merge_adapter``/``unmerge_adapter`` of a PEFT model do nothing (the sync pushes base weights)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.merge_adapter = lambda *a, **k: None
        self.model.unmerge_adapter = lambda *a, **k: None

    def __exit__(self, *exc):
        del self.model.merge_adapter, self.model.unmerge_adapter


def measure_case(path: str, case: str, prompts: list[str], args, output_dir: str, no_merge: bool = False) -> dict:
    """One trainer on ``path`` with adapter :data:`CASES` ``[case]``: the gaps after the sync (see the module)."""
    import torch
    from peft import LoraConfig

    from trl_integration import SafeVocabGRPOTrainer
    from trl_integration.demo import arithmetic_reward, make_dataset, tiny_grpo_config
    from trl_integration.grpo.tied_adapters import tied_adapter_issue

    settings = copy.deepcopy(CASES[case])  # PEFT edits the lists it is given (modules_to_save with ensure_weight_tying)
    if settings.get("trainable_token_indices") == "prompts":
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(path)(text=prompts)["input_ids"]
        settings["trainable_token_indices"] = sorted({t for seq in ids for t in seq})
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer = SafeVocabGRPOTrainer(
                model=path,
                reward_funcs=arithmetic_reward,
                args=tiny_grpo_config(
                    output_dir=output_dir,
                    use_vllm=True,
                    vllm_mode="colocate",
                    vllm_gpu_memory_utilization=0.1,
                    per_device_train_batch_size=len(prompts),
                    num_generations=len(prompts),
                    max_completion_length=args.max_tokens,
                    safe_vocab_rule=args.rule,
                    seed=0,
                ),  # fmt: skip
                train_dataset=make_dataset(8, seed=0, split="train"),
                peft_config=config,
            )
        except ValueError as error:
            return {"refused": str(error).split("\n")[0]}
    notes = sorted({str(w.message).split(". ")[0] for w in caught if "tie" in str(w.message).lower()})
    model = trainer.model
    perturb_adapter(model, args.lora_std)
    try:
        with _NoMerge(model) if no_merge else contextlib.nullcontext():
            trainer.vllm_generation.sync_weights()
    except ValueError as error:  # a name the engine does not know (PEFT's trainable tokens)
        return {"sync_failed": str(error).split("\n")[0]}
    prompt_ids, completion_ids, engine = engine_rollouts(trainer, prompts)
    engine = torch.tensor([x for seq in engine for x in seq])
    trained = trainer_logprobs(trainer, prompt_ids, completion_ids)
    rule, temperature = trainer.safe_vocab_rule, trainer.temperature
    unmerged = forward_logprobs(model, rule, temperature, prompt_ids, completion_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.merge_adapter()
        try:
            merged = forward_logprobs(model, rule, temperature, prompt_ids, completion_ids)
        finally:
            model.unmerge_adapter()
    base = trainer.accelerator.unwrap_model(model).get_base_model()
    result = {
        "tokens": int(engine.numel()),
        "engine_vs_trainer": gap(engine, trained),
        "engine_vs_merged": gap(engine, merged),
        "trainer_vs_unmerged": gap(trained, unmerged),
        "merged_vs_unmerged": gap(merged, unmerged),
        "tied_in_trainer": base.get_output_embeddings().weight is base.get_input_embeddings().weight,
        "peft_tying_warnings": notes,
        "start_warning": tied_adapter_issue(model) is not None,
    }
    del trainer, model, base
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, or a local folder")
    parser.add_argument("--heads", default="tied,untied", help="comma-separated: tied, untied (default both)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated among {', '.join(CASES)}")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens sampled per prompt (default 16)")
    parser.add_argument("--rule", default="min_p=0.001", help="safe_vocab_rule (default min_p=0.001)")
    parser.add_argument("--lora-std", type=float, default=0.02, help="std of the zero-initialised tensors' values")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    import trl.generation.vllm_generation as vllm_generation

    path = resolve_model(args.model)
    prompts = PROMPTS["tiny" if args.model == "tiny" else "smollm2"]
    built: dict[tuple, object] = {}
    build = vllm_generation.LLM

    def shared(*pargs, **kwargs):  # one engine per (checkpoint, dtype), as in the real-engine tests
        key = (kwargs.get("model"), str(kwargs.get("dtype", "auto")))
        if key not in built:
            built[key] = build(*pargs, **kwargs)
        return built[key]

    vllm_generation.LLM = shared
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for heads in args.heads.split(","):
            folder = with_heads(path, heads == "tied", Path(tmp))
            for case in args.cases.split(","):
                result = measure_case(folder, case, prompts, args, f"{tmp}/run")
                results[f"{heads}/{case}"] = result
                print(f"{heads}/{case}: {json.dumps(result)}", flush=True)
            first = args.cases.split(",")[0]
            result = measure_case(folder, first, prompts, args, f"{tmp}/run", no_merge=True)
            results[f"{heads}/{first} (merge disabled)"] = result
            print(f"{heads}/{first} (merge disabled): {json.dumps(result)}", flush=True)
    if args.json:
        import peft
        import torch
        import transformers
        import trl
        import vllm

        record = {
            "model": args.model,
            "settings": {"max_tokens": args.max_tokens, "rule": args.rule, "lora_std": args.lora_std, "r": 8},
            "versions": {m.__name__: m.__version__ for m in (torch, vllm, transformers, trl, peft)},
            "cases": results,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(f"\n{path}: |engine log p - trainer log p| per sampled token (nats), max / mean")
    for name, result in results.items():
        if "refused" in result or "sync_failed" in result:
            print(f"  {name:40s} {'refused' if 'refused' in result else 'sync failed'}: {[*result.values()][0]}")
        else:
            g = result["engine_vs_trainer"]
            print(f"  {name:40s} {g['max']:.3g} / {g['mean']:.3g}  ({result['tokens']} tokens)")
    return results


if __name__ == "__main__":
    main()
