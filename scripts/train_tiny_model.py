"""Build and train the bundled tiny arithmetic model (``trl_integration/demo/assets/tiny-arith``), on a CPU, offline.

What it does
    1. Builds the character-level tokenizer of :mod:`trl_integration.demo.tokenizer` (one token per character,
       no automatic BOS).
    2. Builds a small ``LlamaForCausalLM`` (RoPE, so left padding does not change its outputs; untied LM head).
    3. Trains it with supervised next-token prediction on ``prompt + answer + <eos>`` from the train split of
       :mod:`trl_integration.demo.arithmetic` (the loss covers the answer and EOS tokens only), on a fresh
       stream of problems, with AdamW and a warmup + cosine learning rate.
    4. Stops early, on purpose, at the first evaluation where greedy accuracy on a validation set (train-split
       problems held out from the training stream) reaches ``--stop-at``: the model is meant to be *partly*
       right, so that GRPO has a reward signal and room to improve.
    5. Reports greedy and sampled (temperature 1) accuracy on the test split and saves model, tokenizer,
       generation config and ``train_info.json`` (settings, time, accuracies) with ``save_pretrained``
       (safetensors, float32).

Everything is seeded: the same command on the same torch build reproduces the same weights.

Usage (from a checkout: the script imports that checkout's ``trl_integration``, installed or not, and its sibling
``scripts/model_recipe.py``; see ``docs/tiny_model.md``)::

    python scripts/train_tiny_model.py                         # writes trl_integration/demo/assets/tiny-arith
    python scripts/train_tiny_model.py --output-dir /tmp/tiny  # somewhere else
    python scripts/train_tiny_model.py --no-save               # train and report only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(SCRIPTS.parent), str(SCRIPTS)]  # this checkout's package (installed or not), then this folder
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# this folder's module
from model_recipe import adamw_warmup_cosine, build_llama, optimizer_step, save_model_folder  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from trl_integration.demo.arithmetic import accuracy, make_dataset, sample_problems  # noqa: E402
from trl_integration.demo.model import TINY_MODEL_DIR  # noqa: E402
from trl_integration.demo.tokenizer import build_tokenizer  # noqa: E402

__all__ = ["build_model", "encode_batch", "parse_args", "main"]

DEFAULT_OUTPUT = TINY_MODEL_DIR


def build_model(tokenizer, args):
    """A small ``LlamaForCausalLM`` (RoPE, untied LM head) sized by ``args`` for ``tokenizer``.

    The context bound (``max_position_embeddings`` 512) sits well above any prompt + completion of the task,
    including trl's default 256 new tokens.
    """
    return build_llama(
        tokenizer,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        layers=args.layers,
        heads=args.heads,
        max_position_embeddings=512,
    )


def encode_batch(problems, vocab, pad_id, eos_id):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on prompt and padding)."""
    rows = []
    for prompt, answer in problems:
        p = [vocab[c] for c in prompt]
        a = [vocab[c] for c in answer] + [eos_id]
        rows.append((p + a, [-100] * len(p) + a))
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return input_ids, mask, labels


def parse_args(argv=None) -> argparse.Namespace:
    """The training flags (``--help`` lists them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=2000, help="upper bound on optimisation steps")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=50, help="steps between validation evaluations")
    parser.add_argument("--val-size", type=int, default=300)
    parser.add_argument(
        "--stop-at", type=float, default=0.4, help="stop at the first validation greedy accuracy >= this (1 disables)"
    )
    parser.add_argument("--test-size", type=int, default=1000, help="test-split prompts for the final report")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-save", action="store_true", help="train and report without writing the model")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Train (and, unless ``--no-save``, save) the tiny model; returns what ``train_info.json`` holds."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.use_deterministic_algorithms(True)

    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    model = build_model(tokenizer, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"LlamaForCausalLM: {n_params:,} parameters, vocab {len(tokenizer)}", flush=True)

    # Validation: train-split problems, excluded from the training stream, used only for the stopping rule.
    val = make_dataset(args.val_size, seed=args.seed + 1_000_003, split="train")
    val_prompts = set(val["prompt"])
    test = make_dataset(args.test_size, seed=args.seed, split="test")
    stream = random.Random(f"train-stream-{args.seed}")

    # Sanity: the fast path used for training encodes exactly like the tokenizer.
    probe = sample_problems(8, random.Random(0))
    for prompt, answer in probe:
        assert tokenizer(prompt + answer)["input_ids"] == [vocab[c] for c in prompt + answer]

    optimizer, scheduler = adamw_warmup_cosine(
        model, lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, max_steps=args.max_steps
    )

    history = []
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(args.max_steps), desc="training", dynamic_ncols=True)
    val_acc = None
    steps_done = 0
    loss_ema = None
    for step in bar:
        problems = []
        while len(problems) < args.batch_size:
            batch = sample_problems(args.batch_size - len(problems), stream, "train")
            problems.extend(p for p in batch if p[0] not in val_prompts)
        input_ids, mask, labels = encode_batch(problems, vocab, tokenizer.pad_token_id, tokenizer.eos_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer_step(loss, model, optimizer, scheduler)
        steps_done = step + 1
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        if steps_done % args.eval_every == 0 or steps_done == args.max_steps:
            val_acc = accuracy(model, tokenizer, val)
            history.append({"step": steps_done, "loss": round(loss_ema, 4), "val_greedy": val_acc})
            model.train()
        bar.set_postfix(loss=f"{loss_ema:.3f}", val_greedy="-" if val_acc is None else f"{val_acc:.3f}")
        if val_acc is not None and history[-1]["step"] == steps_done and val_acc >= args.stop_at:
            break
    bar.close()
    train_seconds = time.perf_counter() - start
    model.eval()

    greedy = accuracy(model, tokenizer, test)
    sampled = accuracy(model, tokenizer, test, do_sample=True, temperature=1.0, seed=args.seed)
    info = {
        "command": " ".join(["python scripts/train_tiny_model.py", *(sys.argv[1:] if argv is None else argv)]),
        "seed": args.seed,
        "steps": steps_done,
        "train_seconds": round(train_seconds, 1),
        "parameters": n_params,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "output_dir"},
        "validation_history": history,
        "test_size": len(test),
        "test_greedy_accuracy": greedy,
        "test_sampled_accuracy_T1": sampled,
        "torch": torch.__version__,
    }
    print(
        f"done: {steps_done} steps in {train_seconds:.1f}s; test (n={len(test)}) greedy accuracy {greedy:.3f}, "
        f"sampled (T=1) accuracy {sampled:.3f}",
        flush=True,
    )
    if not args.no_save:
        save_model_folder(model, tokenizer, args.output_dir)
        (args.output_dir / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
        size = sum(f.stat().st_size for f in args.output_dir.iterdir() if f.is_file())
        print(f"saved to {args.output_dir} ({size / 2**20:.2f} MiB)", flush=True)
    return info


if __name__ == "__main__":
    main()
