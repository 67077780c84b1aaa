"""End-of-run summary of ``safevocab-grpo``: reward and accuracy before/after, mismatch, where things went.

Written as ``summary.json`` and ``log_history.json`` in the output directory, with the training curves beside
them (:mod:`trl_integration.commands.summary_plots`), and printed as a table. When stdout is not a terminal (a log file, a
pipe, CI) the table is as wide as its longest row, so paths are never wrapped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from trl_integration.commands.summary_plots import write_training_curves

__all__ = ["run_summary", "print_run_summary"]

#: Metrics reported from the last logged step (see docs/metrics.md).
SUMMARY_METRICS = (
    "safevocab/pruned_mass_mean",
    "safevocab/safe_size_mean",
    "safevocab/out_of_set_frac",
    "safevocab/seq_tv_estimate",
    "mismatch/log_ppl_abs_diff",
    "mismatch/k3_kl",
    "mismatch/chi2_token",
)


def _mean_of(history: list[dict], key: str, first: bool, n: int = 3) -> float | None:
    """Mean of the first (or last) ``n`` logged values, ``n`` cut to half of them: with fewer than ``2n`` points the
    two means would share points (two logged steps printed as ``a -> a``)."""
    values = [h[key] for h in history if isinstance(h.get(key), (int, float)) and not math.isnan(h[key])]
    if not values:
        return None
    n = max(1, min(n, len(values) // 2))
    part = values[:n] if first else values[-n:]
    return sum(part) / len(part)


def _reward_noise(history: list[dict], n: int = 3) -> float | None:
    """The standard error of one end's mean reward (:func:`_mean_of`'s ``n`` logged steps): the sample standard
    deviation of the logged step rewards over ``sqrt(n)`` (``None`` below three points). A step's reward is the mean
    over its few prompts' completions, so at 8 prompts a step two such means differ by chance by about this much."""
    values = [h["reward"] for h in history if isinstance(h.get("reward"), (int, float)) and not math.isnan(h["reward"])]
    if len(values) < 3:
        return None
    n = max(1, min(n, len(values) // 2))
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / n)


def run_summary(trainer, accuracy_before: float | None = None, accuracy_after: float | None = None) -> dict:
    """The summary as a dict (also written to ``<output_dir>/summary.json``).

    Rewards are the mean of the first and of the last three logged steps (of the first and last half when fewer than
    six steps logged one); mismatch metrics are those of the last logged step.
    """
    history = [h for h in trainer.state.log_history if "reward" in h]
    last = history[-1] if history else {}
    out_dir = Path(trainer.args.output_dir).resolve()
    summary = {
        "steps": trainer.state.global_step,
        "train_runtime_s": next((h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h), None),
        "rule": trainer.args.safe_vocab_rule,
        # what the trainer and the sampler used: the rule composed with an explicit sampler top_k/top_p/min_p
        "effective_rule": str(trainer.args.safe_vocab_effective_rule or trainer.args.safe_vocab_rule),
        # whose sampler the rule reproduces, hence its composition order (vLLM's differs from generate's)
        "effective_rule_engine": trainer.args.effective_rule.engine,
        "reward_points": len(history),  # logged steps with a reward: with one, first and last are the same point
        "reward_first": _mean_of(history, "reward", first=True),
        "reward_last": _mean_of(history, "reward", first=False),
        # how much each end's mean moves by chance (its standard error), and the prompts a step averages over
        "reward_standard_error": _reward_noise(history),
        "prompts_per_step": _prompts_per_step(trainer.args),
        # the training processes (a launcher's --num_processes: each trains its own per-device batch) and the kept
        # logits' cap, which changes no number above but the loss's memory and time (docs/performance.md)
        "processes": trainer.args.world_size,
        "keep_logits_bytes": getattr(trainer.args, "safe_vocab_keep_logits_bytes", 0),
        "accuracy_before": accuracy_before,
        "accuracy_after": accuracy_after,
        "metrics_last_step": {k: last.get(k) for k in SUMMARY_METRICS if k in last},
        # the run's share of completion tokens outside the trainer's safe set (masked out of the loss; None: none
        # scored) and its optimisation steps left with no loss token (grpo/out_of_set_alert.py)
        **_out_of_set_totals(trainer),
        "length_decay": _length_decay(trainer),
        "output_dir": str(out_dir),
        "log_history": str(out_dir / "log_history.json"),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    plot = write_training_curves(trainer.state.log_history, out_dir, f"safevocab-grpo, rule {summary['rule']}")
    summary["plots"] = None if plot is None else str(plot)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _length_decay(trainer) -> dict | None:
    """The length-decay schedule at the end (``None`` without ``length_decay``): the decays applied (the start and
    each later surge), the steps they happened at, the period and the final LR factor."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    if not getattr(trainer.args, "length_decay", False) or not hasattr(scheduler, "num_decays"):
        return None
    return {
        "decays": scheduler.num_decays,
        "decay_steps": list(scheduler.decay_steps),
        "decay_period": scheduler.decay_period if scheduler.decay_active else None,
        "final_factor": scheduler.factor,
    }


#: How the printed summary names each engine's composition order (safevocab.engine_order).
_ENGINE_ORDER = {
    "hf": "generate's order (top_k, top_p, min_p)",
    "vllm": "vLLM's order (min_p, top_k, top_p)",
    "sglang": "SGLang's order",
}


def print_run_summary(trainer, accuracy_before: float | None = None, accuracy_after: float | None = None) -> dict:
    """Print :func:`run_summary` as a table (rich when available) and return it."""
    summary = run_summary(trainer, accuracy_before, accuracy_after)

    def fmt(x) -> str:
        return "n/a" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)

    # an order only where parts compose: rule "none" prunes nothing, so it has none
    engine = summary["effective_rule_engine"]
    order = "" if summary["effective_rule"] == "none" else f", composed in {_ENGINE_ORDER[engine]}"
    rows = [
        ("steps", fmt(summary["steps"])),
        *(
            [
                (
                    "processes",
                    f"{summary['processes']} (each step: {summary['prompts_per_step']} prompts over all of them)",
                )
            ]
            if summary["processes"] > 1
            else []
        ),
        ("train time (s)", fmt(summary["train_runtime_s"])),
        (
            "safe-vocabulary rule",
            (
                summary["rule"]
                if summary["effective_rule"] == summary["rule"]
                else f"{summary['effective_rule']} (--safe_vocab_rule {summary['rule']} with the sampler's own)"
            )
            + (order or " (no pruning: the full vocabulary)"),
        ),
        _reward_row(summary, fmt),
    ]
    if summary["length_decay"] is not None:
        decay = summary["length_decay"]
        at = f" at step {', '.join(map(str, decay['decay_steps']))}" if decay["decays"] else ""
        rows.append(("length decay: decays, final LR factor", f"{decay['decays']}{at}, {fmt(decay['final_factor'])}"))
    if accuracy_before is not None:
        rows.append(("held-out accuracy (greedy), before -> after", f"{accuracy_before:.3f} -> {accuracy_after:.3f}"))
    rows += [(k, fmt(v)) for k, v in summary["metrics_last_step"].items()]
    rows += _out_of_set_rows(summary)
    rows += [
        ("model and logs", summary["output_dir"]),
        ("per-step metrics", summary["log_history"]),
    ]
    if summary["plots"]:
        rows.append(("reward, safe set, mismatch over steps", summary["plots"]))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="safevocab-grpo summary", show_header=False)
        table.add_column(no_wrap=True)
        table.add_column(overflow="fold")  # a narrow terminal folds long values rather than cutting them
        for key, value in rows:
            table.add_row(key, value)
        console = Console()
        if not console.is_terminal:  # rich would fit a log file to 80 columns, folding paths mid-word
            console = Console(width=max(console.width, _table_width(rows)))
        console.print(table)
    except ImportError:  # rich is in the trl extra; plain text otherwise
        width = max(len(k) for k, _ in rows)
        print("safevocab-grpo summary")
        for key, value in rows:
            print(f"  {key:<{width}}  {value}")
    return summary


def _prompts_per_step(args) -> int | None:
    """Prompts one optimisation step averages its reward over (all processes)."""
    try:
        rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        return max(1, rows // args.num_generations)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


def _reward_row(summary: dict, fmt) -> tuple[str, str]:
    """``first -> last`` over the logged steps, with how noisy each end is (its standard error, the prompts a step
    averages over) and where to look instead; one logged point is shown as such, not as a change of nothing."""
    if summary["reward_points"] == 0:
        return ("reward", "n/a (no step logged a reward)")
    if summary["reward_points"] == 1:
        return ("reward (one logged point)", fmt(summary["reward_last"]))
    change = f"{fmt(summary['reward_first'])} -> {fmt(summary['reward_last'])}"
    noise, prompts = summary.get("reward_standard_error"), summary.get("prompts_per_step")
    if noise is not None:
        per = f" at {prompts} prompts a step" if prompts else ""
        change += f" (each ± {noise:.2g}{per}: noisy; held-out accuracy is the measure)"
    return ("reward, first -> last steps", change)


def _out_of_set_totals(trainer) -> dict:
    """``out_of_set_share`` and ``steps_trained_nothing`` of the run, from the trainer's out-of-set alert (``None``
    both for a trainer without one)."""
    alert = getattr(trainer, "out_of_set_alert", None)
    if alert is None:
        return {"out_of_set_share": None, "steps_trained_nothing": None}
    return {"out_of_set_share": alert.out_of_set_share, "steps_trained_nothing": alert.steps_trained_nothing}


def _out_of_set_rows(summary: dict) -> list[tuple[str, str]]:
    """The out-of-set share of the run and the steps that trained nothing (docs/metrics.md)."""
    share, empty = summary["out_of_set_share"], summary["steps_trained_nothing"]
    return [
        ("completion tokens outside the safe set (masked)", "n/a" if share is None else f"{share:.2%}"),
        ("steps that trained nothing (every token masked)", "n/a" if empty is None else str(empty)),
    ]


def _table_width(rows: list[tuple[str, str]]) -> int:
    """Columns the two-column table needs without wrapping: both cells, their padding and three borders."""
    return max(len(k) for k, _ in rows) + max(len(v) for _, v in rows) + 7
