"""Rewards checked where they are made: an infinite reward or a non-number is refused, naming the reward function.

trl turns each reward function's output into a float32 column (``None`` -> NaN) and normalises the weighted sum
``r`` per group of ``G`` completions::

    A_i = (r_i - mean_g r) / (std_g r + 1e-4),      then NaN -> 0

One ``r_i = +-inf`` makes ``mean_g r`` infinite and ``std_g r`` NaN, so every advantage of the group is NaN, then
0: the group trains nothing, with no error (measured on the tiny model, one ``inf`` in each step's group of 4:
loss 0 and grad_norm 0 at every step, ``reward = inf`` logged, exit 0). A function that returns strings fails
inside trl's ``torch.tensor(...)`` with ``too many dimensions 'str'``, which names neither the function nor the
value.

:func:`check_reward_funcs` therefore wraps, once the trainer is built, each reward *callable* of
``trainer.reward_funcs`` (the user's functions and an environment's ``get_reward``) in a :class:`CheckedReward`
that calls it unchanged and then checks its output:

- not iterable (a float, ``None``, a string): ``TypeError`` naming the function and what it returned;
- an element trl cannot turn into a float32 (a string, a list): ``TypeError`` naming the function, the
  completion and the element;
- a ``dict`` or a ``set`` (any mapping or set): ``TypeError`` naming the function (trl would train on a dict's
  keys, and on a set's elements in hash order, not per completion);
- ``+inf`` or ``-inf``: ``ValueError`` naming the function, the completion and ``trainer_state.global_step``
  (trl's ``trainer_state`` reward keyword);
- a finite reward so large that trl's float32 group statistics overflow (:func:`reward_limit`: the squared deviations
  of ``nanstd`` overflow from about ``1.8e19 / sqrt(rows)``, the group mean from ``3.4e38 / G``; an overflowing std
  makes every advantage of the group 0, which trains nothing): ``ValueError`` naming the function, the value and the limit.

``args.safe_vocab_check_rewards=False`` leaves the reward functions unwrapped (trl's own behaviour).

What trl accepts is accepted unchanged (floats, ints, bools, numpy scalars, 0-dim tensors), and ``None`` and NaN
stay trl's "no reward for this completion": a step where every reward is missing keeps trl's behaviour, a warning
and training goes on (trl's own test ``test_warning_raised_all_rewards_none`` expects it); the ``safevocab-grpo``
command stops such a run itself (:mod:`trl_integration.commands.broken_run`).

The wrapper keeps what trl reads from a reward function: its name (``__name__``, set to trl's
``reward_func_names`` entry, so ``rewards/<name>/mean`` is unchanged) and whether it is asynchronous (an ``async``
function, a ``functools.partial`` of one or an object with an ``async __call__`` is wrapped in an
:class:`AsyncCheckedReward`, whose ``__call__`` is a coroutine function, as trl tests it). Reward *models*
(``nn.Module``) are not callables trl calls like functions and stay in place; a forward hook
(:class:`RewardModelCheck`) checks the score trl reads, ``logits[:, 0]``, for infinities.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Set
from typing import Any

import torch
from torch import nn

__all__ = [
    "CheckedReward", "AsyncCheckedReward", "RewardModelCheck", "RewardFunctionError", "check_reward_funcs",
    "check_rewards", "reward_limit",
]  # fmt: skip

#: What a reward function must return, in the errors' words.
ACCEPTED = "accepted a list of one float (or None for no reward) per completion"
#: The largest float32.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def reward_limit(rows: int, weight_sum: float = 1.0) -> float:
    """The largest reward magnitude whose weighted sums keep trl's float32 statistics finite over ``rows`` rewards
    (the generation batch: ``scale_rewards="batch"`` and the logged per-function std reduce over all of it, a group
    over fewer) with reward weights whose magnitudes sum to ``weight_sum``.

    A weighted sum is at most ``R W`` in magnitude and its deviation from the mean at most ``2 R W``; ``nanstd``
    sums ``rows`` squared deviations (``<= rows (2 R W)^2``) before dividing, so ``R <= sqrt(max / rows) / (2 W)``
    keeps every sum, mean and std finite (about ``4.6e18`` for 4 rewards of weight 1, ``2.9e17`` for 1,024).
    """
    return math.sqrt(_FLOAT32_MAX / max(int(rows), 2)) / (2.0 * max(weight_sum, 1e-30))


def _is_async(func: Callable) -> bool:
    """Whether calling ``func`` returns a coroutine: an ``async`` function, a ``functools.partial`` of one, or an
    object whose ``__call__`` is ``async`` (the forms trl recognises)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))  # noqa: B004 (its method)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _step(trainer_state: Any) -> str:
    step = getattr(trainer_state, "global_step", None)
    return "" if step is None else f" at global_step={step}"


def _not_a_number(reward: object) -> bool:
    """Whether trl's ``torch.tensor([...], dtype=float32)`` cannot take ``reward`` as one element."""
    if reward is None:
        return False
    if isinstance(reward, (str, bytes)):
        return True  # torch takes neither; named here rather than by torch's "too many dimensions 'str'"
    try:
        return torch.tensor(reward, dtype=torch.float32).dim() != 0
    except (TypeError, ValueError, RuntimeError):
        return True


def check_rewards(output: object, name: str, trainer_state: Any = None, limit: float | None = None) -> list:
    """``output`` of the reward function ``name`` as a list, after checking it holds one finite float or ``None``
    per completion (NaN allowed: trl's missing reward), each of magnitude at most ``limit`` (:func:`reward_limit`;
    ``None``: no limit); raises ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(output, (Mapping, Set)):
        kind = "a dict" if isinstance(output, Mapping) else "a set"
        raise TypeError(f"reward function {name!r} returned {type(output).__name__} {_short(output)}"
                        f"{_step(trainer_state)}: {ACCEPTED}, in the completions' order ({kind} is not: trl would "
                        f"train on its {'keys' if isinstance(output, Mapping) else 'elements in hash order'})")  # fmt: skip
    try:
        if isinstance(output, (str, bytes)):
            raise TypeError("a string")
        iterator = iter(output)
    except TypeError:  # not iterable (a float, None), a 0-dim tensor, or a string
        raise TypeError(f"reward function {name!r} returned {type(output).__name__} {_short(output)}"
                        f"{_step(trainer_state)}: {ACCEPTED}") from None  # fmt: skip
    rewards = list(iterator)  # trl iterates the output once more: a generator is read here, and only here
    try:  # what trl does with the list
        values = torch.tensor([math.nan if r is None else r for r in rewards], dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        values = None
    if values is None or values.dim() != 1:
        index = next((i for i, r in enumerate(rewards) if _not_a_number(r)), None)
        what = _short(rewards) if index is None else (
            f"{type(rewards[index]).__name__} {_short(rewards[index])} for completion {index} of {len(rewards)}"
        )  # fmt: skip
        raise TypeError(f"reward function {name!r} returned {what}{_step(trainer_state)}: {ACCEPTED}")
    infinite = torch.isinf(values)
    if bool(infinite.any()):
        index = int(infinite.nonzero()[0])
        raise ValueError(
            f"reward function {name!r} returned {float(values[index])} for completion {index} of {len(rewards)}"
            f"{_step(trainer_state)}: accepted finite rewards (None or NaN for a completion without one); an "
            "infinite reward makes its group's advantages NaN, which trains nothing"
        )
    if limit is not None:
        too_large = values.abs() > limit
        if bool(too_large.any()):
            index = int(too_large.nonzero()[0])
            raise ValueError(
                f"reward function {name!r} returned {float(values[index]):.6g} for completion {index} of "
                f"{len(rewards)}{_step(trainer_state)}: accepted rewards of magnitude <= {limit:.3g} (with these reward "
                "weights); larger ones overflow trl's float32 group mean/std and the group trains nothing: rescale it"
            )
    return rewards


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names it, the step and the original error (chained as ``__cause__``).
    With several reward functions, trl's own traceback does not say which one failed."""


def _raised(name: str, err: Exception, trainer_state: Any) -> RewardFunctionError:
    return RewardFunctionError(f"reward function {name!r} raised {type(err).__name__}: {err}{_step(trainer_state)}")


class CheckedReward:
    """A reward function whose output is checked by :func:`check_rewards`; called as trl calls reward functions.
    An exception it raises becomes a :class:`RewardFunctionError` naming it."""

    def __init__(self, func: Callable, name: str, limit: float | None = None):
        self.func = func
        #: trl's name of the function (``rewards/<name>/*`` metrics), read by trl through ``__name__``.
        self.__name__ = name
        #: The largest accepted reward magnitude (:func:`reward_limit`), or ``None``.
        self.limit = limit

    def __call__(self, *args, **kwargs):
        try:
            rewards = self.func(*args, **kwargs)
        except Exception as err:  # any error of the user's function: named, the original kept as the cause
            raise _raised(self.__name__, err, kwargs.get("trainer_state")) from err
        return check_rewards(rewards, self.__name__, kwargs.get("trainer_state"), self.limit)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.func!r})"


class AsyncCheckedReward(CheckedReward):
    """:class:`CheckedReward` of an asynchronous reward function (trl awaits it on its event loop)."""

    async def __call__(self, *args, **kwargs):
        try:
            rewards = await self.func(*args, **kwargs)
        except Exception as err:  # as CheckedReward
            raise _raised(self.__name__, err, kwargs.get("trainer_state")) from err
        return check_rewards(rewards, self.__name__, kwargs.get("trainer_state"), self.limit)


class RewardModelCheck:
    """Forward hook of a reward model: raises ``ValueError`` naming it when a score trl reads (``logits[:, 0]``)
    is infinite. ``step`` gives the trainer's ``global_step`` at the time."""

    def __init__(self, name: str, step: Callable[[], int], limit: float = math.inf):
        self.name, self.step, self.limit = name, step, limit

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            return
        infinite = torch.isinf(logits[:, 0])
        label = repr(self.name) if self.name else type(module).__name__  # a model built in code has no id
        if bool(infinite.any()):
            index = int(infinite.nonzero()[0])
            raise ValueError(
                f"reward model {label} returned {float(logits[index, 0])} for completion {index} of "
                f"{logits.shape[0]} at global_step={self.step()}: accepted finite rewards (an overflow: try the model "
                "in float32)"
            )
        too_large = logits[:, 0].detach().float().abs() > self.limit
        if bool(too_large.any()):
            index = int(too_large.nonzero()[0])
            raise ValueError(
                f"reward model {label} returned {float(logits[index, 0]):.6g} for completion {index} of "
                f"{logits.shape[0]} at global_step={self.step()}: accepted rewards of magnitude <= {self.limit:.3g} "
                "(with these reward weights); larger ones overflow trl's float32 group mean/std"
            )


def check_reward_funcs(trainer: Any) -> None:
    """Wrap each reward callable of a built trl GRPO ``trainer`` (``reward_funcs``, named by ``reward_func_names``) in
    a :class:`CheckedReward`, and hook a :class:`RewardModelCheck` on each reward model; once per trainer. Nothing
    when ``trainer.args.safe_vocab_check_rewards`` is ``False``."""
    if not getattr(trainer.args, "safe_vocab_check_rewards", True):
        return
    weights = getattr(trainer, "reward_weights", None)
    weight_sum = float(weights.abs().sum()) if isinstance(weights, torch.Tensor) else float(len(trainer.reward_funcs))
    limit = reward_limit(getattr(trainer.args, "generation_batch_size", None) or 1, weight_sum)
    for i, (func, name) in enumerate(zip(trainer.reward_funcs, trainer.reward_func_names, strict=True)):
        if isinstance(func, nn.Module):  # trl's own test: Module, for compiled models too
            func.register_forward_hook(RewardModelCheck(name, lambda: trainer.state.global_step, limit))
        elif not isinstance(func, CheckedReward):
            trainer.reward_funcs[i] = (AsyncCheckedReward if _is_async(func) else CheckedReward)(func, name, limit)
