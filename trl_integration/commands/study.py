"""``safevocab study``: remedies for training–inference mismatch compared arm by arm, over several seeds.

On one task (``--task``: ``arithmetic``, the default, ``freetext``, or ``module:function`` returning a
:class:`~trl_integration.task.StudyTask`) and under one controlled mismatch of the ``generate`` rollouts
(injected bounded logit noise ``--noise EPS`` of kind ``--noise_kind`` (``tail``: ``EPS`` added to exactly the tokens
``--dvp_rule`` cuts at the rollout's logits), weights rounded to ``--rollout_mantissa_bits``,
a plug-in ``--rollout_perturbation``, a lower precision ``--rollout_dtype``, a truncated sampler ``--sampler_rule``
whose rollouts the rule-none arms score on the full softmax, as stock trl does), the command trains the same GRPO job
once per *(arm, seed)*, in-process and one after the other, and writes a report folder:

- ``report.md``: the settings, the exact command, a table of the final and best held-out metric per arm (mean ± std
  over seeds), the final training reward per arm, the mismatch diagnostics, and any run that failed;
- one PNG per metric (reward, held-out metric, log-ppl gap, gradient norm, out-of-set fraction, response length,
  learning rate): one line per arm, the mean over seeds, with a shaded band from the smallest to the largest seed;
- ``results.json``: the settings and every run's per-step series (written after each run, so an interrupted study
  keeps what it finished; ``--resume`` then trains only what is missing).

The arms (``--arms``, default the first five):

- ``no_remedy``: ``safe_vocab_rule=none`` (full vocabulary), no importance-sampling correction;
- ``tis``: ``none`` + truncated IS (``token_truncate``, the ratio clipped above at ``--is_clip_max``);
- ``mis``: ``none`` + masked IS (``--mis_mode`` ``token_mask`` or ``sequence_mask``; ratios outside
  ``[--is_clip_min, --is_clip_max]`` are zeroed);
- ``dvp``: ``--dvp_rule`` (default ``min_p=0.01``) in the sampler and the trainer, no IS;
- ``dvp_length_decay``: ``dvp`` + ``--length_decay --length_decay_period auto`` (the LR is held until the response
  length surges, then halved every ``round(1.8 x surge step)`` steps);
- ``dvp_mis``: ``dvp`` + the ``mis`` arm's masked IS;
- ``dvp_tis``: ``dvp`` + the ``tis`` arm's truncated IS;
- ``no_mismatch``: ``no_remedy`` with every injected mismatch switched off (the matched zero-mismatch control);
- ``dvp_no_mismatch``: ``dvp`` with every injected mismatch switched off (DVP's own cost, against ``no_mismatch``).

Every arm shares the model, the data, the batch, the optimiser settings and the learning-rate schedule
(``--lr_scheduler_type``, default ``constant``; ``dvp_length_decay`` multiplies it by the length-decay factor, which
is 1 until a surge). Runs of the same seed share the data order, the sampling seed and the noise seed. The
held-out metric is the task's (arithmetic: greedy accuracy on ``--eval_num_prompts`` test-split problems),
measured before training and every ``--eval_every`` steps (or at the steps ``--eval_steps``) by a ``TrainerCallback``;
for a sampled metric (freetext's), ``--eval_seeds`` draws it once per evaluation seed and ``--eval_on_rule`` also
scores it on ``--dvp_rule``'s support, both recorded per seed in ``results.json`` and aggregated in the report.

``--rollout_perturbation module:function`` names a factory ``function(seed: int) -> LogitsProcessor`` (transformers);
each run calls it once with its seed, and the processor sees the rollout's scores before the temperature warper and
the rollout log-probability recorder, so tokens are sampled from, and recorded under, what it returns.

Exit status: 0; 1 when a run failed (the report is still written, with the failure); 2 on a bad flag (before any
work).

Examples::

    safevocab study                                           # 5 arms x 3 seeds x 150 steps, noise 0.5
    safevocab study --noise 0 --output_dir runs/study-eps0    # the no-injected-mismatch control
    safevocab study --noise 0 --rollout_mantissa_bits 7 --arms no_remedy dvp dvp_mis no_mismatch --resume
    safevocab study --task my_tasks:make --rollout_perturbation my_perturbations:heavier_tail
    safevocab study --noise 0 --rollout_dtype bfloat16 --arms no_remedy dvp --seeds 0 1
    safevocab study --task freetext --noise 0 --sampler_rule min_p=0.05 --dvp_rule min_p=0.05 \
        --arms no_remedy tis dvp dvp_tis no_mismatch --seeds 1 2                    # the truncated sampler
    safevocab study --steps 3 --seeds 0 --arms no_remedy dvp --eval_num_prompts 20   # smoke run
    safevocab study --task freetext --noise 1 --noise_kind tail --arms no_remedy dvp no_mismatch dvp_no_mismatch \
        --eval_num_prompts 432 --eval_seeds 0 1 2 3 --eval_on_rule --eval_steps 0 150 200 250 300 --steps 300
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

from trl_integration.commands.errors import fail
from trl_integration.options import NOISE_KINDS, ROLLOUT_DTYPES
from trl_integration.study.arms import ARM_NAMES, DEFAULT_ARMS, MIS_MODES, StudySettings

__all__ = ["make_parser", "main", "run_parsed"]

PROG = "safevocab study"


def make_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The ``safevocab study`` argument parser (its defaults are `StudySettings`'s)."""
    d = StudySettings()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train GRPO on a task (default: the bundled tiny arithmetic model's) once per (arm, seed) under a "
        "controlled training-inference mismatch, and write report.md, PNG plots and results.json. See "
        "docs/results.md.",
    )
    p.add_argument(
        "--task",
        default=d.task,
        metavar="SPEC",
        help="the task: 'arithmetic', 'freetext' or 'module:function' returning a StudyTask (default: %(default)s)",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        default=d.arms,
        choices=ARM_NAMES,
        metavar="ARM",
        help=f"arms to run, among {', '.join(ARM_NAMES)} (default: {' '.join(DEFAULT_ARMS)})",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=d.seeds,
        metavar="SEED",
        help="seeds; each arm runs once per seed (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per run (default: %(default)s)")
    p.add_argument(
        "--eval_every",
        type=int,
        default=d.eval_every,
        help="held-out evaluation every K steps, plus step 0 and the last (default: %(default)s)",
    )
    p.add_argument(
        "--eval_num_prompts",
        type=int,
        default=d.eval_num_prompts,
        help="held-out prompts the task's metric scores (arithmetic: test-split problems, greedy; freetext: "
        "stdlib texts, sampled, 432 at most) (default: %(default)s)",
    )
    p.add_argument(
        "--eval_steps",
        nargs="+",
        type=int,
        default=d.eval_steps,
        metavar="STEP",
        help="evaluate at exactly these steps (increasing, 0 = before training) instead of every "
        "--eval_every steps (default: the --eval_every schedule)",
    )
    p.add_argument(
        "--eval_seeds",
        nargs="+",
        type=int,
        default=d.eval_seeds,
        metavar="SEED",
        help="draw the sampled held-out metric once per evaluation seed; the metric is their mean, each "
        "seed's value is kept (default: one draw with the task's own seed)",
    )
    p.add_argument(
        "--eval_on_rule",
        action="store_true",
        help="also score the held-out metric on --dvp_rule's support (sampled under its min_p or top_p), every arm "
        "alike, at the same steps and seeds (default: the full distribution only)",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=d.noise,
        metavar="EPS",
        help="bound of the injected rollout logit noise, 0 for none (default: %(default)s)",
    )
    p.add_argument(
        "--noise_kind",
        choices=NOISE_KINDS,
        default=d.noise_kind,
        help="uniform, clipped_gaussian, lift (deterministic: eps*min(1,(z_max-z_i)/10), a heavier "
        "tail) or tail (eps added to exactly the tokens --dvp_rule cuts at the rollout's logits, 0 "
        "elsewhere; in every arm) (default: %(default)s)",
    )
    p.add_argument(
        "--rollout_dtype",
        choices=tuple(ROLLOUT_DTYPES),
        default=d.rollout_dtype,
        help="precision of the generate rollouts (default: %(default)s)",
    )
    p.add_argument(
        "--rollout_mantissa_bits",
        type=int,
        default=d.rollout_mantissa_bits,
        metavar="K",
        help="rollouts sample with the current weights rounded to K mantissa bits, 1-23 (7: bfloat16's, "
        "10: float16's), a mismatch that follows the weights (default: not rounded)",
    )
    p.add_argument(
        "--rollout_perturbation",
        default=d.rollout_perturbation,
        metavar="MODULE:FUNCTION",
        help="a factory function(seed) -> transformers LogitsProcessor applied to the rollouts' scores (default: none)",
    )
    p.add_argument(
        "--sampler_rule",
        default=d.sampler_rule,
        metavar="RULE",
        help="every arm's rollouts sample with this rule (top_k/top_p/min_p, e.g. top_p=0.9 or min_p=0.05) "
        "and record their log-probabilities under it; the rule-none arms' trainer scores the full "
        "softmax, as stock trl does; the dvp arms compose it with --dvp_rule; the no_mismatch arms "
        "sample without it (default: the full distribution)",
    )
    p.add_argument("--dvp_rule", default=d.dvp_rule, help="safe-vocabulary rule of the dvp arms (default: %(default)s)")
    p.add_argument("--mis_mode", choices=MIS_MODES, default=d.mis_mode, help="mis arm's mode (default: %(default)s)")
    p.add_argument(
        "--is_clip_min", type=float, default=d.is_clip_min, help="mis: ratios below are masked (default: %(default)s)"
    )
    p.add_argument(
        "--is_clip_max",
        type=float,
        default=d.is_clip_max,
        help="tis: truncation; mis: ratios above are masked (default: %(default)s)",
    )
    p.add_argument("--learning_rate", type=float, default=d.learning_rate, help="(default: %(default)s)")
    p.add_argument(
        "--lr_scheduler_type",
        default=d.lr_scheduler_type,
        help="Trainer LR schedule of every arm; dvp_length_decay multiplies it by the length-decay factor "
        "(default: %(default)s)",
    )
    p.add_argument("--num_prompts_per_step", type=int, default=d.num_prompts_per_step, help="(default: %(default)s)")
    p.add_argument("--num_generations", type=int, default=d.num_generations, help="(default: %(default)s)")
    p.add_argument(
        "--max_completion_length", type=int, default=d.max_completion_length, help="(default: the task's, else 8)"
    )
    p.add_argument("--train_num_prompts", type=int, default=d.train_num_prompts, help="(default: %(default)s)")
    p.add_argument(
        "--model",
        default=None,
        help="model folder, or smollm2-135m (SmolLM2-135M-Instruct, converted once; docs/real_model.md) "
        "(default: the task's; arithmetic: the bundled tiny model)",
    )
    p.add_argument(
        "--smooth",
        type=int,
        default=d.smooth,
        help="moving-average window of the per-step plots (default: %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="torch threads during the study; 1 is fastest for the tiny model (default: %(default)s)",
    )
    p.add_argument("--output_dir", default=d.output_dir, help="report folder (default: %(default)s)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished runs of --output_dir's results.json and train only the others (refused "
        "when a setting differs; --arms and --seeds may add arms and seeds)",
    )
    p.add_argument("--no_plots", action="store_true", help="write report.md and results.json only")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def run_parsed(args: argparse.Namespace, command: str | None = None, prog: str = PROG) -> int:
    """Run the study on parsed flags; ``command`` is the command line the report records (default: every flag).

    Returns the exit status: 0; 1 when a run failed (the report is still written); 2 with a one-line message on a
    bad value, before any work.
    """
    from trl_integration.plugins import load_callable
    from trl_integration.study.report import format_stat, format_status
    from trl_integration.study.run import run_study
    from trl_integration.study.tasks import load_task

    settings = StudySettings(**{f.name: getattr(args, f.name) for f in fields(StudySettings)})
    try:
        settings.validate()
        if settings.model is not None:
            from trl_integration.demo.model_alias import resolve_model_alias

            # results.json records the folder, so a study resumed with the alias or with the folder is the same
            settings = replace(settings, model=resolve_model_alias(settings.model))
            if not Path(settings.model).is_dir():
                raise ValueError(f"--model {settings.model!r} is not a folder (save_pretrained output)")
        task = load_task(settings.task)  # a bad --task fails here, in one line, before anything is written
        if settings.rollout_perturbation is not None:
            load_callable(settings.rollout_perturbation, "--rollout_perturbation")
        # the spec, not the loaded task, so that results.json records what --task said
        results = run_study(
            settings, command=command, progress=not args.quiet, plots=not args.no_plots, resume=args.resume
        )  # a resumed study refuses other settings before any training
    except (ValueError, FileNotFoundError) as err:
        return fail(prog, str(err))
    summ = results["summary"]
    metric = task.metric_name
    resumed = f", {results['runs_resumed']} finished runs kept" if results["runs_resumed"] else ""
    print(f"{prog}: wrote {Path(settings.output_dir) / 'report.md'} ({results['wall_time_s']:.0f} s{resumed})")
    for arm in results["arms"]:
        e = summ[arm]
        print(
            f"  {arm:<18} runs ok {format_status(e):<12} held-out {metric}: final {format_stat(e['final_metric'])}  "
            f"late {format_stat(e['late_metric'])}  best {format_stat(e['best_metric'])};  training reward, last "
            f"steps {format_stat(e['final_reward'])}"
            + (
                f";  on the rule's support: late {format_stat(e['late_metric_rule'])}"
                if e["late_metric_rule"]["n"]
                else ""
            )
        )
    failed = sum(len(summ[a]["failed"]) for a in results["arms"])
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``safevocab study ARGS`` (``argv``: the arguments after ``study``; default ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    return run_parsed(args, command=f"{PROG} {shlex.join(argv)}".rstrip())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
