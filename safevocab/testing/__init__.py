"""Hypothesis strategies and assertion helpers for testing your own thresholds and pipelines.

Import it explicitly (it needs ``hypothesis``; ``import safevocab`` never imports it)::

    from hypothesis import given
    from safevocab.testing import assert_pruning_bias_within, logits, rules

    @given(z=logits(vocab_size=32), rule=rules(kinds=("min_p",)))
    def test_my_threshold(z, rule): ...

Strategies:

- :func:`logits`: torch logits ``[*batch_shape, V]`` of many shapes of distribution (Gaussian at several
  scales, near-uniform, one-hot-like, Zipf-like heavy tails, tied values), optionally with ``-inf``
  entries (never a whole row).
- :func:`rules`: random :class:`~safevocab.rules.SafeVocabRule` (each kind, intersections, ``none``).
- :func:`perturbations`: logit noise with ``|delta| <= eps`` (uniform, random signs, the adversarial
  pattern that attains the mismatch bound, constant shifts, sparse spikes).

Assertions (raise ``AssertionError`` with the worst position and value):

- :func:`assert_pruning_bias_within`: per-position ``TV(p, p_S) = m`` and ``KL(p_S || p) = -log(1 - m)``.
- :func:`assert_mismatch_within_bound`: every kept token's log-probability gap between two sets of logits
  is within :func:`safevocab.bounds.logprob_mismatch_bound`.
- :func:`assert_sequence_bias_within`: sequence-level ``TV(P, Q)`` / ``KL(Q || P)`` from kept masses.

Host synchronisations: :class:`safevocab.testing.host_syncs.HostSyncs` counts the calls in safevocab's own code that
read the device (on CPU too; on CUDA with ``torch.cuda.set_sync_debug_mode`` as well). Import it from its module.
"""

from safevocab.testing.assertions import (
    assert_mismatch_within_bound,
    assert_pruning_bias_within,
    assert_sequence_bias_within,
)
from safevocab.testing.strategies import LOGIT_KINDS, PERTURBATION_KINDS, logits, perturbations, rules

__all__ = [
    "logits",
    "rules",
    "perturbations",
    "LOGIT_KINDS",
    "PERTURBATION_KINDS",
    "assert_pruning_bias_within",
    "assert_mismatch_within_bound",
    "assert_sequence_bias_within",
]
