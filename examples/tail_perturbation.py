"""A ``--rollout_perturbation`` plug-in: the ``tail`` perturbation, ε on exactly the tokens a DVP rule cuts.

The built-in ``--noise EPS --noise_kind tail`` of ``safevocab study`` (``rollout_logit_noise_kind="tail"`` in the
trainer's config) adds ``EPS`` to the rollout's transformed logits of every token outside the safe set of the study's
``--dvp_rule`` (for ``min_p=ρ``: ``z_max − z_i > ln(1/ρ)``), 0 elsewhere. This plug-in is the same perturbation as a
factory ``f(seed) -> LogitsProcessor``, for runs that name their rollout perturbation instead (a trainer config's
``rollout_perturbation``, or ``safevocab study --rollout_perturbation``; there, with ``--noise 0``)::

    safevocab study --task freetext --noise 0 --rollout_perturbation examples.tail_perturbation:tail_perturbation ...

(run from the repository root; from this folder, ``tail_perturbation:tail_perturbation``). Its ε, rule and
temperature are the constants below, fixed whatever the study's flags: ``EPS`` is the value calibrated on the testbed
so that the tail's k3 KL matches the ``lift`` at ε = 2 (docs/testbed.md), ``RULE`` the studies' ``--dvp_rule``,
``TEMPERATURE`` the sampler's temperature (a plug-in is not told it; the studies sample at 1).
"""

from __future__ import annotations

from trl_integration.rollout.perturbations import LogitNoiseProcessor

#: The lift of the cut tokens, in nats of transformed logit.
EPS = 1.07

#: The rule whose cut tokens are lifted (the studies' ``--dvp_rule``).
RULE = "min_p=0.01"

#: The sampler's temperature (the perturbation acts on ``scores / TEMPERATURE``, as the built-in noise does).
TEMPERATURE = 1.0


def tail_perturbation(seed: int) -> LogitNoiseProcessor:
    """The rollout perturbation factory: the ``tail`` at ``EPS`` under ``RULE`` (deterministic: ``seed`` unused)."""
    return LogitNoiseProcessor(EPS, "tail", seed=seed, temperature=TEMPERATURE, rule=RULE)
