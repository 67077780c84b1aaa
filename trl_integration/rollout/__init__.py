"""The rollout side of the ``generate`` path (no vLLM).

- ``recorder.py``: the sampled tokens' log-probabilities recorded during ``generate`` in the rollout's precision,
  and the rollout precision itself;
- ``perturbations.py``: the injected logit perturbations (seeded noise, the lift, the tail);
- ``mismatch.py``: a run's injected mismatch (noise, a plug-in perturbation, rounded weights), one per run.

Nothing is imported here: ``import trl_integration.rollout`` does not import trl or transformers.
"""
