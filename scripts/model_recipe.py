"""What the demo's two small models share: the Llama they are, the optimiser and schedule, and how they are saved.

Both the tiny arithmetic model (``scripts/train_tiny_model.py``) and the testbed (``scripts/train_testbed_model.py``)
are a ``LlamaForCausalLM`` with RoPE (so left padding does not change outputs) and an untied LM head, trained with
AdamW (no decay on vectors) under a linear warm-up and a cosine decay to 10% of the peak learning rate:

    lr(step) = lr * (step + 1) / warmup                                   for step < warmup
    lr(step) = lr * (0.1 + 0.9 * (1 + cos(pi * min(1, (step - warmup) / (max_steps - warmup)))) / 2)  after

A module of the build scripts, not of the package: the scripts put ``scripts/`` on ``sys.path`` to import it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from trl_integration.demo.tokenizer import write_portable_tokenizer_class

__all__ = ["build_llama", "adamw_warmup_cosine", "optimizer_step", "save_model_folder"]


def build_llama(
    tokenizer,
    *,
    hidden_size: int,
    intermediate_size: int,
    layers: int,
    heads: int,
    max_position_embeddings: int = 512,
):
    """A ``LlamaForCausalLM`` (RoPE, untied LM head, fp32) for ``tokenizer``, with its special ids in the config
    and the generation config (so ``generate`` stops at EOS and pads with the pad token)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        # RoPE has no learned positions: this only bounds the context engines allocate (vLLM's max_model_len).
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model


def adamw_warmup_cosine(
    model: torch.nn.Module, *, lr: float, weight_decay: float, warmup_steps: int, max_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (betas 0.9, 0.98; weight decay on matrices only) and the warm-up + cosine schedule above."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        (no_decay if param.ndim < 2 else decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def optimizer_step(
    loss: torch.Tensor, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, max_grad_norm: float = 1.0
) -> None:
    """One update of both recipes: backward of ``loss``, gradients clipped to ``max_grad_norm``, AdamW, schedule."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()


def save_model_folder(model, tokenizer, folder: Path) -> int:
    """Save ``model`` (fp32 safetensors, config, generation config) and ``tokenizer`` to ``folder``; the size in
    bytes of the folder's files afterwards.

    ``tokenizer_config.json`` names the generic ``PreTrainedTokenizerFast`` class: transformers 5 writes its own
    name for it (``TokenizersBackend``), which transformers 4 (e.g. alongside vLLM) cannot load.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    write_portable_tokenizer_class(folder / "tokenizer_config.json")
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
