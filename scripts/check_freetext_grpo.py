#!/usr/bin/env python
"""Can GRPO learn the free-text task from the testbed model? A short run, the held-out metric, the step time.

``python scripts/check_freetext_grpo.py [--steps 100] [--lr 1e-4] [--threads 1] [--json out.json]``

One ``SafeVocabGRPOTrainer`` run on :func:`trl_integration.demo.freetext.freetext_task` with the demo's GRPO settings
(:func:`trl_integration.demo.tiny_grpo_config`: 8 prompts x 8 completions a step, ``beta=0``, safevocab's default
rule) and the task's completion length (32 tokens). The held-out reward on 256 held-out prompts (the task's metric:
sampled at temperature 1 with seed 0; and greedy) is measured before training and every ``--eval-every`` steps;
the time of each optimisation step (generation, scoring and update; evaluations excluded) is recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class HeldOutRewardCallback(TrainerCallback):
    """Times every step and evaluates the held-out reward (sampled: the task's metric; greedy) every ``every`` steps."""

    def __init__(self, trainer, task, dataset, every: int) -> None:
        from tqdm.auto import tqdm

        self.trainer, self.task, self.dataset, self.every = trainer, task, dataset, every
        self.evals: list[dict] = []
        self.step_seconds: list[float] = []
        self._started = 0.0
        self.bar = tqdm(total=trainer.args.max_steps, desc="GRPO", unit="step", dynamic_ncols=True)

    def _evaluate(self, step: int) -> None:
        from trl_integration.demo.freetext import held_out_reward

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        tokenizer = self.trainer.processing_class
        sampled = self.task.held_out_metric(model, tokenizer, self.dataset)  # the task's metric: sampled, seed 0
        greedy = held_out_reward(model, tokenizer, self.dataset, do_sample=False)
        self.evals.append({"step": step, "greedy": round(greedy, 4), "sampled": round(sampled, 4)})
        self.bar.write(f"step {step:4d}: held-out reward sampled {sampled:.4f} (the metric), greedy {greedy:.4f}")

    def on_train_begin(self, args, state, control, **kwargs):
        self._evaluate(0)

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.bar.set_postfix_str(f"train reward {logs['reward']:.3f}", refresh=False)

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self._started)
        self.bar.update(1)
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self._evaluate(state.global_step)


def _greedy_examples(trainer, dataset) -> list[dict]:
    from trl_integration.demo.freetext import MAX_COMPLETION_LENGTH, unigram_f1

    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    tokenizer = trainer.processing_class
    enc = tokenizer(list(dataset["prompt"]), return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=MAX_COMPLETION_LENGTH,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return [
        {"prompt": row["prompt"], "completion": text, "reward": round(unigram_f1(text, row["continuation"]), 4)}
        for row, text in zip(dataset, texts)
    ]


def main(argv=None) -> dict:
    from transformers import PrinterCallback

    from trl_integration import SafeVocabGRPOTrainer
    from trl_integration.demo import tiny_grpo_config
    from trl_integration.demo.freetext import freetext_task

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--show", type=int, default=4, help="print this many held-out greedy completions at the end")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    task = freetext_task()
    config_kwargs = dict(
        max_steps=args.steps,
        max_completion_length=task.max_completion_length,
        learning_rate=args.lr,
        seed=args.seed,
        logging_steps=1,
        disable_tqdm=True,
    )
    with tempfile.TemporaryDirectory(prefix="freetext-grpo-") as tmp:
        config = tiny_grpo_config(output_dir=tmp, **config_kwargs)
        prompts_needed = args.steps * config.per_device_train_batch_size // config.num_generations
        trainer = SafeVocabGRPOTrainer(
            model=task.model_path,
            reward_funcs=list(task.reward_funcs),
            args=config,
            train_dataset=task.train_dataset(prompts_needed, args.seed),
        )
        trainer.remove_callback(PrinterCallback)
        callback = HeldOutRewardCallback(trainer, task, task.held_out_dataset(args.eval_prompts), args.eval_every)
        trainer.add_callback(callback)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        callback.bar.close()
    examples = _greedy_examples(trainer, task.held_out_dataset(args.show)) if args.show else []
    for example in examples:
        print(f"{example['prompt']!r} -> {example['completion']!r} (reward {example['reward']:.3f})")
    logs = [h for h in trainer.state.log_history if "reward" in h]
    first, last = logs[: max(1, len(logs) // 5)], logs[-max(1, len(logs) // 5) :]
    seconds = callback.step_seconds
    result = {
        "command": " ".join(["python scripts/check_freetext_grpo.py", *(sys.argv[1:] if argv is None else argv)]),
        "settings": {
            **config_kwargs,
            "threads": args.threads,
            "prompts_per_step": prompts_needed // args.steps,
            "num_generations": config.num_generations,
        },
        "held_out": callback.evals,
        "train_reward_first_fifth": round(statistics.mean(h["reward"] for h in first), 4),
        "train_reward_last_fifth": round(statistics.mean(h["reward"] for h in last), 4),
        "mean_completion_length": round(statistics.mean(h.get("completions/mean_length", 0.0) for h in logs), 2),
        "clipped_ratio": round(statistics.mean(h.get("completions/clipped_ratio", 0.0) for h in logs), 3),
        "step_seconds_median": round(statistics.median(seconds), 3),
        "step_seconds_mean": round(statistics.mean(seconds), 3),
        "wall_seconds": round(wall, 1),
        "greedy_examples_after": examples,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "held_out"}, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
