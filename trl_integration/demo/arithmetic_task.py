"""The bundled arithmetic task as a :class:`~trl_integration.study.task.StudyTask` (``safevocab study``'s default).

It packages what :mod:`trl_integration.demo.arithmetic` defines for the bundled tiny model
(:func:`~trl_integration.demo.model.tiny_model_path`): training problems ``make_dataset(n, seed, split="train")``;
the held-out set ``make_dataset(n, seed=1, split="test")`` (the test split is disjoint from every training draw;
seed 1 is the set ``safevocab study`` has always evaluated on); the exact-match reward ``arithmetic_reward``; and
the held-out metric ``accuracy``: greedy exact-match accuracy, which saves and restores torch's global RNG state.
Completions are at most 8 tokens (the longest answer is 4 characters plus EOS).
"""

from __future__ import annotations

__all__ = ["ARITHMETIC_HELD_OUT_SEED", "arithmetic_task"]

#: The seed of the held-out (test-split) problems.
ARITHMETIC_HELD_OUT_SEED = 1


def arithmetic_task():
    """The arithmetic task for the bundled tiny model (see the module docstring)."""
    from functools import partial

    from trl_integration.demo.arithmetic import accuracy, arithmetic_reward, make_dataset
    from trl_integration.demo.model import tiny_model_path
    from trl_integration.study.task import StudyTask

    return StudyTask(
        name="arithmetic",
        model_path=str(tiny_model_path()),
        train_dataset=partial(make_dataset, split="train"),  # (num_prompts, seed)
        held_out_dataset=partial(make_dataset, seed=ARITHMETIC_HELD_OUT_SEED, split="test"),  # (num_prompts)
        reward_funcs=(arithmetic_reward,),
        held_out_metric=accuracy,
        metric_name="accuracy",
        max_completion_length=8,
        description="integer + and - with 1-3 digit operands; reward: exact match of the answer",
    )
