"""Shared pytest configuration: hypothesis profiles and small helpers.

``CI=true`` (or ``HYPOTHESIS_PROFILE=ci``) selects a derandomized profile, so CI runs are reproducible;
locally the default profile explores new examples each run.
"""

import os

import torch
from hypothesis import HealthCheck, settings

from trl_integration.notices import filter_known_notices

# The command-line entry points' notice filters (trl_integration/notices.py), before a test imports trl or vLLM:
# `import trl_integration` no longer installs them.
filter_known_notices()

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# One intra-op thread unless OMP_NUM_THREADS says otherwise: what scripts/test.sh and the trainer's thread policy
# (trl_integration/grpo/threads.py) choose for the tiny test models. With two, a bare `pytest` ran trl's stock trainer
# on two threads and SafeVocabGRPOTrainer on one (the policy lowers it when the trainer is built, for the rest of the
# process), and the stock-vs-ours comparisons saw two reduction orders (weights 6.5e-5 apart, limit 1e-6).
if not os.environ.get("OMP_NUM_THREADS"):
    torch.set_num_threads(1)
