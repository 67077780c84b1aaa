"""Build the testbed model (``trl_integration/demo/assets/testbed``) from the interpreter's own standard library.

What it does (``python scripts/train_testbed_model.py``; see ``docs/testbed.md``)
    1. Reads the docstrings and comments of the stdlib (``stdlib_texts`` of ``scripts/stdlib_corpus.py``) and
       splits them by a hash of the text (:func:`trl_integration.demo.stdlib_text.is_held_out`): the held-out
       texts (5%) are never trained on; the others are the corpus.
    2. Trains the byte-level BPE tokenizer on the corpus (``scripts/bpe_tokenizer.py``: 4096 ids, digits split).
    3. Pretrains a ``LlamaForCausalLM`` (2 layers, hidden 128, MLP 384, 4 heads, untied head: 1,475,200
       parameters) on the corpus by next-token prediction: each text is ``text + <eos>`` starting at position 0
       (as a prompt does), cut into pieces of at most ``--seq-len`` tokens; pieces are sorted by length and grouped
       into batches of at most ``--batch-tokens`` (padded) tokens, and the batch order is shuffled each epoch.
       AdamW with warm-up and cosine decay (``scripts/model_recipe.py``), gradient clipping at 1, for
       ``--steps`` steps.
    4. Measures the mean per-token loss on the held-out texts and saves fp32 safetensors, config, generation
       config, tokenizer, the free-text task's texts (:func:`trl_integration.demo.freetext.save_task_texts`) and
       ``build_info.json`` (Python version, corpus SHA-256, text count and characters, seed, steps, wall times,
       load average, losses, settings).

Reproducibility
    Everything is seeded. The same interpreter (hence the same standard library, hence the same corpus), the same
    torch and ``tokenizers`` builds, the same seed, thread count and ``--steps`` write the same ``model.safetensors``,
    ``tokenizer.json`` and configs, byte for byte; ``build_info.json`` differs in its wall times and load averages.
    Another Python version has another standard library, hence another corpus and another model:
    ``build_info.json`` records the version and the corpus SHA-256. ``--minutes`` stops the training early by wall
    clock, which makes the result depend on the machine's speed (``build_info.json`` says when it happened).

Usage (from a checkout: the script imports that checkout's ``trl_integration``, installed or not, and its sibling
modules in ``scripts/``)::

    python scripts/train_testbed_model.py                          # writes trl_integration/demo/assets/testbed
    python scripts/train_testbed_model.py --output /tmp/testbed    # somewhere else
    python scripts/train_testbed_model.py --max-files 20 --vocab-size 300 --steps 5 --output /tmp/t  # a smoke build
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(SCRIPTS.parent), str(SCRIPTS)]  # this checkout's package (installed or not), then this folder
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# this folder's modules
from bpe_tokenizer import train_bpe_tokenizer  # noqa: E402
from model_recipe import adamw_warmup_cosine, build_llama, optimizer_step, save_model_folder  # noqa: E402
from stdlib_corpus import corpus_sha256, stdlib_dir, stdlib_texts  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from trl_integration.demo.freetext import save_task_texts  # noqa: E402
from trl_integration.demo.stdlib_text import is_held_out  # noqa: E402
from trl_integration.demo.testbed import BUILD_INFO_FILE, TESTBED_DIR  # noqa: E402

__all__ = ["pieces", "length_batches", "parse_args", "main"]


def pieces(token_ids: list[list[int]], eos_id: int, seq_len: int) -> list[list[int]]:
    """Each text's ids plus EOS, cut into consecutive pieces of at most ``seq_len`` tokens (pieces of one token,
    which hold no next-token target, are dropped)."""
    out = []
    for ids in token_ids:
        ids = [*ids, eos_id]
        out.extend(ids[i : i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i : i + seq_len]) > 1)
    return out


def length_batches(sequences: list[list[int]], batch_tokens: int) -> list[list[int]]:
    """Indices of ``sequences`` grouped into batches of similar length: sorted by (length, index), then cut so that
    rows x longest row <= ``batch_tokens`` (a batch holds at least one row)."""
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * len(sequences[i]) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _tensors(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return input_ids, mask, labels


@torch.no_grad()
def held_out_loss(model, sequences: list[list[int]], pad_id: int, batch_tokens: int) -> float:
    """Mean next-token loss (nats per predicted token) of ``model`` over ``sequences``."""
    model.eval()
    total, count = 0.0, 0
    for batch in length_batches(sequences, batch_tokens):
        input_ids, mask, labels = _tensors([sequences[i] for i in batch], pad_id)
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
        targets = labels[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="sum")
        total += float(nll)
        count += int((targets != -100).sum())
    model.train()
    return total / max(1, count)


def parse_args(argv=None) -> argparse.Namespace:
    """The build's flags (``--help`` lists them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=TESTBED_DIR, help="folder to write (default: the bundle)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=900, help="optimisation steps (the schedule's length)")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="also stop after this many minutes of training (the result then depends on speed)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (part of what makes the bytes)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128, help="longest training piece in tokens")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per batch, at most")
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-files", type=int, default=None, help="read only the first N stdlib files (tests)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Build the testbed into ``--output``; returns what ``build_info.json`` holds."""
    args = parse_args(argv)
    if args.steps < 1:
        raise ValueError(f"--steps={args.steps} is not accepted: accepted an integer >= 1")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    progress = not args.no_progress
    load_before = os.getloadavg()
    start = time.perf_counter()

    texts = stdlib_texts(max_files=args.max_files, progress=progress)
    corpus = [t for t in texts if not is_held_out(t)]
    held_out = [t for t in texts if is_held_out(t)]
    corpus_seconds = time.perf_counter() - start
    print(
        f"corpus: {len(corpus):,} texts, {sum(map(len, corpus)):,} characters ({len(held_out):,} held out)", flush=True
    )

    tokenizer = train_bpe_tokenizer(corpus, vocab_size=args.vocab_size)
    backend = tokenizer.backend_tokenizer
    encode = lambda batch: [e.ids for e in backend.encode_batch(batch, add_special_tokens=False)]  # noqa: E731
    train_seqs = pieces(encode(corpus), tokenizer.eos_token_id, args.seq_len)
    held_out_seqs = pieces(encode(held_out), tokenizer.eos_token_id, args.seq_len)
    batches = length_batches(train_seqs, args.batch_tokens)
    tokenizer_seconds = time.perf_counter() - start - corpus_seconds
    n_tokens = sum(map(len, train_seqs))
    print(
        f"tokenizer: {len(tokenizer)} ids; {n_tokens:,} training tokens in {len(train_seqs):,} pieces, "
        f"{len(batches)} batches an epoch",
        flush=True,
    )

    torch.manual_seed(args.seed)
    model = build_llama(
        tokenizer,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        layers=args.layers,
        heads=args.heads,
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"LlamaForCausalLM: {n_params:,} parameters", flush=True)
    optimizer, scheduler = adamw_warmup_cosine(
        model, lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, max_steps=args.steps
    )

    history, loss_ema, steps_done, stopped_by, epoch = [], None, 0, "steps", 0
    order: list[int] = []
    train_start = time.perf_counter()
    model.train()
    bar = tqdm(range(args.steps), desc="pretraining", dynamic_ncols=True, disable=not progress)
    for step in bar:
        if not order:  # a new epoch: the batches in a fresh seeded order
            order = list(range(len(batches)))
            random.Random(f"testbed-{args.seed}-epoch-{epoch}").shuffle(order)
            epoch += 1
        input_ids, mask, labels = _tensors([train_seqs[i] for i in batches[order.pop()]], tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer_step(loss, model, optimizer, scheduler)
        steps_done = step + 1
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.3f}")
        if steps_done % 50 == 0 or steps_done == args.steps:
            history.append(
                {
                    "step": steps_done,
                    "train_loss_ema": round(loss_ema, 4),
                    "seconds": round(time.perf_counter() - train_start, 1),
                }
            )
        if args.minutes is not None and time.perf_counter() - train_start > 60 * args.minutes:
            stopped_by = "minutes"
            break
    bar.close()
    train_seconds = time.perf_counter() - train_start
    model.eval()
    eval_loss = (
        held_out_loss(model, held_out_seqs, tokenizer.pad_token_id, args.batch_tokens) if held_out_seqs else None
    )

    info = {
        "command": " ".join(["python scripts/train_testbed_model.py", *(sys.argv[1:] if argv is None else argv)]),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "stdlib": str(stdlib_dir()),
        "corpus_sha256": corpus_sha256(corpus),
        "corpus_texts": len(corpus),
        "corpus_characters": sum(map(len, corpus)),
        "held_out_texts": len(held_out),
        "training_tokens_per_epoch": n_tokens,
        "vocab_size": len(tokenizer),
        "parameters": n_params,
        "seed": args.seed,
        "threads": args.threads,
        "steps": steps_done,
        "stopped_by": stopped_by,
        "epochs": round(steps_done / len(batches), 2),
        "final_train_loss_ema": round(loss_ema, 4),
        "held_out_loss": None if eval_loss is None else round(eval_loss, 4),
        "wall_seconds": {
            "corpus": round(corpus_seconds, 1),
            "tokenizer_and_encoding": round(tokenizer_seconds, 1),
            "training": round(train_seconds, 1),
            "total": round(time.perf_counter() - start, 1),
        },
        "load_average_1min": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)},
        "versions": {"torch": torch.__version__, **_library_versions()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "output"},
        "history": history,
    }
    save_model_folder(model, tokenizer, args.output)
    save_task_texts(args.output, texts)
    (args.output / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.output.iterdir() if f.is_file())
    print(
        f"done: {steps_done} steps in {train_seconds:.0f}s (load {load_before[0]:.1f} at the start), "
        f"train loss {loss_ema:.3f}, held-out loss {info['held_out_loss']}; saved to {args.output} "
        f"({size / 2**20:.2f} MiB)",
        flush=True,
    )
    return info


def _library_versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


if __name__ == "__main__":
    main()
