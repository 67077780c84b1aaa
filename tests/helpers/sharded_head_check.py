"""Check the safe LM head under a sharded model: the same log-probabilities and gradients as the unsharded model.

What it shows: :func:`trl_integration.grpo.head.add_safe_lm_head` (the head ``SafeVocabGRPOTrainer`` installs)
computes ``log pi_S`` and its gradients correctly when the model is sharded across processes:

- ``--mode fsdp2`` (CPU with gloo, or GPUs): ``torch.distributed.fsdp.fully_shard`` on every decoder layer and
  on the root, as accelerate's FSDP2 plugin does. ``--head`` picks where the LM head's parameters live: ``root``
  (in the root's group: FSDP's own hooks unshard them around the model's forward and again before its backward)
  or ``separate`` (its own ``fully_shard`` group, never called as a module, so the head reads a sharded
  ``DTensor`` and gathers it with ``full_tensor()``, exactly as trl's fused head does; the gather's backward
  reduce-scatters the weight gradient).
- ``--mode zero3`` (needs DeepSpeed, and an accelerator DeepSpeed supports): ``deepspeed.initialize`` with ZeRO
  stage 3. The head gathers the partitioned weight with trl's ``maybe_gather_lm_head_ctx`` around its forward,
  and the fused backward, which recomputes the logits from the weight after that context has exited, gathers it
  again through ``fused_safe_logprobs(..., weight_gather=...)``.

Every process also computes the reference on an unsharded copy of the model over the whole global batch. Each
process scores its slice of the batch with loss ``P x (-sum log pi_S) / N_global`` (data-parallel gradients
are averaged over the ``P`` processes), so the averaged gradient equals the reference's ``-sum log pi_S /
N_global`` gradient.

Run::

    torchrun --nproc_per_node 2 tests/helpers/sharded_head_check.py --mode fsdp2 --out /tmp/h   # both placements
    deepspeed --num_gpus 2 tests/helpers/sharded_head_check.py --mode zero3 --out /tmp/h      # GPUs

Each rank writes ``<out>/<mode>-<head>-rank<r>.json`` with the largest differences (``logp_max_abs_diff``,
``grad_max_rel_diff`` over all parameters) and exits non-zero when they exceed the tolerance.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RULE = "min_p=0.05"
TOLERANCE = 1e-4  # fp32: relative gradient differences here are ~1e-6 (reduction order), errors are O(1)


def make_batch(vocab_size: int, global_batch: int, seq_len: int, seed: int = 0):
    """``(input_ids, attention_mask, labels)`` of the global batch: random tokens, right padding of varied length
    (padding is labelled -100 and masked), the first 3 positions unscored like a prompt."""
    import torch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (global_batch, seq_len), generator=g)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (global_batch,), generator=g)
    attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :3] = -100
    return input_ids, attention_mask, labels


def safe_forward(model, input_ids, attention_mask, labels):
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return out.log_probs, out.label_mask


def full_grad(param):
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if grad is None:
        return None
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def run_sharded(args, head, base, rule, device, rank, world, batch, n_global, ref_logps, ref_grads) -> dict:
    """One sharded copy of ``base`` (``head``: FSDP2 placement of the LM head, or ``"zero3"``) scoring this
    process's slice of ``batch``; the differences to the reference."""
    import torch

    from trl_integration.grpo.head import add_safe_lm_head

    input_ids, attention_mask, labels = batch
    rows = slice(rank * args.global_batch // world, (rank + 1) * args.global_batch // world)
    model = copy.deepcopy(base).to(device)
    add_safe_lm_head(model, rule)  # before sharding, as SafeVocabGRPOTrainer patches before accelerate wraps
    if args.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if head == "separate":
            fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        engine = model
    else:
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        config = {
            "train_micro_batch_size_per_gpu": args.global_batch // world,
            "gradient_accumulation_steps": 1,
            # Partition every parameter (no small-parameter persistence), so the head is partitioned too.
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
        }
        # What the Trainer does under ZeRO-3: transformers' is_deepspeed_zero3_enabled() (read by trl's
        # maybe_gather_lm_head_ctx and by the safe head) looks at this object; keep a reference while it is used.
        hf_ds_config = HfDeepSpeedConfig(config)  # noqa: F841
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    logps, mask = safe_forward(engine, input_ids[rows], attention_mask[rows], labels[rows])
    loss = -(logps * mask).sum() / n_global * world
    if args.mode == "fsdp2":
        loss.backward()
        grads = {name: full_grad(p) for name, p in model.named_parameters()}
    else:
        from deepspeed.utils import safe_get_full_grad

        engine.backward(loss)
        grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}

    logp_diff = float(((logps - ref_logps[rows]) * mask).abs().max().detach())
    grad_diffs = {}
    for name, ref in ref_grads.items():
        got = grads.get(name.removeprefix("module."))
        if got is None:
            grad_diffs[name] = float("inf")
            continue
        grad_diffs[name] = float((got.to(ref) - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
    worst = max(grad_diffs, key=grad_diffs.get)
    result = {
        "mode": args.mode,
        "head": head,
        "world_size": world,
        "logp_max_abs_diff": logp_diff,
        "grad_max_rel_diff": grad_diffs[worst],
        "worst_param": worst,
        "head_grad_rel_diff": grad_diffs["lm_head.weight"],
        "head_grad_norm": float(ref_grads["lm_head.weight"].norm()),
        "scored_tokens": n_global,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["fsdp2", "zero3"], default="fsdp2")
    parser.add_argument(
        "--head", choices=["root", "separate", "both"], default="both", help="fsdp2: the LM head's shard group"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=12)
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import trl_integration.grpo.head as lm_head_module
    from safevocab import parse_rule
    from trl_integration.demo.model import tiny_model_path
    from trl_integration.grpo.head import add_safe_lm_head

    # Count which sharded-head path ran: DTensor gathers (FSDP2, head in its own group) and backward re-gathers
    # (ZeRO-3 weight_gather hook entered by the fused backward).
    calls = {"dtensor_gathers": 0, "backward_gathers": 0}
    gather_dtensor, backward_gather = lm_head_module._gather_data_parallel, lm_head_module._backward_gather

    def counting_gather_dtensor(param):
        calls["dtensor_gathers"] += 1
        return gather_dtensor(param)

    def counting_backward_gather(*a):
        factory = backward_gather(*a)
        if factory is None:
            return None

        def entered():
            calls["backward_gathers"] += 1
            return factory()

        return entered

    lm_head_module._gather_data_parallel = counting_gather_dtensor
    lm_head_module._backward_gather = counting_backward_gather

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if args.mode == "zero3":
        import deepspeed

        deepspeed.init_distributed()
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.global_batch % world:
        raise ValueError(f"--global_batch {args.global_batch} is not divisible by {world} processes")

    rule = parse_rule(RULE)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32)
    batch = [t.to(device) for t in make_batch(base.config.vocab_size, args.global_batch, args.seq_len)]
    input_ids, attention_mask, labels = batch
    n_global = int((labels[:, 1:] != -100).sum())

    # Reference: the unsharded model over the whole global batch.
    reference = copy.deepcopy(base).to(device)
    add_safe_lm_head(reference, rule)
    ref_logps, ref_mask = safe_forward(reference, input_ids, attention_mask, labels)
    (-(ref_logps * ref_mask).sum() / n_global).backward()
    ref_logps = ref_logps.detach()
    ref_grads = {name: p.grad.detach().clone() for name, p in reference.named_parameters()}

    heads = ["root", "separate"] if args.head == "both" else [args.head]
    failed = False
    for head in heads if args.mode == "fsdp2" else ["zero3"]:
        calls.update(dtensor_gathers=0, backward_gathers=0)
        result = run_sharded(args, head, base, rule, device, rank, world, batch, n_global, ref_logps, ref_grads)
        result.update(calls)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.mode}-{head}-rank{rank}.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result), flush=True)
        failed |= not (result["logp_max_abs_diff"] <= TOLERANCE and result["grad_max_rel_diff"] <= TOLERANCE)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
