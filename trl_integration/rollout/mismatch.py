"""The injected mismatch of the ``generate`` rollouts: what the trainer's mismatch lab adds to the sampler.

Three sources, each acting on the rollout only (the trainer scores with its own, untouched weights and logits):

- ``rollout_logit_noise`` / ``rollout_logit_noise_kind``: a :class:`~trl_integration.rollout.perturbations.LogitNoiseProcessor`,
  bounded noise, the biased ``lift`` or the ``tail`` (``eps`` on the tokens ``rollout_tail_rule``, default
  ``safe_vocab_rule``, cuts) on the transformed logits;
- ``rollout_perturbation``: a user's ``LogitsProcessor``, made by a factory ``factory(seed: int)`` (named
  ``"module:function"`` in the config, or given to the trainer as the factory or the processor itself);
- ``rollout_mantissa_bits``: the rollout samples with the current weights rounded to ``k`` mantissa bits
  (:func:`rounded_weights`, :func:`trl_integration.rollout.mantissa.round_mantissa`): the rollout policy ``mu`` is the trained
  policy at lower precision, so the mismatch follows the weights as they train, as a bf16/fp8 engine's does.

The processors run in that order, before the rollout log-prob recorder and the temperature/top-k/top-p/min-p
warpers: the tokens are sampled from, and their log-probabilities recorded under, the perturbed distribution.
:class:`RolloutMismatch` holds the run's sources (one noise generator and one plug-in processor per run, so their
state advances across rollouts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers import LogitsProcessor

from trl_integration.plugins import load_callable
from trl_integration.rollout.mantissa import round_mantissa
from trl_integration.rollout.perturbations import LogitNoiseProcessor

__all__ = ["RolloutMismatch", "rounded_weights", "make_perturbation"]

#: What ``SafeVocabGRPOTrainer(rollout_perturbation=...)`` accepts: a processor, or a factory ``f(seed)`` of one.
PerturbationArg = LogitsProcessor | Callable[[int], Any] | None


@contextmanager
def rounded_weights(model: torch.nn.Module, bits: int | None) -> Iterator[None]:
    """For the enclosed block, every floating parameter of ``model`` holds its value rounded to ``bits`` mantissa
    bits; afterwards the original tensors are back (the same storage: bit-identical, and the optimizer's state is
    untouched). Buffers (e.g. RoPE frequencies) are not rounded. ``None``: nothing changes.

    Memory: one rounded copy of the parameters is held for the duration. Parameters partitioned by DeepSpeed ZeRO-3
    are not supported (the trainer refuses that combination)."""
    if bits is None:
        yield
        return
    params = [p for p in model.parameters() if p.is_floating_point()]
    originals = [p.data for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p.data = round_mantissa(p.data, bits)
        yield
    finally:
        for p, data in zip(params, originals):
            p.data = data


def make_perturbation(perturbation: PerturbationArg | str, seed: int) -> LogitsProcessor | None:
    """The rollout perturbation processor: ``perturbation`` itself when it is a ``LogitsProcessor``; else the
    factory's ``perturbation(seed)`` (a ``"module:function"`` string is imported first).

    Raises:
        ValueError: a string that does not name a function, or a factory whose result is not a callable processor.
    """
    if perturbation is None or isinstance(perturbation, LogitsProcessor):
        return perturbation
    factory = load_callable(perturbation, "rollout_perturbation") if isinstance(perturbation, str) else perturbation
    if not callable(factory):
        raise ValueError(
            f"rollout_perturbation={perturbation!r} is not accepted: accepted a LogitsProcessor, a factory "
            "f(seed) -> LogitsProcessor, or 'module:function' naming one"
        )
    processor = factory(seed)
    if not callable(processor):
        raise ValueError(
            f"rollout_perturbation factory {getattr(factory, '__name__', factory)!r} returned "
            f"{type(processor).__name__}: accepted a LogitsProcessor (called as processor(input_ids, scores))"
        )
    return processor


class RolloutMismatch:
    """The injected mismatch of one run's ``generate`` rollouts (see the module docstring).

    Args:
        noise: the logit-noise processor, or ``None``.
        perturbation: the plug-in processor, or ``None``.
        mantissa_bits: round the weights to this many mantissa bits during each rollout, or ``None``.
    """

    def __init__(
        self,
        noise: LogitNoiseProcessor | None = None,
        perturbation: LogitsProcessor | None = None,
        mantissa_bits: int | None = None,
    ) -> None:
        self.noise = noise
        self.perturbation = perturbation
        self.mantissa_bits = mantissa_bits

    @classmethod
    def from_config(cls, args, process_index: int = 0, perturbation: PerturbationArg = None) -> RolloutMismatch:
        """The sources a ``SafeVocabGRPOConfig`` asks for; ``perturbation`` is the trainer's own argument (a
        processor or a factory), which may not be combined with ``args.rollout_perturbation``."""
        if perturbation is not None and args.rollout_perturbation is not None:
            raise ValueError(
                f"rollout_perturbation is given twice (the config's {args.rollout_perturbation!r} and the trainer's "
                "argument): set one"
            )
        if perturbation is not None and (args.use_vllm or args.use_transformers_continuous_batching):
            raise ValueError(
                "rollout_perturbation acts on the plain generate rollouts only: not with vLLM or continuous batching"
            )
        if args.rollout_mantissa_bits is not None:
            from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

            if is_deepspeed_zero3_enabled():
                raise ValueError(
                    f"rollout_mantissa_bits={args.rollout_mantissa_bits!r} rounds the parameters in place for the "
                    "rollout, which DeepSpeed ZeRO-3's partitioned parameters do not allow: use ZeRO-2 or FSDP"
                )
        seed = args.rollout_noise_seed + process_index
        noise = None
        if args.rollout_logit_noise > 0:
            tail_rule = args.rollout_tail_rule if args.rollout_tail_rule is not None else args.safe_vocab_rule
            noise = LogitNoiseProcessor(
                args.rollout_logit_noise, args.rollout_logit_noise_kind, seed=seed, rule=tail_rule
            )  # the rule is read by kind 'tail' only
        return cls(
            noise=noise,
            perturbation=make_perturbation(
                perturbation if perturbation is not None else args.rollout_perturbation, seed
            ),
            mantissa_bits=args.rollout_mantissa_bits,
        )

    def processors(self, temperature: float | None) -> list:
        """The logits processors to run before the recorder, for a sampler at ``temperature`` (``None``: 1)."""
        out = []
        if self.noise is not None:
            self.noise.temperature = 1.0 if temperature is None else float(temperature)
            out.append(self.noise)
        if self.perturbation is not None:
            out.append(self.perturbation)
        return out

    def weights(self, model: torch.nn.Module):
        """Context manager: ``model``'s weights as the rollout samples with them (:func:`rounded_weights`)."""
        return rounded_weights(model, self.mantissa_bits) if self.mantissa_bits is not None else nullcontext()
