"""The arms of ``safevocab study`` and the settings every run shares (:class:`StudySettings`).

The arms (each a set of ``SafeVocabGRPOConfig`` overrides, :func:`arm_overrides`; the first five run by default,
``DEFAULT_ARMS``):

- ``no_remedy``: ``safe_vocab_rule=none`` (full vocabulary), no importance-sampling correction;
- ``tis``: ``none`` + truncated IS (``token_truncate``, the ratio clipped above at ``is_clip_max``);
- ``mis``: ``none`` + masked IS (``mis_mode`` ``token_mask`` or ``sequence_mask``; ratios outside
  ``[is_clip_min, is_clip_max]`` are zeroed);
- ``dvp``: ``dvp_rule`` (default ``min_p=0.01``) in the sampler and the trainer, no IS;
- ``dvp_length_decay``: ``dvp`` + ``length_decay`` with ``length_decay_period="auto"`` (the LR is held until the
  response length surges, then halved every ``round(1.8 x surge step)`` steps);
- ``dvp_mis``: ``dvp`` + the ``mis`` arm's masked IS;
- ``dvp_tis``: ``dvp`` + the ``tis`` arm's truncated IS (the ratio of the two renormalised distributions);
- ``no_mismatch``: ``no_remedy`` with every injected mismatch switched off (no logit noise, no rounded weights, no
  plug-in perturbation, ``rollout_dtype="auto"``, no sampler truncation): the matched zero-mismatch control, on the
  same seeds;
- ``dvp_no_mismatch``: ``dvp`` with every injected mismatch switched off (``no_mismatch``'s switches, ``dvp``'s rule
  in the sampler and the trainer): DVP's own cost, measured against ``no_mismatch`` on the same seeds.

Every arm shares the rest (:func:`shared_config`: the tiny GRPO job of :func:`trl_integration.demo.tiny_grpo_config`
with the study's batch, steps, learning-rate schedule and injected mismatch); runs of the same seed share the data
order, the sampling seed and the noise seed.

**The truncated sampler** (``sampler_rule``, ``--sampler_rule``, e.g. ``top_p=0.9`` or ``min_p=0.05``): every arm's
rollouts are sampled with that rule, and the rollout log-probabilities are recorded under it (renormalised over its
kept set, what vLLM returns with ``logprobs_mode="processed_logprobs"``). The arms with rule ``none`` (``no_remedy``,
``tis``, ``mis``) keep the sampler's rule apart from the trainer's (``safe_vocab_in_sampler=False``), so their trainer
scores the full softmax, as stock trl does with vLLM's ``top_p``/``min_p``: the mismatch is ``log Z``, the kept mass,
on every token. The ``dvp`` arms compose their rule with the sampler's in sampler and trainer alike (with ``--dvp_rule``
equal to ``--sampler_rule``, they train on exactly what was sampled). ``no_mismatch`` and ``dvp_no_mismatch`` sample
without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trl_integration.demo.config import TINY_GRPO_DEFAULTS, tiny_grpo_config_kwargs
from trl_integration.options import MANTISSA_BITS_RANGE, NOISE_KINDS, ROLLOUT_DTYPES
from trl_integration.plugins import split_spec

__all__ = [
    "ARM_NAMES", "DEFAULT_ARMS", "ARM_DESCRIPTIONS", "MIS_MODES", "StudySettings", "arm_overrides", "shared_config",
    "resolved_max_completion_length", "rule_sampling", "NEUTRAL_SAMPLER",
]  # fmt: skip

#: The arms, in report order.
ARM_NAMES: tuple[str, ...] = (
    "no_remedy",
    "tis",
    "mis",
    "dvp",
    "dvp_length_decay",
    "dvp_mis",
    "dvp_tis",
    "no_mismatch",
    "dvp_no_mismatch",
)

#: The arms a study runs when ``--arms`` is not given (those of the bundled study, docs/results.md).
DEFAULT_ARMS: tuple[str, ...] = ("no_remedy", "tis", "mis", "dvp", "dvp_length_decay")

#: One line per arm for the report.
ARM_DESCRIPTIONS: dict[str, str] = {
    "no_remedy": "full vocabulary (rule none), no IS correction",
    "tis": "rule none + token-level truncated IS (token_truncate)",
    "mis": "rule none + masked IS",
    "dvp": "DVP: safe-vocabulary rule in sampler and trainer, no IS",
    "dvp_length_decay": "DVP + length-decay LR (period auto)",
    "dvp_mis": "DVP + masked IS (the mis arm's)",
    "dvp_tis": "DVP + token-level truncated IS (the tis arm's)",
    "no_mismatch": "no remedy, every injected mismatch switched off (matched zero-mismatch control)",
    "dvp_no_mismatch": "DVP (the dvp arm's rule), every injected mismatch switched off (DVP's own cost)",
}

#: Modes of the ``mis`` arm (trl's masked importance sampling).
MIS_MODES = ("token_mask", "sequence_mask")

#: trl's sampler settings that truncate nothing (``GRPOConfig`` defaults): what the no-mismatch arms sample with.
NEUTRAL_SAMPLER: dict[str, Any] = {"top_k": 0, "top_p": 1.0, "min_p": None}


@dataclass
class StudySettings:
    """Everything a study run depends on (the command-line flags of ``safevocab study``).

    The batch, completion length and learning rate default to the tiny demo job's (``TINY_GRPO_DEFAULTS``).

    Attributes:
        arms: arm names, a subset of `ARM_NAMES`, in the order they run (default `DEFAULT_ARMS`).
        seeds: training seeds; each arm runs once per seed (sampling, data order and noise seeds).
        steps: optimizer steps per run.
        eval_every: held-out evaluation every this many steps (and at step 0 and at the last step).
        eval_num_prompts: size of the task's fixed held-out set (arithmetic: test split, seed 1; freetext: at most
            432, all its held-out prompts).
        eval_steps: evaluate at exactly these steps (increasing, in ``[0, steps]``; 0 is before training) instead
            of the ``eval_every`` schedule; ``None``: the ``eval_every`` schedule.
        eval_seeds: score the held-out metric once per evaluation seed (its sampling seed) and record each value
            and their mean (the metric); ``None``: one score with the task's own seed (the metric must take a
            ``seed`` keyword, ``StudyTask.metric_keywords``).
        eval_on_rule: also score the held-out metric on the support of ``dvp_rule`` (a ``min_p=RHO`` or ``top_p=P``
            rule: the metric samples under it, as a DVP-trained policy is deployed), every arm alike, at every
            evaluation and evaluation seed (the metric must take the ``min_p`` or ``top_p`` keyword).
        task: the task (``arithmetic``, ``freetext`` or ``module:function``, see
            :func:`trl_integration.study.tasks.load_task`): data, reward and held-out metric.
        noise: bound ε of the injected rollout logit noise (``rollout_logit_noise``); 0 disables it.
        noise_kind: ``uniform``, ``clipped_gaussian``, ``lift`` (the biased, deterministic lift of every token but
            the top one) or ``tail`` (``noise`` added to exactly the tokens ``dvp_rule`` cuts at the rollout's
            logits, in every arm).
        rollout_dtype: precision of the ``generate`` rollouts (``auto`` = the model's, float32 here).
        rollout_mantissa_bits: the rollouts sample with the weights rounded to this many mantissa bits (1-23;
            ``None``: not rounded), a mismatch that follows the weights as they train.
        rollout_perturbation: ``module:function``, a factory ``f(seed) -> LogitsProcessor`` applied to the
            rollouts' scores (``None``: none).
        sampler_rule: the rule every arm's rollouts are sampled with (``top_k``/``top_p``/``min_p``, e.g.
            ``"top_p=0.9"``; ``None``: the full distribution); the ``none`` arms' trainer scores the full softmax
            (the truncated-sampler mismatch of stock trl), the ``dvp`` arms compose it with ``dvp_rule``.
        dvp_rule: safe-vocabulary rule of the ``dvp`` arms.
        mis_mode: ``token_mask`` or ``sequence_mask`` for the ``mis`` arm.
        is_clip_min: lower IS bound of the ``mis`` arm (ratios below it are masked).
        is_clip_max: upper IS bound of ``tis`` (truncation) and ``mis`` (masking).
        learning_rate: initial learning rate.
        lr_scheduler_type: the Trainer's schedule of every arm (``dvp_length_decay`` multiplies it by the
            length-decay factor).
        num_prompts_per_step: prompts per optimizer step (the batch is this times ``num_generations``).
        num_generations: completions per prompt (the GRPO group size).
        max_completion_length: longest completion in tokens (``None``: the task's, else the tiny job's 8).
        train_num_prompts: size of the training prompt pool (train split, seed 0).
        model: model folder; ``None`` = the task's (the bundled tiny model for ``arithmetic``).
        smooth: trailing moving-average window (steps) of the per-step training metrics in the plots.
        threads: torch intra-op threads during the study (``torch.set_num_threads``). The default 1 is the fastest
            for the tiny model on a shared CPU: 2 threads were ~6x slower per step when other jobs loaded the cores.
        output_dir: where the report, the plots and ``results.json`` go.
    """

    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    steps: int = 150
    eval_every: int = 25
    eval_num_prompts: int = 200
    eval_steps: list[int] | None = None
    eval_seeds: list[int] | None = None
    eval_on_rule: bool = False
    task: str = "arithmetic"
    noise: float = 0.5
    noise_kind: str = "uniform"
    rollout_dtype: str = "auto"
    rollout_mantissa_bits: int | None = None
    rollout_perturbation: str | None = None
    sampler_rule: str | None = None
    dvp_rule: str = "min_p=0.01"
    mis_mode: str = "token_mask"
    is_clip_min: float = 0.5
    is_clip_max: float = 2.0
    learning_rate: float = TINY_GRPO_DEFAULTS["learning_rate"]
    lr_scheduler_type: str = "constant"
    num_prompts_per_step: int = (
        TINY_GRPO_DEFAULTS["per_device_train_batch_size"] // TINY_GRPO_DEFAULTS["num_generations"]
    )
    num_generations: int = TINY_GRPO_DEFAULTS["num_generations"]
    max_completion_length: int | None = None
    train_num_prompts: int = 4096
    model: str | None = None
    smooth: int = 10
    threads: int = 1
    output_dir: str = "runs/safevocab-study"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag on any out-of-range value."""
        unknown = [a for a in self.arms if a not in ARM_NAMES]
        if unknown or not self.arms:
            raise ValueError(f"--arms {self.arms!r} is not accepted: accepted a non-empty subset of {list(ARM_NAMES)}")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"--arms {self.arms!r} repeats an arm")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds {self.seeds!r} is not accepted: accepted distinct integers")
        for name in (
            "steps",
            "eval_every",
            "eval_num_prompts",
            "num_prompts_per_step",
            "num_generations",
            "max_completion_length",
            "train_num_prompts",
            "smooth",
            "threads",
        ):
            value = getattr(self, name)
            if name == "max_completion_length" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name} {value!r} is out of range: accepted an integer >= 1")
        self._validate_evaluation()
        if self.num_generations < 2:
            raise ValueError(f"--num_generations {self.num_generations!r} is out of range: GRPO needs >= 2")
        if not (math.isfinite(self.noise) and self.noise >= 0):
            raise ValueError(f"--noise {self.noise!r} is out of range: accepted a finite float >= 0")
        if self.noise_kind not in NOISE_KINDS:
            raise ValueError(f"--noise_kind {self.noise_kind!r} is not accepted: accepted one of {NOISE_KINDS}")
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise ValueError(
                f"--rollout_dtype {self.rollout_dtype!r} is not accepted: accepted one of {tuple(ROLLOUT_DTYPES)}"
            )
        self._validate_mismatch_sources()
        if self.mis_mode not in MIS_MODES:
            raise ValueError(f"--mis_mode {self.mis_mode!r} is not accepted: accepted one of {MIS_MODES}")
        if not (0 <= self.is_clip_min < self.is_clip_max):
            raise ValueError(
                f"--is_clip_min {self.is_clip_min!r} / --is_clip_max {self.is_clip_max!r} are out of range: "
                "accepted 0 <= min < max"
            )
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"--learning_rate {self.learning_rate!r} is out of range: accepted a float > 0")
        from safevocab import NoPruning, parse_rule

        dvp_rule = parse_rule(self.dvp_rule)  # raises ValueError naming the rule
        if self.noise_kind == "tail" and self.noise > 0 and isinstance(dvp_rule, NoPruning):
            raise ValueError(
                "--noise_kind tail lifts the tokens --dvp_rule cuts, and --dvp_rule 'none' cuts nothing: "
                "accepted a rule that prunes, e.g. --dvp_rule min_p=0.01"
            )

    def _validate_evaluation(self) -> None:
        for name in ("eval_steps", "eval_seeds"):
            values = getattr(self, name)
            if values is not None and (
                not isinstance(values, list)
                or not values
                or any(not isinstance(v, int) or isinstance(v, bool) for v in values)
            ):
                raise ValueError(f"--{name} {values!r} is not accepted: accepted a non-empty list of integers")
        steps = self.eval_steps
        if steps is not None and (
            any(b <= a for a, b in zip(steps, steps[1:])) or steps[0] < 0 or steps[-1] > self.steps
        ):
            raise ValueError(
                f"--eval_steps {steps!r} is not accepted: accepted increasing steps in [0, --steps {self.steps}]"
            )
        if self.eval_seeds is not None and len(set(self.eval_seeds)) != len(self.eval_seeds):
            raise ValueError(f"--eval_seeds {self.eval_seeds!r} is not accepted: accepted distinct integers")
        if not isinstance(self.eval_on_rule, bool):
            raise ValueError(f"--eval_on_rule {self.eval_on_rule!r} is not accepted: accepted True or False")
        if self.eval_on_rule:
            rule_sampling(self)  # a --dvp_rule without a min_p or top_p to sample under is refused here

    def _validate_mismatch_sources(self) -> None:
        if not isinstance(self.task, str) or not self.task:
            raise ValueError(f"--task {self.task!r} is not accepted: accepted a task name or 'module:function'")
        bits, (lo, hi) = self.rollout_mantissa_bits, MANTISSA_BITS_RANGE
        if bits is not None and (not isinstance(bits, int) or isinstance(bits, bool) or not lo <= bits <= hi):
            raise ValueError(f"--rollout_mantissa_bits {bits!r} is not accepted: accepted an integer in [{lo}, {hi}]")
        if bits is not None and self.rollout_dtype in ("bfloat16", "float16"):
            raise ValueError(
                f"--rollout_mantissa_bits {bits} with --rollout_dtype {self.rollout_dtype} rounds the rollout twice: "
                "accepted --rollout_dtype auto or float32"
            )
        if self.rollout_perturbation is not None:
            split_spec(self.rollout_perturbation, "--rollout_perturbation")
        if self.sampler_rule is not None:
            from safevocab import MinProb, NoPruning, parse_rule

            if not isinstance(self.sampler_rule, str):
                raise ValueError(
                    f"--sampler_rule {self.sampler_rule!r} is not accepted: accepted a rule such as "
                    "'top_p=0.9' or 'min_p=0.05'"
                )
            rule = parse_rule(self.sampler_rule)  # raises ValueError naming the rule
            if isinstance(rule, NoPruning) or any(isinstance(part, MinProb) for part in rule.parts):
                raise ValueError(
                    f"--sampler_rule {self.sampler_rule!r} is not accepted: accepted a rule a sampler "
                    "applies that prunes (top_k, top_p, min_p), e.g. 'top_p=0.9' or 'min_p=0.05'"
                )


def rule_sampling(settings: StudySettings) -> dict[str, float]:
    """The sampler keyword that draws from ``settings.dvp_rule``'s support, the one ``eval_on_rule`` scores on:
    ``{"min_p": RHO}`` for ``min_p=RHO``, ``{"top_p": P}`` for ``top_p=P``.

    Raises:
        ValueError: the rule is neither a single ``min_p`` nor a single ``top_p`` (a held-out metric samples under one
            of those).
    """
    from safevocab import MinP, TopP, parse_rule

    rule = parse_rule(settings.dvp_rule)
    if isinstance(rule, MinP):
        return {"min_p": float(rule.rho)}
    if isinstance(rule, TopP):
        return {"top_p": float(rule.q)}
    raise ValueError(
        f"--eval_on_rule scores on --dvp_rule's support by sampling under it: accepted a --dvp_rule min_p=RHO or "
        f"top_p=P, got {str(rule)!r}"
    )


# ----------------------------------------------------------------------------------------------------
# arms and runs
# ----------------------------------------------------------------------------------------------------


def arm_overrides(arm: str, settings: StudySettings) -> dict[str, Any]:
    """The ``SafeVocabGRPOConfig`` fields that define ``arm`` (on top of the shared settings)."""
    no_is = dict(vllm_importance_sampling_correction=False)
    # with a truncated sampler, the rule-none arms keep it apart from the trainer (stock trl: full-softmax scoring)
    apart = dict(safe_vocab_in_sampler=False) if settings.sampler_rule is not None else {}
    if arm == "no_remedy":
        return dict(safe_vocab_rule="none", **apart, **no_is)
    if arm == "tis":
        return dict(
            **apart,
            safe_vocab_rule="none",
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_min=None,
            vllm_importance_sampling_clip_max=settings.is_clip_max,
        )
    if arm == "mis":
        return dict(
            **apart,
            safe_vocab_rule="none",
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=settings.mis_mode,
            vllm_importance_sampling_clip_min=settings.is_clip_min,
            vllm_importance_sampling_clip_max=settings.is_clip_max,
        )
    if arm == "dvp":
        return dict(safe_vocab_rule=settings.dvp_rule, safe_vocab_in_sampler=True, **no_is)
    if arm == "dvp_length_decay":
        return dict(
            safe_vocab_rule=settings.dvp_rule,
            safe_vocab_in_sampler=True,
            length_decay=True,
            length_decay_period="auto",
            **no_is,
        )
    if arm in ("dvp_mis", "dvp_tis"):
        correction = arm_overrides(arm[len("dvp_") :], settings)
        return {**correction, "safe_vocab_rule": settings.dvp_rule, "safe_vocab_in_sampler": True}
    if arm == "no_mismatch":
        untruncated = dict(NEUTRAL_SAMPLER) if settings.sampler_rule is not None else {}
        return dict(
            safe_vocab_rule="none",
            rollout_logit_noise=0.0,
            rollout_mantissa_bits=None,
            rollout_perturbation=None,
            rollout_dtype="auto",
            **untruncated,
            **no_is,
        )
    if arm == "dvp_no_mismatch":
        return {
            **arm_overrides("no_mismatch", settings),
            "safe_vocab_rule": settings.dvp_rule,
            "safe_vocab_in_sampler": True,
        }
    raise ValueError(f"unknown arm {arm!r}: accepted one of {list(ARM_NAMES)}")


def resolved_max_completion_length(settings: StudySettings, task_length: int | None = None) -> int:
    """The completion length a study trains with: ``settings.max_completion_length``, else the task's, else the
    tiny job's (``TINY_GRPO_DEFAULTS``)."""
    for length in (settings.max_completion_length, task_length):
        if length is not None:
            return length
    return TINY_GRPO_DEFAULTS["max_completion_length"]


def shared_config(settings: StudySettings, seed: int, output_dir: str) -> dict[str, Any]:
    """The ``SafeVocabGRPOConfig`` fields every arm shares: the tiny job with the study's batch, schedule and
    injected mismatch (the truncated sampler's ``top_k``/``top_p``/``min_p`` included), logging every step, without
    gradient checkpointing or a progress bar of its own."""
    sampler: dict[str, Any] = {}
    if settings.sampler_rule is not None:
        from safevocab import parse_rule

        sampler = {**NEUTRAL_SAMPLER, **parse_rule(settings.sampler_rule).sampler_kwargs()}
    return tiny_grpo_config_kwargs(
        **sampler,
        output_dir=output_dir,
        max_steps=settings.steps,
        per_device_train_batch_size=settings.num_prompts_per_step * settings.num_generations,
        num_generations=settings.num_generations,
        max_completion_length=resolved_max_completion_length(settings),
        learning_rate=settings.learning_rate,
        lr_scheduler_type=settings.lr_scheduler_type,
        logging_steps=1,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=seed,
        rollout_noise_seed=seed,
        rollout_logit_noise=settings.noise,
        rollout_logit_noise_kind=settings.noise_kind,
        rollout_tail_rule=settings.dvp_rule,  # the noise kind 'tail' lifts what the dvp arms' rule cuts
        rollout_dtype=settings.rollout_dtype,
        rollout_mantissa_bits=settings.rollout_mantissa_bits,
        rollout_perturbation=settings.rollout_perturbation,
        rollout_logprobs=True,
        log_mismatch_metrics=True,
        log_entropy_metrics=True,  # the full-softmax and kept-set entropies of every arm (the collapse criterion)
    )
