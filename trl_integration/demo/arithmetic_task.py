"""The bundled arithmetic task as a :class:`~trl_integration.task.StudyTask` (``safevocab study --task
arithmetic``, the default).

Data, reward and metric are :mod:`trl_integration.demo.arithmetic`'s: training prompts from the train split
(``make_dataset(n, seed, split="train")``), the held-out set from the test split with seed 1
(``make_dataset(n, seed=1, split="test")``, disjoint from every training draw), the exact-match
``arithmetic_reward``, and greedy ``accuracy`` as the held-out metric. The model is the bundled tiny one.
"""

from __future__ import annotations

from trl_integration.task import StudyTask

__all__ = ["arithmetic_task", "HELD_OUT_SEED"]

#: Seed of the held-out (test-split) problems, as ``safevocab-grpo``'s end-of-run summary uses.
HELD_OUT_SEED = 1


def arithmetic_task() -> StudyTask:
    """The arithmetic task on the bundled tiny model (see the module docstring).

    The reward and the metric are looked up in :mod:`trl_integration.demo.arithmetic` when this is called, so a
    study built afterwards uses whatever that module holds then.
    """
    from trl_integration.demo import arithmetic
    from trl_integration.demo.model import TINY_MODEL_DIR

    def train_dataset(num_prompts: int, seed: int):
        return arithmetic.make_dataset(num_prompts, seed=seed, split="train")

    def held_out_dataset(num_prompts: int):
        return arithmetic.make_dataset(num_prompts, seed=HELD_OUT_SEED, split="test")

    return StudyTask(
        name="arithmetic",
        model_path=str(TINY_MODEL_DIR),
        train_dataset=train_dataset,
        held_out_dataset=held_out_dataset,
        reward_funcs=[arithmetic.arithmetic_reward],
        held_out_metric=arithmetic.accuracy,
        metric_name="accuracy",
        description="integer arithmetic, exact-match reward; held-out metric: greedy accuracy on test-split problems",
    )
