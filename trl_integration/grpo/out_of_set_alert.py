"""Loud when rollouts and the safe set disagree: the out-of-set share warning and the step that trained nothing.

A completion token outside the trainer's safe set ``S`` is masked out of the loss (``safe_vocab_out_of_set``, see
:mod:`trl_integration.grpo.step`). With the trainer's own sampler under the rule (``safe_vocab_in_sampler``) that is
a rare, numerical event; when the rollouts were not sampled under the rule (a ``rollout_func``, an external engine,
tools or environments, a replaced ``generate``, ``safe_vocab_in_sampler=False``) it can be most tokens, and a run
would quietly train on a fraction of its tokens, or on none. :class:`OutOfSetAlert` (a ``TrainerCallback`` the
trainer adds) says so:

- **the share**: at each optimisation step, the share of the completion tokens of the generation batches built during
  the step (``n = completion_mask * tool_mask``, the tokens ``safevocab/out_of_set_frac`` averages over) that fall
  outside ``S``; above ``safe_vocab_out_of_set_warn_frac`` it warns (:class:`OutOfSetWarning`: one line of about 250
  characters naming the count, the rule, where the completions come from, only the fixes that can work there, and
  :data:`DOCS` for the rest), the first time and then at most every :data:`REPEAT_EVERY_STEPS` steps;
- **the step that trained nothing**: an optimisation step whose micro-batches had tokens for the loss but none left
  after the masking (every one removed) raises :class:`NothingToTrainError`, or warns with
  ``safe_vocab_empty_step="warn"`` (at most every :data:`REPEAT_EVERY_STEPS` steps; every such step is counted). Its
  count is the same as the share's: the tokens the loss would have used, ``completion_mask * tool_mask`` before the
  out-of-set masking (tool responses, which trl keeps out of the loss, are not counted). A step with no such token to
  begin with (trl's own masks, e.g. ``mask_truncated_completions``) is trl's business and not counted.

The source (:meth:`OutOfSetAlert.source`) is named as it is: a ``rollout_func``, a replaced ``generate`` (a patched or
mocked one returning ids the model did not sample under the rule: teacher forcing, fixed ids), trl's tool loop, vLLM,
``safe_vocab_in_sampler=False``, the mismatch lab, or the trainer's own sampler (where it is not expected).

Counts are summed on the device as the batches pass (no synchronisation), then summed over processes with one gather
at ``on_pre_optimizer_step`` (before the optimizer changes anything), which every process calls: every process takes
the same decision (the error is raised on all of them), and only the main process warns. The run's totals
(:attr:`OutOfSetAlert.out_of_set_share`, :attr:`OutOfSetAlert.steps_trained_nothing`) feed the run summary; they
cover the steps this process ran (a resumed run counts from the resume). Evaluation batches are not counted.
"""

from __future__ import annotations

import warnings

import torch
from transformers import TrainerCallback

__all__ = [
    "OutOfSetAlert", "OutOfSetWarning", "NothingToTrainError", "REPEAT_EVERY_STEPS", "DOCS", "share_message",
    "empty_step_message", "fixes", "sampler_settings_text",
]  # fmt: skip

#: After the first out-of-set share warning, the next comes at least this many optimisation steps later.
REPEAT_EVERY_STEPS = 50

#: Indices of the counts summed per optimisation step: completion tokens counted at generation, those outside ``S``,
#: completion tokens seen by the loss passes, loss tokens left after the masking.
_COUNTED, _OUT_OF_SET, _COMPLETION, _LOSS = range(4)


class OutOfSetWarning(UserWarning):
    """Completion tokens outside the trainer's safe set are masked out of the loss in a large share, or a whole step."""


class NothingToTrainError(RuntimeError):
    """An optimisation step with completion tokens has no loss token left after the out-of-set masking."""


def sampler_settings_text(args) -> str:
    """``temperature=…, top_k=…, top_p=…, min_p=…`` of the sampler as the config knows it (``generation_kwargs``
    override the flags, as in trl's ``GenerationConfig``/``SamplingParams``)."""
    gk = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    keys = ("temperature", "top_k", "top_p", "min_p")
    return ", ".join(f"{key}={gk.get(key, getattr(args, key, None))!r}" for key in keys)


#: Where the rest is explained (forced tokens, the modes, the totals).
DOCS = "docs/trl.md#out-of-set-tokens"

#: The fixes that can work, by where the completions come from (:meth:`OutOfSetAlert.source`).
_FIXES = {
    "a rollout_func": "sample under the rule there, or safe_vocab_support='replay'",
    "a replaced generate": "train on the model's own samples",
    "trl's tool loop": "sample the model's turns under the rule",
    "vLLM": "safe_vocab_support='replay'",
    "generate with safe_vocab_in_sampler=False": "safe_vocab_in_sampler=True",
    "generate with the mismatch lab's injected mismatch": "none: the lab injects it",
    "generate": "none expected, please report it",
}


def fixes(source: str) -> str:
    """The fixes that can work for completions from ``source`` (one of :data:`_FIXES`' keys), then rule ``none``."""
    return f"{_FIXES.get(source, _FIXES['generate'])}, or safe_vocab_rule='none'"


def share_message(step: int, out_of_set: int, counted: int, rule: str, source: str) -> str:
    """The one-line out-of-set share warning of ``step`` (``counted``: the tokens the loss would have used)."""
    return (
        f"safevocab: step {step}: {out_of_set} of {counted} tokens ({out_of_set / counted:.0%}) fall outside the rule "
        f"{rule!r} and leave the loss (from {source}); fix: {fixes(source)}; see {DOCS}"
    )


def empty_step_message(step: int, counted: int, rule: str, source: str, action: str) -> str:
    """The one-line message of an optimisation step with no loss token left (``counted``: the tokens the loss would
    have used; no masking mode helps there, so none is offered)."""
    then = "safe_vocab_empty_step='warn' trains on" if action == "error" else f"said every {REPEAT_EVERY_STEPS} steps"
    return (
        f"safevocab: step {step} trains on nothing: all {counted} tokens fall outside the rule {rule!r} (from "
        f"{source}); fix: {fixes(source)}; {then}; see {DOCS}"
    )


class OutOfSetAlert(TrainerCallback):
    """The out-of-set share warning and the empty-step check of a trainer (see the module docstring).

    Args:
        trainer: the :class:`~trl_integration.grpo.trainer.SafeVocabGRPOTrainer` (its ``args``, ``accelerator``,
            ``model``, ``rollout_func``, ``tools``, ``use_vllm`` are read when needed).

    Attributes:
        counted_tokens: completion tokens counted at generation over the run (all processes).
        out_of_set_tokens: those outside the trainer's safe set.
        steps_trained_nothing: optimisation steps with completion tokens and no loss token left.
    """

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.counted_tokens = 0
        self.out_of_set_tokens = 0
        self.steps_trained_nothing = 0
        self._pending: torch.Tensor | None = None  # int64 [4] on the batches' device, since the last step
        self._last_warned_step: int | None = None
        self._last_empty_warned_step: int | None = None

    # ---- counting (called by the trainer, per batch) ------------------------------------------------------------
    def observe_generation(self, metric_inputs) -> None:
        """Count a training generation batch's (or micro-batch's) completion tokens and those outside ``S``, from its
        :class:`~trl_integration.grpo.step.StepMetricInputs` (``None``: not measured, already counted)."""
        if metric_inputs is None or not self.trainer.model.training:
            return
        counted = metric_inputs.masks.counted
        out_of_set = counted & ~metric_inputs.stats.in_safe.bool()
        self._add(_COUNTED, counted.sum(), out_of_set.sum())

    def observe_step(self, result) -> None:
        """A generation batch's (or micro-batch's) :class:`~trl_integration.grpo.step.StepResult`, as applied."""
        self.observe_generation(result.metric_inputs)

    def observe_loss(self, inputs: dict, counted: torch.Tensor | None = None) -> None:
        """Count a training micro-batch's tokens the loss would have used (``counted``: ``completion_mask`` times trl's
        own ``tool_mask``, before the out-of-set masking; default the completion mask) and the loss tokens left after
        the out-of-set masking."""
        if not self.trainer.model.training:
            return
        completion = inputs["completion_mask"]
        tool_mask = inputs.get("tool_mask")
        loss = completion if tool_mask is None else completion * tool_mask
        self._add(_COMPLETION, completion.sum() if counted is None else counted, loss.sum())

    def _add(self, first: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if self._pending is None:
            self._pending = torch.zeros(4, dtype=torch.int64, device=a.device)
        self._pending[first : first + 2] += torch.stack([a, b]).to(self._pending.device, torch.int64)

    # ---- the run's totals -------------------------------------------------------------------------------------------
    @property
    def out_of_set_share(self) -> float | None:
        """Share of the run's counted completion tokens outside the trainer's safe set (``None``: none counted, e.g.
        rule ``"none"`` with nothing measured, where nothing can be outside)."""
        return self.out_of_set_tokens / self.counted_tokens if self.counted_tokens else None

    # ---- the check, once per optimisation step ----------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        pending, self._pending = self._pending, None
        local = torch.zeros(4, dtype=torch.int64) if pending is None else pending
        counted, out_of_set, completion, loss = (
            int(v) for v in accelerator.gather(local.to(accelerator.device).reshape(1, 4)).sum(0).tolist()
        )
        self.counted_tokens += counted
        self.out_of_set_tokens += out_of_set
        step = state.global_step + 1  # the step about to be taken, as it will be logged
        threshold = float(args.safe_vocab_out_of_set_warn_frac)
        due = self._last_warned_step is None or step - self._last_warned_step >= REPEAT_EVERY_STEPS
        if counted and out_of_set / counted > threshold and due:
            self._last_warned_step = step
            if accelerator.is_main_process:
                message = share_message(step, out_of_set, counted, str(args.effective_rule), self.source())
                warnings.warn(message, OutOfSetWarning, stacklevel=1)
        if completion > 0 and loss == 0:
            self.steps_trained_nothing += 1
            self._empty_step(step, completion)
        return control

    def _empty_step(self, step: int, completion: int) -> None:
        args = self.trainer.args
        action = args.safe_vocab_empty_step
        message = empty_step_message(step, completion, str(args.effective_rule), self.source(), action)
        if action == "error":
            raise NothingToTrainError(message)
        due = self._last_empty_warned_step is None or step - self._last_empty_warned_step >= REPEAT_EVERY_STEPS
        if due and self.trainer.accelerator.is_main_process:  # counted every step, said at most every N steps
            self._last_empty_warned_step = step
            warnings.warn(message, OutOfSetWarning, stacklevel=1)

    def source(self) -> str:
        """Where the completions come from, as the trainer knows it (a key of the fixes)."""
        trainer = self.trainer
        if getattr(trainer, "rollout_func", None) is not None:
            return "a rollout_func"
        if _generate_replaced(trainer):
            return "a replaced generate"
        if getattr(trainer, "tools", None) or getattr(trainer, "environments", None):
            return "trl's tool loop"
        if getattr(trainer, "use_vllm", False):
            return "vLLM"
        args = trainer.args
        if not args.safe_vocab_in_sampler:
            return "generate with safe_vocab_in_sampler=False"
        if args.rollout_logit_noise > 0 or args.rollout_perturbation or args.rollout_mantissa_bits is not None:
            return "generate with the mismatch lab's injected mismatch"
        return "generate"


def _generate_replaced(trainer) -> bool:
    """Whether the policy's ``generate`` is not transformers' (an instance attribute, as ``unittest.mock.patch.object``
    sets, or a class attribute from elsewhere): its completions were not sampled by the model under the rule."""
    model = trainer.model
    unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
    if unwrap is not None:
        model = unwrap(model)
    if "generate" in vars(model):
        return True
    generate = getattr(type(model), "generate", None)
    return generate is not None and not getattr(generate, "__module__", "transformers").startswith("transformers")
