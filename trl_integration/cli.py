"""Moved to :mod:`trl_integration.commands.grpo`; this alias goes away in the next release.

``python -m trl_integration.cli ...`` (the ``accelerate launch -m`` form of the recipes) still runs
``safevocab-grpo``, without a warning; importing a name from here warns.
"""

import sys

from trl_integration._moved import moved

_NEW = "trl_integration.commands.grpo"

__all__ = ["SafeVocabScriptArguments", "make_parser", "main", "run", "load_train_dataset", "resolve_reward_funcs"]

__getattr__ = moved(
    __name__,
    {
        name: _NEW
        for name in (
            *__all__,
            "ARITHMETIC_DATASET_NAME",
            "BUNDLED_JOB_DEFAULTS",
            "MISSING_MODEL_MESSAGE",
            "bundled_job_requested",
        )
    },
)

if __name__ == "__main__":  # pragma: no cover
    from trl_integration.commands.grpo import main as _main

    sys.exit(_main())
