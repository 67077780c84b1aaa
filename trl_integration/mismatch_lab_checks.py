"""The config's checks of the mismatch-lab settings (``rollout_logit_noise*``, ``rollout_mantissa_bits``,
``rollout_perturbation``, ``zero_mismatch``) and of fp16 on CPU, each a one-line error naming the field.

A leaf like the config: it imports no implementation module (``rollout_perturbation`` is imported here, so that a
bad module fails when the config is built, before any model loads; the factory itself is called by the trainer).
"""

from __future__ import annotations

import warnings

from safevocab.mantissa import MANTISSA_BITS_RANGE
from safevocab.validation import integer, real
from trl_integration.enums import NOISE_KINDS
from trl_integration.plugins import load_callable
from trl_integration.precision import fp16_amp_supported

__all__ = ["check_mismatch_lab"]


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
