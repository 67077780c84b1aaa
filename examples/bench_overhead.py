"""Step-time overhead of ``SafeVocabGRPOTrainer`` over stock ``trl.GRPOTrainer`` on the same tiny config.

    python examples/bench_overhead.py                 # bundled tiny model, 200 paired steps
    python examples/bench_overhead.py --steps 400 --model path/to/model --num_iterations 2

It benchmarks the checkout it is in (its ``safevocab`` and ``trl_integration``), whether they are installed or not.

Both trainers are built on the same model, data, seed and sampler (``min_p`` from ``--rule`` on both) with the
main job's batch settings, and their optimizer steps are **interleaved**: step ``i`` of one, step ``i`` of the
other (in alternating order), each from the same random seed. A step is what the Trainer does per optimizer
step: ``training_step`` (generation, scoring, loss, backward) plus gradient clipping and the optimizer and
scheduler updates; Trainer logging is not timed. Interleaving pairs every step with its twin a fraction of a
second apart, so the slow drifts of a shared machine (run-to-run swings of +-20% were seen here when whole runs
were timed one after the other) cancel in the per-pair ratio.

By default the policy is frozen (``--learning_rate 0``: the update still runs), so that both trainers sample
the very same completions and do the same work; with learning the two drift apart (the SafeVocab run corrects
by the importance ratio, stock trl does not) and completion lengths, hence step times, differ for reasons that
are not the trainer's overhead. Prints the median and mean step time of each trainer and the overhead as the
median of the per-pair ratios (with its interquartile range). Timings are a measurement on one machine; tests
never assert them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _make_trainer(trainer_cls, config_cls, model: str, dataset, reward, output_dir: str, steps: int, extra: dict):
    """A trainer ready for manual steps: optimizer, scheduler and an iterator over its generation batches.

    Both trainers get the main job's batch (``tiny_grpo_config_kwargs``), so the overhead is measured on the job
    users run; stock trl's ``GRPOConfig`` takes the same keyword arguments minus the safe-vocabulary ones.
    """
    from trl_integration.demo.config import tiny_grpo_config_kwargs

    kwargs = tiny_grpo_config_kwargs(
        output_dir=output_dir,
        max_steps=steps,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        disable_tqdm=True,
        **extra,
    )
    trainer = trainer_cls(model=model, reward_funcs=reward, args=config_cls(**kwargs), train_dataset=dataset)
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer, _epochs(trainer)


def _epochs(trainer) -> Iterator:
    """The trainer's batches, epoch after epoch (as the Trainer does), so that ``--steps`` may exceed one epoch."""
    while True:
        yield from trainer.get_train_dataloader()


def _timed_step(trainer, batches, seed: int) -> float:
    """Seconds of one optimizer step (all its micro-batches), sampling from ``seed``."""
    import torch

    torch.manual_seed(seed)
    start = time.perf_counter()
    for _ in range(trainer.args.gradient_accumulation_steps):
        trainer.training_step(trainer.model, next(batches), None)
    if trainer.args.max_grad_norm:
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    from transformers.hf_argparser import string_to_bool  # TRL-style true/false values

    from trl_integration.grpo.config import DEFAULT_RULE, SCORING_MODES

    parser = argparse.ArgumentParser(prog="python examples/bench_overhead.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the bundled tiny model)")
    parser.add_argument(
        "--rule", default=DEFAULT_RULE, help=f"min_p rule used by both samplers (default {DEFAULT_RULE})"
    )
    parser.add_argument("--steps", type=int, default=200, help="paired optimizer steps (default 200)")
    parser.add_argument("--skip", type=int, default=5, help="warm-up pairs not counted (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--learning_rate", type=float, default=0.0,
        help="learning rate of both trainers (default 0: a frozen policy, so both sample the same completions)",
    )  # fmt: skip
    parser.add_argument(
        "--num_iterations", type=int, default=1,
        help="GRPO iterations per generation (default 1). With 1, the batches are on-policy: stock trl scores no "
        "old log-probabilities on the generate path and SafeVocabGRPOTrainer takes its safe sets from the loss's "
        "forward (safe_vocab_scoring='auto'); with > 1 both run trl's old-policy pass.",
    )  # fmt: skip
    parser.add_argument(
        "--safe_vocab_scoring", default="auto", choices=SCORING_MODES,
        help="SafeVocabGRPOConfig.safe_vocab_scoring of the SafeVocab trainer (default auto)",
    )  # fmt: skip
    parser.add_argument(
        "--log_mismatch_metrics", type=string_to_bool, default=True, metavar="{true,false}",
        help="SafeVocabGRPOConfig.log_mismatch_metrics of the SafeVocab trainer (default true): false measures the "
        "trainer without the mismatch/* metrics",
    )  # fmt: skip
    args = parser.parse_args(argv)

    import torch
    from rich.progress import track
    from trl import GRPOConfig, GRPOTrainer

    from safevocab import parse_rule
    from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
    from trl_integration._private import metric_store
    from trl_integration.demo.arithmetic import arithmetic_reward, make_dataset

    if not 0 <= args.skip < args.steps:
        parser.error(f"--skip={args.skip} must be in [0, --steps={args.steps})")
    sampler = parse_rule(args.rule).sampler_kwargs()
    if set(sampler) != {"min_p"}:
        parser.error(f"--rule={args.rule!r}: give a single min_p rule, which stock trl's sampler takes as min_p")
    model = args.model
    if model is None:
        from trl_integration.demo.model import tiny_model_path

        model = str(tiny_model_path())
    dataset = make_dataset(2048, seed=0, split="train")
    common = {"num_iterations": args.num_iterations, "learning_rate": args.learning_rate, "seed": args.seed}
    arms = {
        "stock GRPOTrainer": (GRPOTrainer, GRPOConfig, {"min_p": sampler["min_p"]}),
        "SafeVocabGRPOTrainer": (
            SafeVocabGRPOTrainer,
            SafeVocabGRPOConfig,
            {
                "safe_vocab_rule": args.rule,
                "safe_vocab_scoring": args.safe_vocab_scoring,
                "log_mismatch_metrics": args.log_mismatch_metrics,
            },
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            name: _make_trainer(cls, config_cls, model, dataset, arithmetic_reward, os.path.join(tmp, str(i)),
                                args.steps, {**extra, **common})
            for i, (name, (cls, config_cls, extra)) in enumerate(arms.items())
        }  # fmt: skip
        names = list(arms)
        for step in track(range(args.steps), description="paired steps"):
            for name in names if step % 2 == 0 else names[::-1]:  # alternate who goes first
                trainer, batches = trainers[name]
                times[name].append(_timed_step(trainer, batches, seed=args.seed * 100_003 + step))
        tokens = {name: metric_store(trainers[name][0])["train"]["num_tokens"][-1] for name in names}
        trainers[names[1]][0].flush_metrics()  # the trainer's queued metrics (computed when trl logs)
        safe_keys = metric_store(trainers[names[1]][0])["train"]
        logged_mismatch = "mismatch/kl" in safe_keys  # one of mismatch_metrics (the IS ones are logged regardless)
    stock, safe = (times[name][args.skip :] for name in names)
    ratios = sorted(s / k for s, k in zip(safe, stock))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    result = {
        "stock_median_s": statistics.median(stock),
        "safevocab_median_s": statistics.median(safe),
        "stock_mean_s": statistics.mean(stock),
        "safevocab_mean_s": statistics.mean(safe),
        "overhead": quartiles[1] - 1.0,
        "overhead_iqr": [quartiles[0] - 1.0, quartiles[2] - 1.0],
        "overhead_of_means": statistics.mean(safe) / statistics.mean(stock) - 1.0,
        "n_pairs": len(ratios),
        "same_completions": len(set(tokens.values())) == 1,
        "safevocab_logged_mismatch_metrics": logged_mismatch,
        "torch_threads": torch.get_num_threads(),
    }
    print(
        f"model={model} rule={args.rule} pairs={args.steps} (first {args.skip} skipped) "
        f"num_iterations={args.num_iterations} learning_rate={args.learning_rate:g} "
        f"safe_vocab_scoring={args.safe_vocab_scoring} log_mismatch_metrics={args.log_mismatch_metrics} "
        f"torch threads={result['torch_threads']}; "
        f"both trainers processed the same tokens: {'yes' if result['same_completions'] else 'no'}"
    )
    print("| trainer | median step time (s) | mean step time (s) |")
    print("|---|---:|---:|")
    for name in names:
        print(
            f"| {name} | {statistics.median(times[name][args.skip :]):.4f} | {statistics.mean(times[name][args.skip :]):.4f} |"
        )
    low, high = result["overhead_iqr"]
    print(
        f"overhead of SafeVocabGRPOTrainer: {100 * result['overhead']:+.1f}% (median of {len(ratios)} per-step "
        f"ratios; interquartile range {100 * low:+.1f}% to {100 * high:+.1f}%; ratio of means "
        f"{100 * result['overhead_of_means']:+.1f}%) (target <= +2%)"
    )
    return result


if __name__ == "__main__":
    main()
