"""The GRPO drop-in: ``SafeVocabGRPOConfig`` and ``SafeVocabGRPOTrainer`` (import them from ``trl_integration``).

- ``config.py``: the config dataclass (trl's ``GRPOConfig`` plus the safe-vocabulary fields), ``checks.py``: every
  check made when the config or the trainer is built; ``sampler_settings.py``: the effective rule set on the sampler,
  and whether rollouts record their log-probabilities;
- ``trainer.py``: trl's hooks, thin; ``batch.py``: the state of one generation batch between them; ``step.py``: the
  pure safe-vocabulary step of a batch (out-of-set masks, importance ratio, metric inputs);
- ``metric_rows.py``, ``metric_queue.py``: the trainer's metric groups and the one route of its rows to trl's log;
- ``head.py``: the safe LM head behind trl's ``fused_lm_head=True`` call; ``replay.py``: exact support replay;
- ``length_decay.py``: the length-decay callback; ``entropy_metrics.py``: the full-softmax and kept-set entropies;
  ``vllm_engine.py``: the trainer's vLLM engine.

The run harness (checkpoints, resume checks, threads, reward checks, console) is ``trl_integration.harness``, above.

Nothing is imported here: ``import trl_integration.grpo`` does not import trl.
"""
