"""The run harness of ``safevocab-grpo``, above the drop-in trainer (``trl_integration.grpo``).

:class:`HardenedSafeVocabGRPOTrainer` is ``SafeVocabGRPOTrainer`` plus what a long unattended run needs and a drop-in
for trl's ``GRPOTrainer`` should not impose: atomic checkpoints and resume checks, the CPU thread policy, reward checks
and a console that prints trl's keys (:mod:`trl_integration.harness.trainer` lists each module). A Python user opts in
by building it instead of ``SafeVocabGRPOTrainer``.

Imported lazily: the command's early checks read :mod:`~trl_integration.harness.checkpoint_identity` without trl.
"""

__all__ = ["HardenedSafeVocabGRPOTrainer"]


def __getattr__(name: str):
    if name != "HardenedSafeVocabGRPOTrainer":
        raise AttributeError(f"module 'trl_integration.harness' has no attribute {name!r}")
    from trl_integration.harness.trainer import HardenedSafeVocabGRPOTrainer

    return HardenedSafeVocabGRPOTrainer
