"""Rollout perturbations the tests name as ``--rollout_perturbation rollout_plugins:...`` (this folder is on
``sys.path`` in the test session)."""

from __future__ import annotations

from trl_integration.rollout.perturbations import LogitNoiseProcessor

#: Seeds the factories were called with, in order (the tests read it).
SEEDS_SEEN: list[int] = []


def lift_half(seed: int) -> LogitNoiseProcessor:
    """A rollout perturbation factory: the ``lift`` at eps = 0.5 (temperature 1)."""
    SEEDS_SEEN.append(seed)
    return LogitNoiseProcessor(0.5, "lift", seed=seed)


def tail_half(seed: int) -> LogitNoiseProcessor:
    """A rollout perturbation factory: the ``tail`` at eps = 0.5 under ``min_p=0.1`` (temperature 1)."""
    return LogitNoiseProcessor(0.5, "tail", seed=seed, rule="min_p=0.1")


def not_a_processor(seed: int):
    return "not a processor"


NOT_CALLABLE = 3
