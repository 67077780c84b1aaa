"""``HardenedSafeVocabGRPOTrainer``: :class:`~trl_integration.grpo.trainer.SafeVocabGRPOTrainer` with the run harness.

What ``safevocab-grpo`` trains with, and what a Python user opts into with one line (the class instead of
``SafeVocabGRPOTrainer``; the same arguments). On top of DVP it adds, each its own module of this package:

- :mod:`~trl_integration.harness.checkpoints` / :mod:`~trl_integration.harness.checkpoint_files`: checkpoints a kill
  cannot leave half-written, a full disk named in one line, and ``train(resume_from_checkpoint=...)`` refusing an
  incomplete or foreign checkpoint, or one that lacks its optimizer, scheduler or RNG state, before anything loads;
- :mod:`~trl_integration.harness.resume_settings`: the settings a resumed run may not change silently;
- :mod:`~trl_integration.harness.threads`: on CPU, torch's intra-op thread count chosen when the trainer is built
  (before a colocated vLLM engine), one logged line saying why;
- :mod:`~trl_integration.harness.rewards`: a reward that is infinite, not a number, or large enough to overflow trl's
  float32 statistics refused, naming the reward function;
- :mod:`~trl_integration.harness.console_log`: the per-step console line shows the keys stock trl prints (every key
  stays in the logs).

Each is switched by its config field (``safe_vocab_atomic_checkpoints``, ``resume_allow_missing_state``,
``resume_allow_changed_settings``, ``choose_torch_threads``, ``safe_vocab_check_rewards``,
``safe_vocab_print_metrics``); the plain trainer ignores those fields.
"""

from __future__ import annotations

from trl_integration.grpo.config import SafeVocabGRPOConfig
from trl_integration.grpo.trainer import SafeVocabGRPOTrainer, resolve_config
from trl_integration.harness.checkpoints import AtomicCheckpoints
from trl_integration.harness.console_log import quiet_console
from trl_integration.harness.rewards import check_reward_funcs
from trl_integration.harness.threads import TrainerThreads

__all__ = ["HardenedSafeVocabGRPOTrainer"]


class HardenedSafeVocabGRPOTrainer(AtomicCheckpoints, SafeVocabGRPOTrainer):
    """:class:`~trl_integration.grpo.trainer.SafeVocabGRPOTrainer` with the run harness of ``safevocab-grpo`` (the
    module docstring). Same arguments.

    Example::

        from trl_integration import HardenedSafeVocabGRPOTrainer, SafeVocabGRPOConfig

        trainer = HardenedSafeVocabGRPOTrainer(model="path/to/model", reward_funcs=my_reward,
                                               args=SafeVocabGRPOConfig(output_dir="out"), train_dataset=dataset)
        trainer.train(resume_from_checkpoint=True)  # the newest complete checkpoint, checked before it loads

    Beyond ``SafeVocabGRPOTrainer`` it overrides ``train`` (the resume checks), ``_save_checkpoint`` (atomic) and
    ``__init__`` (the thread policy, the reward checks and the console filter).
    """

    def __init__(self, model, reward_funcs=None, args: SafeVocabGRPOConfig | None = None, *pargs, **kwargs):
        args = resolve_config(model, args)
        self._threads = TrainerThreads(self, args)  # chosen before a colocated vLLM engine disables the setter
        with self._threads.before_engine():
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self._threads.settle()
        quiet_console(self)  # the console prints trl's keys; the logs keep the project's metrics
        check_reward_funcs(self)  # an infinite or non-numeric reward is refused, naming the function
