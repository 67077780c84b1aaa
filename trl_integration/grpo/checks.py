"""Every check the config makes when it is built, each a one-line error naming the field.

A leaf like the config: it imports no implementation module (``rollout_perturbation`` is imported here, so that a bad
module fails when the config is built, before any model loads; the factory itself is called by the trainer).

**Precision** (:func:`bf16_supported`, :func:`fp16_amp_supported`): which mixed precision this machine can run.
transformers refuses ``bf16=True`` without a bf16-capable accelerator (or ``use_cpu=True``), with "Your setup
doesn't support bf16/gpu", and trl reads an unset ``bf16`` as ``True``: :func:`bf16_supported` is the very check
transformers raises on, so the config can default ``bf16`` to ``False`` exactly where it would fail. accelerate runs
fp16 autocast and loss scaling on an accelerator only, never on CPU.

**Length decay** (:func:`check_length_decay`): the period (``"auto"`` or an integer >= 1), the start, the floor, the
cap on decays and the cooldown, the surge detector's settings, and the schedules length decay cannot multiply. The
length-decay factor (``safevocab.schedulers.LengthDecayLR``, installed through the Trainer's ``create_scheduler``)
multiplies whatever schedule transformers builds from ``lr_scheduler_type``, warm-up and ``lr_scheduler_kwargs``,
stepped once per optimizer step; ``reduce_lr_on_plateau`` and ``greedy`` step on evaluation metrics instead and are
refused with one line (:func:`refuse_unwrappable_lr_schedules`). Settings that would be ignored are refused too: a
cooldown without a second decay, an EMA coefficient without the EMA baseline.

**Mismatch lab and rollout paths** (:func:`check_mismatch_lab`, :func:`check_rollout_paths`): ``rollout_logit_noise*``,
``rollout_tail_rule``, ``rollout_mantissa_bits``, ``rollout_perturbation``, ``zero_mismatch``; what each rollout path
(``generate``, vLLM, continuous batching) supports, and fp16 on CPU.

Checks that need what trl built (the tokenizer, the dataset) are in :mod:`trl_integration.grpo.trainer_checks`.
"""

from __future__ import annotations

import warnings

import torch

from safevocab import NoPruning, parse_rule
from safevocab.validation import integer, real
from trl_integration.options import (
    EMPTY_STEP_ACTIONS,
    IS_MODES,
    LENGTH_DECAY_STARTS,
    LENGTH_SURGE_BASELINES,
    MANTISSA_BITS_RANGE,
    NOISE_KINDS,
    OUT_OF_SET_MODES,
    ROLLOUT_DTYPES,
    SCORING_MODES,
    SUPPORT_SOURCES,
)
from trl_integration.plugins import load_callable

__all__ = [
    "check_safe_vocab_fields", "warn_on_sampler_rule_mismatch", "one_of", "bf16_supported", "fp16_amp_supported",
    "check_length_decay", "refuse_unwrappable_lr_schedules", "STRING_CHOICES", "check_rule_text", "check_mismatch_lab",
    "check_rollout_paths", "check_report_to", "check_allowed_changes",
]  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# the safe-vocabulary fields


def one_of(name: str, value: object, accepted: tuple, in_words: str | None = None) -> None:
    """``ValueError`` naming the field, the value and the accepted values, unless ``value`` is one of them."""
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not accepted: accepted {in_words or f'one of {accepted}'}")


#: The string fields with a fixed set of values: field -> the accepted values (``safevocab-grpo`` checks them before
#: it imports trl, :mod:`trl_integration.commands.early_checks`, with the same messages as the config).
STRING_CHOICES: dict[str, tuple[str, ...]] = {
    "safe_vocab_out_of_set": OUT_OF_SET_MODES,
    "rollout_dtype": tuple(ROLLOUT_DTYPES),
    "safe_vocab_scoring": SCORING_MODES,
    "safe_vocab_support": SUPPORT_SOURCES,
    "safe_vocab_empty_step": EMPTY_STEP_ACTIONS,
}


def check_rule_text(name: str, text: str, engine: str | None = None):
    """The parsed rule of field ``name`` (``ValueError`` naming it for an empty or invalid rule)."""
    if isinstance(text, str) and not text.strip():
        # An empty value is most often an unset shell variable: refused, never read as "none" (the same in Python, in
        # YAML and on the command line, which builds the config).
        raise ValueError(
            f"{name}='' is not accepted: accepted a rule such as 'min_p=0.001' or 'top_k=50', or 'none' "
            "for the full vocabulary"
        )
    try:
        return parse_rule(text) if engine is None else parse_rule(text, engine=engine)
    except (ValueError, TypeError) as err:  # the rule's own message, prefixed by the field it came from
        raise type(err)(f"{name}={text!r}: {err}") from None


def check_safe_vocab_fields(config) -> None:
    """Validate (and normalise in place) the safe-vocabulary fields of a ``SafeVocabGRPOConfig``: the rule (parsed
    into ``config._rule``; an empty one refused), the out-of-set mode, the rollout dtype, the mismatch buckets, the
    chunk budget and the kept-logits cap, the scoring and support sources, the out-of-set alert's threshold and
    empty-step action, and the resume opt-outs."""
    check_allowed_changes(config)  # the boolean fields were parsed first (grpo/value_checks.py)
    # The rule composes in the order of the engine that samples the rollouts (vLLM's differs from generate's).
    config._rule = check_rule_text("safe_vocab_rule", config.safe_vocab_rule, engine=config.rule_engine)
    config.safe_vocab_rule = str(config._rule)
    one_of("safe_vocab_out_of_set", config.safe_vocab_out_of_set, STRING_CHOICES["safe_vocab_out_of_set"])
    one_of("rollout_dtype", config.rollout_dtype, STRING_CHOICES["rollout_dtype"])
    if isinstance(config.mismatch_buckets, (int, float)):
        config.mismatch_buckets = [config.mismatch_buckets]
    edges = [float(e) for e in (config.mismatch_buckets or [])]
    if any(not (0.0 < e < 1.0) for e in edges) or any(a >= b for a, b in zip(edges[:-1], edges[1:])):
        raise ValueError(
            f"mismatch_buckets={config.mismatch_buckets!r} is out of range: accepted strictly increasing values in "
            "(0, 1)"
        )
    config.mismatch_buckets = edges
    config.safe_vocab_max_chunk_bytes = integer(
        "safe_vocab_max_chunk_bytes", config.safe_vocab_max_chunk_bytes, lambda n: n > 0, "an integer > 0"
    )
    config.safe_vocab_keep_logits_bytes = integer(
        "safe_vocab_keep_logits_bytes",
        config.safe_vocab_keep_logits_bytes,
        lambda n: n >= 0,
        "an integer >= 0 (0: recompute)",
    )
    one_of("safe_vocab_scoring", config.safe_vocab_scoring, STRING_CHOICES["safe_vocab_scoring"])
    one_of("safe_vocab_support", config.safe_vocab_support, STRING_CHOICES["safe_vocab_support"])
    config.safe_vocab_out_of_set_warn_frac = real(
        "safe_vocab_out_of_set_warn_frac",
        config.safe_vocab_out_of_set_warn_frac,
        lambda x: 0.0 <= x <= 1.0,
        "a number in [0, 1] (1: never warn)",
    )
    one_of("safe_vocab_empty_step", config.safe_vocab_empty_step, STRING_CHOICES["safe_vocab_empty_step"])


def check_allowed_changes(config) -> None:
    """``resume_allow_changed_settings`` as a list of the settings a resume may be told to accept (a single name is
    taken as a list of one); ``ValueError`` naming an unknown one."""
    from trl_integration.options import RESUME_ALLOW_FIELD as ALLOW_FIELD
    from trl_integration.options import RESUME_REFUSED_SETTINGS as REFUSED_SETTINGS

    names = getattr(config, ALLOW_FIELD)
    names = [names] if isinstance(names, str) else list(names or [])
    for name in names:
        if name not in REFUSED_SETTINGS:
            raise ValueError(f"{ALLOW_FIELD} holds {name!r}: accepted names of settings a resume refuses to change, "
                             f"{list(REFUSED_SETTINGS)} (a changed learning rate, schedule or max_steps needs none)")  # fmt: skip
    setattr(config, ALLOW_FIELD, names)


def warn_on_sampler_rule_mismatch(config, rule) -> None:
    """One warning when ``safe_vocab_in_sampler=False`` leaves the sampler with another rule than the trainer's."""
    if not config.safe_vocab_in_sampler and str(config.sampler_rule) != str(rule):
        warnings.warn(
            f"safe_vocab_in_sampler=False: rollouts are sampled with {str(config.sampler_rule)!r} but the trainer "
            f"scores with {str(rule)!r}. Importance ratios then carry a log(kept-mass) offset and sampled tokens "
            "outside the trainer's set are masked.", UserWarning, stacklevel=5,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# precision


def bf16_supported() -> bool:
    """Whether transformers accepts ``bf16=True`` without ``use_cpu`` here (a bf16 GPU/XPU/NPU/MPS, or XLA)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return is_torch_bf16_gpu_available() or is_torch_xla_available()


def fp16_amp_supported(use_cpu: bool = False) -> bool:
    """Whether accelerate can run fp16 mixed precision (autocast + GradScaler) here: any non-CPU device."""
    if use_cpu:
        return False
    xpu, mps = getattr(torch, "xpu", None), getattr(torch.backends, "mps", None)
    return bool(torch.cuda.is_available() or (xpu and xpu.is_available()) or (mps and mps.is_available()))


# ----------------------------------------------------------------------------------------------------
# length decay


def check_length_decay(config) -> None:
    """Validate (and normalise in place) the ``length_decay*`` and ``length_surge_*`` fields of a
    ``SafeVocabGRPOConfig``. Raises ``ValueError`` (one line naming the field)."""
    # Kept as a string ('auto' or digits) so the command line and YAML take both forms.
    period = str(config.length_decay_period).strip().lower()
    if period != "auto":
        value = int(period) if period.lstrip("-").isdigit() else 0
        if value < 1:
            raise ValueError(
                f"length_decay_period={config.length_decay_period!r} is not accepted: accepted 'auto' or an "
                "integer >= 1"
            )
        period = str(value)
    config.length_decay_period = period
    if config.length_decay_start not in LENGTH_DECAY_STARTS:
        raise ValueError(
            f"length_decay_start={config.length_decay_start!r} is not accepted: accepted 'on_surge' or 'step0'"
        )
    if config.length_decay and config.length_decay_start == "step0" and config.length_decay_auto_period:
        raise ValueError(
            "length_decay_start='step0' needs an integer length_decay_period (no surge is detected to derive "
            "'auto' from): e.g. --length_decay_period 200"
        )
    config.length_decay_max_decays = integer(
        "length_decay_max_decays", config.length_decay_max_decays, lambda n: n >= 1, "an integer >= 1"
    )
    config.length_decay_cooldown = integer(
        "length_decay_cooldown", config.length_decay_cooldown, lambda n: n >= 0, "an integer number of steps >= 0"
    )
    one_of("length_surge_baseline", config.length_surge_baseline, LENGTH_SURGE_BASELINES)
    alpha = config.length_surge_ema_alpha
    if alpha is not None:
        if config.length_surge_baseline != "ema":
            raise ValueError(
                f"length_surge_ema_alpha={alpha!r} with length_surge_baseline={config.length_surge_baseline!r}: "
                "accepted only with length_surge_baseline='ema'"
            )
        config.length_surge_ema_alpha = real(
            "length_surge_ema_alpha", alpha, lambda a: 0.0 < a <= 1.0, "0 < alpha <= 1"
        )
    if config.length_decay:
        refuse_unwrappable_lr_schedules(config)
        if config.length_decay_cooldown > 0 and config.length_decay_max_decays == 1:
            raise ValueError(
                f"length_decay_cooldown={config.length_decay_cooldown!r} with length_decay_max_decays=1: the cooldown "
                "spaces decays after the first and there are none; set --length_decay_max_decays 2 or more, or drop it"
            )
    # Build the scheduler's pieces once here, so a bad value fails at construction, not at step 0.
    config.make_surge_detector()
    config.length_decay_min_lr_ratio = real(
        "length_decay_min_lr_ratio", config.length_decay_min_lr_ratio, lambda r: 0.0 <= r <= 1.0, "0 <= ratio <= 1"
    )


def refuse_unwrappable_lr_schedules(config) -> None:
    """Raise ``ValueError`` (one line naming the field) when ``config`` (a ``SafeVocabGRPOConfig`` with
    ``length_decay=True``) asks for a schedule that length decay cannot multiply: one stepped on evaluation metrics
    rather than once per optimizer step."""
    schedule = getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)
    if schedule in ("reduce_lr_on_plateau", "greedy"):
        raise ValueError(
            f"lr_scheduler_type={schedule!r} with length_decay=True: length decay multiplies a schedule stepped once "
            "per optimizer step, and this one steps on evaluation metrics; accepted any other lr_scheduler_type "
            "(e.g. 'constant', 'cosine'), or set --length_decay false"
        )


# ----------------------------------------------------------------------------------------------------
# mismatch lab and rollout paths


def check_mismatch_lab(config) -> None:
    """Validate (and normalise in place) the mismatch-lab fields of a ``SafeVocabGRPOConfig``.

    Raises:
        ValueError: a value out of range, or a combination that cannot work: an injected mismatch with
            ``use_vllm``/continuous batching (they act on the plain ``generate`` path only), or with
            ``zero_mismatch`` (which would hide it from the objective), or mantissa rounding with a lower
            ``rollout_dtype`` (rounding twice).
    """
    noise = config.rollout_logit_noise  # as given, for the messages below
    config.rollout_logit_noise = real("rollout_logit_noise", noise, lambda eps: eps >= 0, "a finite float >= 0")
    if config.rollout_logit_noise_kind not in NOISE_KINDS:
        raise ValueError(
            f"rollout_logit_noise_kind={config.rollout_logit_noise_kind!r} is not accepted: accepted one of "
            f"{NOISE_KINDS}"
        )
    _check_tail_rule(config)
    config.rollout_noise_seed = integer("rollout_noise_seed", config.rollout_noise_seed)
    bits = config.rollout_mantissa_bits
    if bits is not None:
        lo, hi = MANTISSA_BITS_RANGE
        bits = integer("rollout_mantissa_bits", bits)
        if not lo <= bits <= hi:
            raise ValueError(f"rollout_mantissa_bits={bits!r} is not accepted: accepted an integer in [{lo}, {hi}]")
        config.rollout_mantissa_bits = bits
    if config.rollout_perturbation is not None:
        load_callable(config.rollout_perturbation, "rollout_perturbation")
    injected = [
        f"{name}={value!r}"
        for name, value, on in (
            ("rollout_logit_noise", noise, noise > 0),
            ("rollout_mantissa_bits", bits, bits is not None),
            ("rollout_perturbation", config.rollout_perturbation, config.rollout_perturbation is not None),
        )
        if on
    ]
    other_path = (
        "use_vllm=True" if config.use_vllm else
        "use_transformers_continuous_batching=True" if config.use_transformers_continuous_batching else None
    )  # fmt: skip
    if injected and other_path:
        raise ValueError(
            f"{injected[0]} acts on the plain generate rollouts only, not {other_path}: unset it or use the "
            "generate path"
        )
    if config.zero_mismatch:
        if injected:
            raise ValueError(
                f"zero_mismatch=True with {injected[0]} is contradictory: zero_mismatch replaces the rollout "
                "log-probabilities by the training ones, which would hide the injected mismatch. Set one of them only."
            )
        if other_path:
            raise ValueError(
                f"zero_mismatch=True is implemented on the plain generate path only, not with {other_path}"
            )
    if bits is not None and config.rollout_dtype in ("bfloat16", "float16"):
        raise ValueError(
            f"rollout_mantissa_bits={bits!r} with rollout_dtype={config.rollout_dtype!r} rounds the rollout twice: "
            "accepted rollout_dtype 'auto' or 'float32' (bfloat16 is rollout_mantissa_bits=7 on float32 weights)"
        )
    if config.fp16 and not fp16_amp_supported(config.use_cpu):
        warnings.warn(
            "fp16=True on a machine without a CUDA/XPU/MPS accelerator (or with use_cpu=True): accelerate runs "
            "neither fp16 autocast nor loss scaling on CPU, so training runs in the model's own dtype. Load "
            "the model in float16 (model_init_kwargs={'dtype': 'float16'}) to exercise fp16 weights on CPU.",
            UserWarning, stacklevel=5,
        )  # fmt: skip


def _check_tail_rule(config) -> None:
    """``rollout_tail_rule`` in canonical form; with ``rollout_logit_noise_kind='tail'`` (and noise on), the rule it
    resolves to (unset: ``safe_vocab_rule``) must cut something."""
    if config.rollout_tail_rule is not None:
        config.rollout_tail_rule = str(parse_rule(config.rollout_tail_rule))  # a bad rule names itself
    if config.rollout_logit_noise_kind != "tail" or config.rollout_logit_noise == 0:
        return
    rule = config.rollout_tail_rule if config.rollout_tail_rule is not None else config.safe_vocab_rule
    if isinstance(parse_rule(rule), NoPruning):
        given = config.rollout_tail_rule is not None
        source = "rollout_tail_rule" if given else "safe_vocab_rule (rollout_tail_rule unset)"
        raise ValueError(
            f"rollout_logit_noise_kind='tail' lifts the tokens a rule cuts, but its rule is {source}='none', which "
            "cuts nothing: set rollout_tail_rule to a rule that prunes, e.g. 'min_p=0.01'"
        )


def check_rollout_paths(config) -> None:
    """The project's own requirements on the rollout paths of a ``SafeVocabGRPOConfig`` (trl's, e.g. VESPO's
    token-level IS modes with vLLM, stay trl's, checked where trl checks them).

    Raises:
        ValueError: ``rollout_dtype`` with vLLM, ``rollout_logprobs`` with continuous batching, or an IS mode the
            generate-path correction does not implement.
    """
    if config.use_vllm and config.rollout_dtype != "auto":
        # rollout_dtype acts on the generate path's autocast, which vLLM does not use.
        raise ValueError(
            f"rollout_dtype={config.rollout_dtype!r} applies to the generate path only; with use_vllm=True "
            "the vLLM engine's dtype decides. Leave rollout_dtype='auto'."
        )
    if config.use_transformers_continuous_batching and config.rollout_logprobs:
        # the recorder is a LogitsProcessor of `generate`, which continuous batching bypasses.
        raise ValueError(
            "rollout_logprobs=True is not accepted with use_transformers_continuous_batching=True, whose "
            "generate_batch returns no log-probabilities and runs no logits processor: accepted "
            "rollout_logprobs=False or unset"
        )
    if config.generate_path_importance_sampling and config.vllm_importance_sampling_mode not in IS_MODES:
        # the generate-path correction reuses trl's modes (trl checks them on vLLM itself).
        raise ValueError(
            f"vllm_importance_sampling_mode={config.vllm_importance_sampling_mode!r} is not accepted by the "
            f"generate-path importance sampling: accepted one of {IS_MODES}"
        )


# ----------------------------------------------------------------------------------------------------
# tokenizer


def check_report_to(report_to) -> None:
    """Every ``report_to`` integration known and installed, when the config is built: transformers raises only when
    the Trainer is built, with a RuntimeError that does not name the field (``report_to="tensorboard"`` without
    tensorboard)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    names = [name for name in names if name not in ("none", "all")]
    if not names:
        return
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    available = set(get_available_reporting_integrations())
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            raise ValueError(f"report_to={name!r} (--report_to {name}): accepted 'none', 'all' or one of "
                             f"{sorted(INTEGRATION_TO_CALLBACK)}")  # fmt: skip
        if name not in available:
            raise ValueError(f"report_to={name!r} (--report_to {name}): its package is not installed (pip install "
                             f"{name}), or pass report_to='none'")  # fmt: skip
