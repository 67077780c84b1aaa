"""A real GRPO run where the response length surges, with the length-decay LR schedule in auto mode.

What it shows: the surge detector watching ``completions/mean_length`` step by step, firing once when
the length jumps, and ``LengthDecayLR`` halving the LR every ``round(1.8 x surge step)`` steps
afterwards. To make a surge happen within a couple of minutes on a CPU, the reward pays for length
(the number of characters generated), so the policy learns to postpone its end-of-sequence token.

    python examples/length_decay_run.py                     # bundled tiny model, writes runs/length_decay/
    python examples/length_decay_run.py --steps 200 --model path/to/model --out_dir /tmp/ld
    python examples/length_decay_run.py --steps 180 --docs_image   # the figure of docs/length_decay.md

Writes ``length_decay.png`` (mean length and LR per step, surge and trigger marked) and
``length_decay.json`` (the per-step series and the detector's decision) to ``--out_dir`` (default
``runs/length_decay`` under the current directory), or, with ``--docs_image``, to the repository's ``docs/img/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

#: Where the figure and the series go by default (relative to the current directory).
DEFAULT_OUT_DIR = "runs/length_decay"
#: The repository's docs image folder (``--docs_image``): the figure docs/length_decay.md shows.
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


def length_reward(completions, **kwargs):
    """Characters generated: rewards postponing the end-of-sequence token."""
    return [float(len(c)) for c in completions]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the bundled tiny model)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--max_completion_length", type=int, default=24)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out_dir", default=DEFAULT_OUT_DIR,
                       help=f"folder for length_decay.png and length_decay.json (default: {DEFAULT_OUT_DIR})")  # fmt: skip
    where.add_argument("--docs_image", action="store_true",
                       help=f"write them into the repository's docs/img/ instead ({DOCS_IMG}), replacing the figure "
                       "docs/length_decay.md shows")  # fmt: skip
    args = parser.parse_args(argv)
    if args.docs_image:
        args.out_dir = str(DOCS_IMG)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trl_integration import SafeVocabGRPOTrainer
    from trl_integration.demo import make_dataset, tiny_grpo_config, tiny_model_path

    model = str(tiny_model_path()) if args.model is None else args.model
    dataset = make_dataset(256, seed=args.seed, split="train").select_columns(["prompt"])

    with tempfile.TemporaryDirectory() as tmp:
        # the tiny demo job, one prompt x 8 completions per step, logged every step
        config = tiny_grpo_config(
            output_dir=tmp,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            max_completion_length=args.max_completion_length,
            learning_rate=args.learning_rate,
            logging_steps=1,
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            seed=args.seed,
            safe_vocab_rule="min_p=0.01",
            lr_scheduler_type="constant",  # the LR held until the surge (trl's default schedule is linear decay)
            length_decay=True,
            length_decay_period="auto",
            length_surge_window=5,
            length_surge_baseline_window=15,
            length_surge_warmup=10,
        )
        trainer = SafeVocabGRPOTrainer(model=model, reward_funcs=length_reward, args=config, train_dataset=dataset)
        trainer.train()

    history = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    steps = [h["step"] for h in history]
    lengths = [h["completions/mean_length"] for h in history]
    lrs = [h["learning_rate"] for h in history]  # the LR each optimizer step used
    detector = trainer.lr_scheduler.detector
    result = {
        "command": " ".join(["python examples/length_decay_run.py", *(sys.argv[1:] if argv is None else argv)]),
        "steps": steps,
        "mean_length": lengths,
        "lr": lrs,
        "surge_step": detector.surge_step,
        "detected_at": detector.detected_at,
        "decay_period": trainer.lr_scheduler.decay_period if trainer.lr_scheduler.decay_active else None,
    }

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax_len, ax_lr) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax_len.plot(steps, lengths, color="tab:blue")
    ax_len.set_ylabel("mean completion length\n(tokens)")
    ax_lr.plot(steps, lrs, color="tab:red")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    for ax in (ax_len, ax_lr):
        if detector.surge_step is not None:
            ax.axvline(
                detector.surge_step, color="gray", ls="--", lw=1, label=f"surge starts (step {detector.surge_step})"
            )
            ax.axvline(
                detector.detected_at, color="black", ls=":", lw=1, label=f"detected (step {detector.detected_at})"
            )
    if detector.surge_step is not None:
        ax_len.legend(loc="lower right", fontsize=8)
        title = f"surge at step {detector.surge_step} -> decay period {result['decay_period']}"
    else:
        title = "no surge detected"
    fig.suptitle(f"Length-decay LR, auto mode: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "length_decay.png", dpi=110)
    (out_dir / "length_decay.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("steps", "mean_length", "lr")}))
    return result


if __name__ == "__main__":
    main()
