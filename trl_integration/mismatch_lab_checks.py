"""The config's checks of the mismatch-lab settings (``rollout_logit_noise*``, ``rollout_tail_rule``,
``rollout_mantissa_bits``, ``rollout_perturbation``, ``zero_mismatch``), of the rollout paths (what each of
``generate``, vLLM and continuous batching supports) and of fp16 on CPU, each a one-line error naming the field.

A leaf like the config: it imports no implementation module (``rollout_perturbation`` is imported here, so that a
bad module fails when the config is built, before any model loads; the factory itself is called by the trainer).
"""

from __future__ import annotations

import warnings

from safevocab import NoPruning, parse_rule
from safevocab.mantissa import MANTISSA_BITS_RANGE
from safevocab.validation import integer, real
from trl_integration.enums import IS_MODES, NOISE_KINDS
from trl_integration.plugins import load_callable
from trl_integration.precision import fp16_amp_supported

__all__ = ["check_mismatch_lab", "check_rollout_paths"]


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
