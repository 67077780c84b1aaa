"""TRL integration for safevocab (``SafeVocabGRPOTrainer``, ``SafeVocabGRPOConfig``, ``safevocab-grpo``).

Everything that needs ``trl`` or ``transformers`` lives in this package, so that ``safevocab`` itself
depends on torch alone. The trainer, config, callbacks and command line land here with the TRL
integration; importing this package never imports trl, so it cannot break ``import safevocab``.
"""

__all__: list[str] = []
