"""A ``safevocab study`` task plug-in: the free-text task, its held-out reward sampled on the DVP rule's support.

The built-in ``freetext`` task scores every arm by sampling from the policy's full distribution. A policy trained
with Dynamic Vocabulary Pruning (rule ``min_p=ρ``) is meant to be deployed on the same safe vocabulary
``{a : p_a ≥ ρ · p_max}``, renormalised; this task scores every arm that way (the same rule for all arms, so the
comparison stays paired), everything else unchanged::

    safevocab study --task examples.study_task_rule_eval:freetext_rule_eval_task --arms no_remedy dvp ...

(run from the repository root; from this folder, ``--task study_task_rule_eval:freetext_rule_eval_task``).

The scoring rule is ``RULE_MIN_P`` below, not the study's ``--dvp_rule``: a study whose DVP arms use another rule
scores under 0.01 unless this constant is changed to match (the report's "task" row says which rule scored).
"""

from __future__ import annotations

import dataclasses
import functools

from trl_integration.demo.freetext import freetext_task, held_out_reward
from trl_integration.task import StudyTask

#: The ``min_p`` of the study's DVP arms (``--dvp_rule min_p=0.01``, the default).
RULE_MIN_P = 0.01


def freetext_rule_eval_task() -> StudyTask:
    """The ``freetext`` study task whose held-out metric, ``reward_min_p``, samples under ``min_p=RULE_MIN_P``."""
    task = freetext_task()
    return dataclasses.replace(
        task,
        name="freetext_rule_eval",
        held_out_metric=functools.partial(held_out_reward, min_p=RULE_MIN_P),
        metric_name="reward_min_p",
        description=f"{task.description}; held-out completions sampled under min_p={RULE_MIN_P}",
    )
