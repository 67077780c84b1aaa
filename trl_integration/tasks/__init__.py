"""Verifiable synthetic tasks for GRPO runs that need no download.

- ``trl_integration.tasks.arithmetic``: integer arithmetic (``"37+48="`` -> ``"85"``) with an exact-match
  reward, deterministic disjoint train/test datasets and a generation-based accuracy helper; the bundled tiny
  model (:func:`trl_integration.assets.tiny_model_path`) is trained on it.
"""

from trl_integration.tasks.arithmetic import accuracy, arithmetic_reward, make_dataset, parse_answer

__all__ = ["accuracy", "arithmetic_reward", "make_dataset", "parse_answer"]
