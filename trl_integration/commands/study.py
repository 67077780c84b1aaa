"""``safevocab study``: remedies for training–inference mismatch compared arm by arm, over several seeds.

Under one controlled mismatch (injected bounded logit noise ``--noise EPS`` on the ``generate`` rollouts, and/or a
lower rollout precision ``--rollout_dtype``), the command trains the same GRPO job once per *(arm, seed)*,
in-process and one after the other, and writes a report folder:

- ``report.md``: the settings, the exact command, a table of final and best held-out accuracy per arm (mean ± std
  over seeds), the final training reward per arm, the mismatch diagnostics, and any run that failed;
- one PNG per metric (reward, held-out accuracy, log-ppl gap, gradient norm, out-of-set fraction, response length,
  learning rate): one line per arm, the mean over seeds, with a shaded band from the smallest to the largest seed;
- ``results.json``: the settings and every run's per-step series (written after each run, so an interrupted study
  keeps what it finished).

The arms (``--arms``, default all five):

- ``no_remedy``: ``safe_vocab_rule=none`` (full vocabulary), no importance-sampling correction;
- ``tis``: ``none`` + truncated IS (``token_truncate``, the ratio clipped above at ``--is_clip_max``);
- ``mis``: ``none`` + masked IS (``--mis_mode`` ``token_mask`` or ``sequence_mask``; ratios outside
  ``[--is_clip_min, --is_clip_max]`` are zeroed);
- ``dvp``: ``--dvp_rule`` (default ``min_p=0.01``) in the sampler and the trainer, no IS;
- ``dvp_length_decay``: ``dvp`` + ``--length_decay --length_decay_period auto`` (the LR is held until the response
  length surges, then halved every ``round(1.8 x surge step)`` steps).

Every arm shares the model, the data, the batch, the optimiser settings and the learning-rate schedule
(``--lr_scheduler_type``, default ``constant``; ``dvp_length_decay`` replaces it by the length-decay schedule, which
is constant until a surge). Runs of the same seed share the data order, the sampling seed and the noise seed. The
held-out accuracy is greedy accuracy on a fixed set of ``--eval_num_prompts`` test-split arithmetic problems,
measured before training and every ``--eval_every`` steps by a ``TrainerCallback``.

Exit status: 0; 1 when a run failed (the report is still written, with the failure); 2 on a bad flag (before any
work).

Examples::

    safevocab study                                           # 5 arms x 3 seeds x 150 steps, noise 0.5
    safevocab study --noise 0 --output_dir runs/study-eps0    # the no-injected-mismatch control
    safevocab study --noise 0 --rollout_dtype bfloat16 --arms no_remedy dvp --seeds 0 1
    safevocab study --steps 3 --seeds 0 --arms no_remedy dvp --eval_num_prompts 20   # smoke run
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from trl_integration.commands.errors import fail
from trl_integration.rollout import NOISE_KINDS, ROLLOUT_DTYPES
from trl_integration.study.arms import ARM_NAMES, MIS_MODES, StudySettings

__all__ = ["make_parser", "main", "run_parsed"]

PROG = "safevocab study"


def make_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The ``safevocab study`` argument parser (its defaults are `StudySettings`'s)."""
    d = StudySettings()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train GRPO on the bundled tiny arithmetic model once per (arm, seed) under a controlled "
        "training-inference mismatch, and write report.md, PNG plots and results.json. See docs/results.md.",
    )
    p.add_argument("--arms", nargs="+", default=d.arms, choices=ARM_NAMES, metavar="ARM",
                   help=f"arms to run, among {', '.join(ARM_NAMES)} (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=d.seeds, metavar="SEED",
                   help="seeds; each arm runs once per seed (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--eval_every", type=int, default=d.eval_every,
                   help="held-out evaluation every K steps, plus step 0 and the last (default: %(default)s)")
    p.add_argument("--eval_num_prompts", type=int, default=d.eval_num_prompts,
                   help="held-out test-split problems scored greedily (default: %(default)s)")
    p.add_argument("--noise", type=float, default=d.noise, metavar="EPS",
                   help="bound of the injected rollout logit noise, 0 for none (default: %(default)s)")
    p.add_argument("--noise_kind", choices=NOISE_KINDS, default=d.noise_kind,
                   help="distribution of the noise (default: %(default)s)")
    p.add_argument("--rollout_dtype", choices=tuple(ROLLOUT_DTYPES), default=d.rollout_dtype,
                   help="precision of the generate rollouts (default: %(default)s)")
    p.add_argument("--dvp_rule", default=d.dvp_rule, help="safe-vocabulary rule of the dvp arms (default: %(default)s)")
    p.add_argument("--mis_mode", choices=MIS_MODES, default=d.mis_mode, help="mis arm's mode (default: %(default)s)")
    p.add_argument("--is_clip_min", type=float, default=d.is_clip_min,
                   help="mis: ratios below are masked (default: %(default)s)")
    p.add_argument("--is_clip_max", type=float, default=d.is_clip_max,
                   help="tis: truncation; mis: ratios above are masked (default: %(default)s)")
    p.add_argument("--learning_rate", type=float, default=d.learning_rate, help="(default: %(default)s)")
    p.add_argument("--lr_scheduler_type", default=d.lr_scheduler_type,
                   help="Trainer LR schedule of every arm but dvp_length_decay (default: %(default)s)")
    p.add_argument("--num_prompts_per_step", type=int, default=d.num_prompts_per_step, help="(default: %(default)s)")
    p.add_argument("--num_generations", type=int, default=d.num_generations, help="(default: %(default)s)")
    p.add_argument("--max_completion_length", type=int, default=d.max_completion_length,
                   help="(default: %(default)s)")
    p.add_argument("--train_num_prompts", type=int, default=d.train_num_prompts, help="(default: %(default)s)")
    p.add_argument("--model", default=None, help="model folder (default: the bundled tiny arithmetic model)")
    p.add_argument("--smooth", type=int, default=d.smooth,
                   help="moving-average window of the per-step plots (default: %(default)s)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads during the study; 1 is fastest for the tiny model (default: %(default)s)")
    p.add_argument("--output_dir", default=d.output_dir, help="report folder (default: %(default)s)")
    p.add_argument("--no_plots", action="store_true", help="write report.md and results.json only")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def run_parsed(args: argparse.Namespace, command: str | None = None, prog: str = PROG) -> int:
    """Run the study on parsed flags; ``command`` is the command line the report records (default: every flag).

    Returns the exit status: 0; 1 when a run failed (the report is still written); 2 with a one-line message on a
    bad value, before any work.
    """
    from trl_integration.study.report import format_stat, format_status
    from trl_integration.study.run import run_study

    settings = StudySettings(**{f.name: getattr(args, f.name) for f in fields(StudySettings)})
    try:
        settings.validate()
        if settings.model is not None and not Path(settings.model).is_dir():
            raise ValueError(f"--model {settings.model!r} is not a folder (save_pretrained output)")
    except ValueError as err:
        return fail(prog, str(err))
    results = run_study(settings, command=command, progress=not args.quiet, plots=not args.no_plots)
    summ = results["summary"]
    print(f"{prog}: wrote {Path(settings.output_dir) / 'report.md'} ({results['wall_time_s']:.0f} s)")
    for arm in results["arms"]:
        e = summ[arm]
        print(f"  {arm:<18} runs ok {format_status(e):<12} final acc {format_stat(e['final_accuracy'])}  "
              f"best {format_stat(e['best_accuracy'])}  final reward {format_stat(e['final_reward'])}")
    failed = sum(len(summ[a]["failed"]) for a in results["arms"])
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``safevocab study ARGS`` (``argv``: the arguments after ``study``; default ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    return run_parsed(args, command=f"{PROG} {shlex.join(argv)}".rstrip())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
