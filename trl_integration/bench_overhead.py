"""Step-time overhead of ``SafeVocabGRPOTrainer`` over stock ``trl.GRPOTrainer`` on the same tiny config.

    python -m trl_integration.bench_overhead                 # bundled tiny model, 40 steps each, 3 rounds
    python -m trl_integration.bench_overhead --steps 60 --rounds 5 --model path/to/model

Both trainers run the same model, data, seed and sampler (``min_p`` from ``--rule`` on both), in
alternating rounds so that a busy machine slows both alike. The time of one step is trl's own
``step_time`` metric (the whole optimizer step: generation, scoring, loss, backward, update); the
first ``--skip`` steps of each run are warm-up and not counted. Prints the mean step time of each
trainer and the ratio. Timings are a ratio from one run on one machine; tests never assert them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

_JOB_KEYS = ("per_device_train_batch_size", "num_generations", "max_completion_length", "learning_rate", "beta")


def _step_times(trainer_cls, config_cls, model: str, dataset, reward, steps: int, seed: int, extra: dict):
    from trl_integration.cli import BUNDLED_JOB_DEFAULTS

    with tempfile.TemporaryDirectory() as tmp:
        kwargs = dict(
            output_dir=tmp,
            max_steps=steps,
            # the main job's batch and optimisation settings, so the overhead is measured on the job users run
            **{key: BUNDLED_JOB_DEFAULTS[key] for key in _JOB_KEYS},
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            disable_tqdm=True,
            seed=seed,
            **extra,
        )
        trainer = trainer_cls(model=model, reward_funcs=reward, args=config_cls(**kwargs), train_dataset=dataset)
        trainer.train()
    return [h["step_time"] for h in trainer.state.log_history if "step_time" in h]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m trl_integration.bench_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the bundled tiny model)")
    parser.add_argument("--rule", default="min_p=0.001", help="min_p rule used by both samplers (default min_p=0.001)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps not counted (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each trainer (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num_iterations", type=int, default=1,
        help="GRPO iterations per generation (default 1). With 1, stock trl scores no old log-probabilities on "
        "the generate path while SafeVocabGRPOTrainer does (for the safe-set masks, the IS ratio and the "
        "metrics); with > 1 both do.",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from rich.progress import track
    from trl import GRPOConfig, GRPOTrainer

    from safevocab import parse_rule
    from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
    from trl_integration.tasks.arithmetic import arithmetic_reward, make_dataset

    if args.skip >= args.steps:
        parser.error(f"--skip={args.skip} must be smaller than --steps={args.steps}")
    sampler = parse_rule(args.rule).sampler_kwargs()
    if set(sampler) != {"min_p"}:
        parser.error(f"--rule={args.rule!r}: give a single min_p rule, which stock trl's sampler takes as min_p")
    model = args.model
    if model is None:
        from trl_integration.assets import tiny_model_path

        model = str(tiny_model_path())
    dataset = make_dataset(2048, seed=0, split="train")
    arms = {
        "stock GRPOTrainer": (GRPOTrainer, GRPOConfig, {"min_p": sampler["min_p"]}),
        "SafeVocabGRPOTrainer": (SafeVocabGRPOTrainer, SafeVocabGRPOConfig, {"safe_vocab_rule": args.rule}),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in track(range(args.rounds), description="rounds"):
        for name, (trainer_cls, config_cls, extra) in arms.items():
            step_times = _step_times(
                trainer_cls, config_cls, model, dataset, arithmetic_reward, args.steps, args.seed,
                {**extra, "num_iterations": args.num_iterations},
            )  # fmt: skip
            times[name] += step_times[args.skip :]
    stock, safe = (statistics.mean(times[name]) for name in arms)
    result = {"stock_mean_s": stock, "safevocab_mean_s": safe, "overhead": safe / stock - 1.0, "n_steps": len(times["stock GRPOTrainer"])}
    print(
        f"model={model} rule={args.rule} steps={args.steps} (first {args.skip} skipped) rounds={args.rounds} "
        f"num_iterations={args.num_iterations}"
    )
    print("| trainer | mean step time (s) |")
    print("|---|---:|")
    for name in arms:
        print(f"| {name} | {statistics.mean(times[name]):.4f} |")
    print(f"overhead of SafeVocabGRPOTrainer: {100 * result['overhead']:+.1f}% (target <= +5%)")
    return result


if __name__ == "__main__":
    main()
