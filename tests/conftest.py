"""Shared pytest configuration: hypothesis profiles and small helpers.

``CI=true`` (or ``HYPOTHESIS_PROFILE=ci``) selects a derandomized profile, so CI runs are reproducible;
locally the default profile explores new examples each run.
"""

import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# Two cores: keep intra-op threads bounded so parallel test processes do not oversubscribe.
torch.set_num_threads(min(2, torch.get_num_threads()))
