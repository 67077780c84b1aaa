"""Check that a multi-process ``SafeVocabGRPOTrainer`` run logs what a single-process run of the same global batch logs.

What it shows: the ``safevocab/*``, ``mismatch/*`` and ``sampling/*`` metrics are reduced over all processes
(count-weighted means, max, min), trl's gathered metrics (rewards, completion lengths) and the loss agree, DDP
averages the gradients as one process would, and every rank holds the same learning rate at every step under
the length-decay schedule (``step0`` and ``on_surge``: the surge detector sees the global mean length).

Run it twice with the same ``--global_batch_size`` (each process gets ``global_batch_size / num_processes``
prompts x completions) and compare::

    accelerate launch --multi_gpu --num_processes 2 tests/helpers/multiprocess_check.py --out /tmp/mp/two
    python tests/helpers/multiprocess_check.py --out /tmp/mp/one
    python tests/helpers/multiprocess_check.py --compare /tmp/mp/one /tmp/mp/two

On a CPU-only machine this still runs 2 gloo processes: ``--multi_gpu`` only selects accelerate's torchrun
launcher (``accelerate launch --cpu`` starts a single process unless an MPI hostfile is given), and the script
builds its state with ``PartialState(cpu=True)`` (``use_cpu=True``), which makes each process a gloo
``MULTI_CPU`` rank. ``torchrun --nproc_per_node 2 tests/helpers/multiprocess_check.py ...`` is equivalent. On
GPUs pass ``--no_use_cpu``.

Why the runs are comparable. trl's ``RepeatSampler`` draws the prompts of a generation batch with
``args.seed`` for the *global* batch and accelerate hands process ``p`` the ``p``-th slice, so one process with
``per_device_train_batch_size = G`` sees the same rows, in the same order, as ``P`` processes with ``G / P``
each. Sampling, however, draws from each process's own RNG stream (every rank starts from the same seed, and one
process draws ``G`` rows where each of ``P`` processes draws ``G / P``), so sampled rollouts differ between the
two launches. Greedy decoding would make them equal but useless: the completions of a group would be identical,
their advantages sum to zero on identical gradients, and the model would not move (Adam would then amplify
rounding noise into updates). So this check keeps real sampling and only makes its randomness a function of the
row: while generating, ``torch.multinomial`` draws row ``r`` of the global batch at decoding position ``t`` of
generation call ``c`` by inverse CDF from a uniform seeded with ``(r, t, c)`` (:class:`RowSeededSampling`).
Nothing in the trainer is changed; the draws are exact samples of the sampler's distribution.

The sampler and the trainer use different safe sets on purpose (``safe_vocab_in_sampler=False``: the sampler
keeps the top 3 tokens, the trainer ``min_p=0.1``): with one shared set and fp32 on both sides the mismatch
metrics are rounding noise (about 1e-7) and would compare nothing. With two sets the importance ratios carry the
log(kept-mass) offset (non-trivial ``mismatch/*``), and sampled tokens outside the trainer's set are masked, so
the out-of-set masking and the recount of ``num_items_in_batch`` are exercised too. Completion lengths differ
between rows, so the processes hold different numbers of tokens: a mean of per-process means would differ from
the single-process value.

Output: ``<out>/rank<r>.json`` per process, ``{schedule: {"log_history": [...], "lr_trace": [[step, lr], ...],
"local_metrics": [{key: [local value, count]}, ...], "num_processes": P, "surge_step": ...}}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Logged keys that must agree between launches: our reduced metrics by prefix, and trl/Trainer values that are
#: computed from gathered tensors (or, for ``loss``/``grad_norm``, from DDP-averaged quantities).
COMPARED_PREFIXES = ("safevocab/", "mismatch/", "sampling/", "length_decay/")
COMPARED_KEYS = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "reward",
    "reward_std",
    "loss",
    "grad_norm",
    "learning_rate",
    "lr_base",
)
#: Schedules run by default, each a separate training run from the same initial model.
SCHEDULES = ("step0", "on_surge")
NUM_GENERATIONS = 4


def length_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """Arithmetic correctness plus a small bonus per character (dense, so groups rarely tie; it also makes the
    completions grow, which the ``on_surge`` schedule's detector picks up)."""
    from trl_integration.demo.arithmetic import arithmetic_reward

    correct = arithmetic_reward(prompts, completions, answer)
    return [c + 0.05 * len(text) for c, text in zip(correct, completions)]


class RowSeededSampling:
    """While active, ``torch.multinomial(probs [B, V], 1)`` draws each row from its own seed.

    Row ``i`` of a generate call on process ``p`` is row ``r = p * B + i`` of the global batch (trl hands each
    process an equal, contiguous slice). Its token at decoding position ``t`` of generation call ``c`` is the
    inverse-CDF draw of ``u = uniform(seed(r, t, c))``: an exact sample of ``probs[i]``, identical whichever way
    the global batch is split across processes. Other uses of ``torch.multinomial`` are passed through.
    """

    def __init__(self, process_index: int, seed: int = 0):
        self.process_index, self.seed = process_index, seed
        self.call, self.position = -1, 0

    def __enter__(self):
        import torch
        from transformers.generation.utils import GenerationMixin

        self._multinomial, self._generate = torch.multinomial, GenerationMixin.generate
        sampler, original_generate = self, GenerationMixin.generate

        def generate(model, *args, **kwargs):
            sampler.call, sampler.position = sampler.call + 1, 0
            return original_generate(model, *args, **kwargs)

        torch.multinomial = self._draw
        GenerationMixin.generate = generate
        return self

    def __exit__(self, *exc):
        import torch
        from transformers.generation.utils import GenerationMixin

        torch.multinomial, GenerationMixin.generate = self._multinomial, self._generate
        return False

    def _draw(self, probs, num_samples, replacement=False, *, generator=None, out=None):
        import torch

        if probs.dim() != 2 or num_samples != 1 or generator is not None or out is not None:
            return self._multinomial(probs, num_samples, replacement, generator=generator, out=out)
        rows = probs.shape[0]
        uniforms = []
        for i in range(rows):
            g = torch.Generator().manual_seed(
                hash((self.seed, self.process_index * rows + i, self.position, self.call)) % (2**63)
            )
            uniforms.append(torch.rand((), generator=g, dtype=torch.float64))
        self.position += 1
        cdf = probs.double().cumsum(-1)
        u = torch.stack(uniforms).to(cdf.device).unsqueeze(-1) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)


def schedule_settings(schedule: str) -> dict:
    """Length-decay settings over the constant schedule: ``step0`` halves from the first step; ``on_surge`` waits for
    a (sensitive) detector."""
    if schedule == "step0":
        return dict(
            length_decay=True,
            length_decay_start="step0",
            length_decay_period="1",
            length_decay_min_lr_ratio=0.25,
            lr_scheduler_type="constant",
        )
    if schedule == "on_surge":
        return dict(
            length_decay=True,
            lr_scheduler_type="constant",
            length_decay_start="on_surge",
            length_decay_period="1",
            length_decay_min_lr_ratio=0.25,
            # A hair-trigger detector: any 2% rise of the global mean length over the previous step is a surge.
            length_surge_window=1,
            length_surge_baseline_window=1,
            length_surge_warmup=1,
            length_surge_ratio=1.02,
        )
    raise ValueError(f"schedule={schedule!r} is not accepted: accepted one of {SCHEDULES}")


def deepspeed_config(stage: int) -> dict:
    """A DeepSpeed ZeRO config for the Trainer's ``deepspeed=`` argument ("auto" values are filled by transformers)."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter, the LM head included
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }


#: The Trainer's FSDP2 settings (what ``fsdp_config_fsdp2.yaml`` sets through accelerate): shard every decoder layer.
FSDP2_SETTINGS = dict(
    fsdp="full_shard",
    fsdp_config={
        "fsdp_version": 2,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "reshard_after_forward": True,
    },
)


def run_schedule(schedule: str, args, output_dir: str) -> dict:
    from accelerate import PartialState
    from transformers import TrainerCallback

    from safevocab.mismatch import MetricRow
    from trl_integration import SafeVocabGRPOTrainer
    from trl_integration.demo import make_dataset, tiny_grpo_config, tiny_model_path

    state = PartialState()
    if args.global_batch_size % state.num_processes:
        raise ValueError(
            f"--global_batch_size {args.global_batch_size} is not divisible by {state.num_processes} processes"
        )
    config = tiny_grpo_config(
        output_dir=output_dir,
        per_device_train_batch_size=args.global_batch_size // state.num_processes,
        num_generations=NUM_GENERATIONS,
        max_completion_length=6,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        logging_steps=1,
        bf16=False,
        use_cpu=args.use_cpu,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,
        # See the module docstring: the sampler keeps its top 3 tokens, the trainer min_p=0.1.
        top_k=3,
        safe_vocab_in_sampler=False,
        safe_vocab_rule="min_p=0.1",
        **schedule_settings(schedule),
        **({"deepspeed": deepspeed_config(args.zero_stage)} if args.zero_stage is not None else {}),
        **(FSDP2_SETTINGS if args.fsdp2 else {}),
    )

    trace: list[list[float]] = []

    class LRTrace(TrainerCallback):
        """Each rank's learning rate after every optimizer step (after the length-decay callback has run)."""

        def on_step_end(self, _args, state, control, optimizer=None, **kwargs):
            trace.append([state.global_step, float(optimizer.param_groups[0]["lr"])])
            return control

    trainer = SafeVocabGRPOTrainer(
        model=str(tiny_model_path()),
        reward_funcs=length_reward,
        args=config,
        train_dataset=make_dataset(64, seed=0, split="train"),
        callbacks=[LRTrace()],
    )
    if args.fsdp2 and trainer.accelerator.distributed_type != "FSDP":
        raise RuntimeError(
            f"--fsdp2 asked for FSDP but accelerate runs {trainer.accelerator.distributed_type}: accelerate applies "
            "FSDP on GPUs (and other accelerators) only, not to gloo CPU processes. On CPU, check the sharded head "
            "with sharded_head_check.py --mode fsdp2 instead."
        )
    # Record each rank's local (pre-reduction) metric values and counts, to show what a naive reduction would log.
    local: list[dict] = []
    log_reduced = trainer._log_reduced_metrics

    def recording(mode, rows):
        # one generation batch (steps_per_generation=1): this rank's values and counts, from its rows (computed ones,
        # or the step inputs the trainer queues and computes when trl logs)
        entry = {}
        for row in rows:
            row = row if isinstance(row, MetricRow) else row.row()
            entry.update({n: [v, c] for n, v, c in zip(row.names, row.values.tolist(), row.counts.tolist())})
        local.append(entry)
        return log_reduced(mode, rows)

    trainer._log_reduced_metrics = recording
    with RowSeededSampling(state.process_index, seed=args.sampling_seed):
        trainer.train()
    detector = getattr(trainer.lr_scheduler, "detector", None)
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero3": bool(is_deepspeed_zero3_enabled()),
        "log_history": trainer.state.log_history,
        "lr_trace": trace,
        "local_metrics": local,
        "num_processes": state.num_processes,
        "surge_step": None if detector is None else detector.surge_step,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="directory for rank<r>.json")
    parser.add_argument("--global_batch_size", type=int, default=8, help="completions per step over all processes")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--sampling_seed", type=int, default=0, help="seed of the row-seeded sampling")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, from {SCHEDULES}")
    parser.add_argument("--no_use_cpu", dest="use_cpu", action="store_false", help="train on the accelerator")
    parser.add_argument("--fsdp2", action="store_true", help="train under FSDP2 (fully_shard per decoder layer)")
    parser.add_argument(
        "--zero_stage", type=int, choices=[2, 3], default=None,
        help="train under DeepSpeed ZeRO (needs deepspeed; on CPU set DS_ACCELERATOR=cpu and launch with torchrun)",
    )  # fmt: skip
    parser.add_argument("--compare", nargs=2, metavar=("REFERENCE_DIR", "OTHER_DIR"), help="compare two --out dirs")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-5)
    args = parser.parse_args(argv)
    if args.compare:
        problems = compare_dirs(*args.compare, rtol=args.rtol, atol=args.atol)
        print("\n".join(problems) if problems else "the runs agree")
        return 1 if problems else 0
    if not args.out:
        parser.error("--out is required (or --compare)")

    import torch
    from accelerate import PartialState

    torch.set_num_threads(1)  # several processes may share a few cores
    # cpu=True before anything else touches the state: without it, accelerate sees no GPU and treats a
    # torchrun-launched process as a lone one (DistributedType.NO) instead of a gloo MULTI_CPU rank.
    state = PartialState(cpu=args.use_cpu)
    results = {}
    for schedule in args.schedules.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            results[schedule] = run_schedule(schedule, args, tmp)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{state.process_index}.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


# ------------------------------------------------------------------------------------------------------ comparison


def compared(key: str) -> bool:
    # The kept-set size quantiles are per process by design (safevocab.mismatch.PER_PROCESS_QUANTILES): a 2-process
    # run averages the two processes' quantiles, which is not the one-process quantile of all positions.
    if key in ("safevocab/safe_size_median", "safevocab/safe_size_p99"):
        return False
    return key.startswith(COMPARED_PREFIXES) or key in COMPARED_KEYS


def load_ranks(directory: str) -> list[dict]:
    names = sorted(n for n in os.listdir(directory) if n.startswith("rank") and n.endswith(".json"))
    if not names:
        raise FileNotFoundError(f"no rank<r>.json in {directory}")
    ranks = []
    for name in sorted(names, key=lambda n: int(n[4:-5])):
        with open(os.path.join(directory, name)) as f:
            ranks.append(json.load(f))
    return ranks


def _close(a, b, rtol: float, atol: float) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return abs(a - b) <= atol + rtol * abs(b)


def compare_logs(reference: dict, other: dict, rtol: float = 1e-4, atol: float = 1e-5, label: str = "") -> list[str]:
    """Differences between two runs' ``log_history``/``lr_trace`` (one schedule), on the :func:`compared` keys."""
    problems = []
    ref_steps = [h for h in reference["log_history"] if "step" in h and "train_runtime" not in h]
    oth_steps = [h for h in other["log_history"] if "step" in h and "train_runtime" not in h]
    if len(ref_steps) != len(oth_steps):
        return [f"{label}: {len(ref_steps)} logged steps in the reference, {len(oth_steps)} in the other run"]
    for ref, oth in zip(ref_steps, oth_steps):
        keys = sorted(k for k in ref if compared(k))
        missing = sorted(set(keys) ^ {k for k in oth if compared(k)})
        if missing:
            problems.append(f"{label} step {ref['step']}: keys only in one run: {missing}")
        for key in keys:
            if key in oth and not _close(oth[key], ref[key], rtol, atol):
                problems.append(f"{label} step {ref['step']}: {key} = {oth[key]!r}, reference {ref[key]!r}")
    if len(reference["lr_trace"]) != len(other["lr_trace"]):
        problems.append(f"{label}: lr traces of different lengths")
    for (s1, lr1), (s2, lr2) in zip(reference["lr_trace"], other["lr_trace"]):
        if s1 != s2 or not _close(lr2, lr1, 1e-12, 0.0):
            problems.append(f"{label}: lr at step {s2} is {lr2!r}, reference {lr1!r} at step {s1}")
    return problems


def compare_dirs(reference_dir: str, other_dir: str, rtol: float = 1e-4, atol: float = 1e-5) -> list[str]:
    """Every rank of ``other_dir`` against rank 0 of ``reference_dir``, for every schedule ``other_dir`` ran."""
    reference = load_ranks(reference_dir)[0]
    problems = []
    for rank, other in enumerate(load_ranks(other_dir)):
        if not set(other) <= set(reference):
            problems.append(f"rank {rank}: schedules {sorted(set(other) - set(reference))} not in the reference")
        for schedule in sorted(set(reference) & set(other)):
            problems += compare_logs(reference[schedule], other[schedule], rtol, atol, f"rank {rank} {schedule}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
