"""The composed learning rate of a run: transformers' warm-up + cosine schedule times the length-decay factor.

What it shows, from the real classes and no training: ``transformers.get_cosine_schedule_with_warmup`` (the schedule
``SafeVocabGRPOConfig(lr_scheduler_type="cosine", warmup_steps=...)`` builds) wrapped in
``safevocab.schedulers.LengthDecayLR``, whose ``SurgeDetector`` is fed a synthetic mean-length series with two surges.
The first surge starts the decay (auto period = ``round(1.8 x surge step)``); the second, accepted after the cooldown
(``max_decays=2``), halves the factor at once. The optimizer's LR at each step is the product of the two.

    python examples/length_decay_schedule.py                   # writes docs/img/length_decay_schedule.png
    python examples/length_decay_schedule.py --out_dir /tmp/ld

Writes ``length_decay_schedule.png`` to ``--out_dir`` and prints the decisions (JSON).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

STEPS = 400
WARMUP = 20
LR = 1e-6


def mean_lengths(steps: int = STEPS, seed: int = 0) -> list[float]:
    """Mean completion length per step: 1000 tokens, then 3000 from step 80, 6000 from step 200; 3 % noise."""
    rng = random.Random(seed)
    level = lambda step: 1000.0 if step < 80 else 3000.0 if step < 200 else 6000.0  # noqa: E731
    return [level(step) * (1 + 0.03 * rng.gauss(0, 1)) for step in range(1, steps + 1)]


def run_schedule(lengths: list[float]) -> dict:
    """The LR (effective and base) the optimizer uses at each step, and the schedule's decisions."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from safevocab.schedulers import LengthDecayLR, SurgeDetector

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    cosine = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=WARMUP, num_training_steps=len(lengths))
    scheduler = LengthDecayLR(
        optimizer, decay_period=1, min_lr_ratio=0.1, base_scheduler=cosine, detector=SurgeDetector(),
        auto_period=True, max_decays=2, cooldown=50,
    )  # fmt: skip
    lr, base, factor = [], [], []
    for step, length in enumerate(lengths, 1):
        lr.append(optimizer.param_groups[0]["lr"])  # what this optimizer step uses
        base.append(scheduler.get_last_base_lr()[0])
        factor.append(scheduler.factor)
        optimizer.step()
        scheduler.step()
        scheduler.observe_length(step, length)  # the trainer's callback does this with trl's logged mean length
    detector = scheduler.detector
    return {
        "lr": lr, "lr_base": base, "factor": factor, "decay_steps": scheduler.decay_steps,
        "decay_period": scheduler.decay_period, "detections": detector.detections,
    }  # fmt: skip


def plot(lengths: list[float], result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(lengths) + 1))
    fig, (ax_len, ax_factor, ax_lr) = plt.subplots(
        3, 1, figsize=(7.5, 6.4), sharex=True, gridspec_kw={"height_ratios": [1, 0.8, 1.6]}
    )
    ax_len.plot(steps, lengths, color="tab:blue", lw=1)
    ax_len.set_ylabel("mean completion\nlength (tokens)")
    ax_factor.step(steps, result["factor"], where="post", color="tab:purple", lw=1.4)
    ax_factor.set_ylabel("factor")
    ax_factor.set_yscale("log", base=2)
    ax_factor.set_yticks([1, 0.5, 0.25, 0.125], ["1", "1/2", "1/4", "1/8"])
    ax_factor.set_ylim(0.09, 1.5)
    ax_lr.plot(steps, result["lr_base"], color="gray", ls="--", lw=1.2, label="base: warm-up 20 + cosine (lr_base)")
    ax_lr.plot(steps, result["lr"], color="tab:red", lw=1.6, label="effective: base x factor (learning_rate)")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    for (surge, detected), name in zip(result["detections"], ("first surge", "second surge")):
        for ax in (ax_len, ax_factor, ax_lr):
            ax.axvline(detected, color="black", ls=":", lw=1)
        ax_len.annotate(
            f"{name} starts at {surge},\ndetected at {detected}",
            (detected, max(lengths) * 0.12),
            xytext=(4, 0),
            textcoords="offset points",
            fontsize=8,
            va="bottom",
        )
    start, period = result["decay_steps"][0], result["decay_period"]
    for halving in range(start + period, len(lengths), period):
        ax_factor.annotate(
            f"{start} + {halving - start}",
            (halving, result["factor"][halving]),
            xytext=(4, 6),
            textcoords="offset points",
            fontsize=8,
        )
    ax_factor.annotate(
        "clock starts: 1 until\nthe first halving",
        (start, 1.0),
        xytext=(4, -22),
        textcoords="offset points",
        fontsize=8,
    )
    ax_factor.annotate(
        "second decay:\nhalved at once",
        (result["decay_steps"][1], 0.7),
        xytext=(-84, -40),
        textcoords="offset points",
        fontsize=8,
        arrowprops=dict(arrowstyle="->", lw=0.8),
    )
    ax_lr.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"Length decay over warm-up + cosine: auto period {period}, 2 decays, cooldown 50", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", default="docs/img")
    args = parser.parse_args(argv)
    lengths = mean_lengths()
    result = run_schedule(lengths)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(lengths, result, out_dir / "length_decay_schedule.png")
    summary = {key: result[key] for key in ("decay_steps", "decay_period", "detections")}
    summary["lr_at"] = {step: result["lr"][step - 1] for step in (10, 20, 84, 85, 205, 206, 228, 229, 400)}
    print(json.dumps(summary))
    return result


if __name__ == "__main__":
    main()
