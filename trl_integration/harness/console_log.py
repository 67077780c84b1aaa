"""The per-step console output: trl's own keys; the project's metrics stay in the logs, not on the screen.

transformers prints every logged dictionary on the console from one callback: ``ProgressCallback.on_log`` (above
the progress bar) or, with ``disable_tqdm``, ``PrinterCallback.on_log``. The trainer logs stock trl's keys (24 for a
default run) and the project's ``safevocab/*`` and ``mismatch/*`` metrics (50 more; ``lr_base`` and
``length_decay/*`` with length decay), which made every step a
74-key dictionary. :func:`quiet_console` swaps that one callback for a subclass that prints the dictionary without
:data:`PROJECT_PREFIXES`' keys and, off vLLM, without trl's ``sampling/*`` keys (stock trl logs those only for vLLM
rollouts; the trainer logs them on the ``generate`` path too, for its importance ratio there): the keys stock trl
prints for the same run. Every other callback (the ``report_to`` integrations) and ``trainer.state.log_history``
still get every key, and ``safe_vocab_print_metrics=True`` prints them all again.

The library's own notices (the thread line of :mod:`trl_integration.harness.threads`) are logged, not printed, under the
``trl_integration`` logger; :func:`show_notices` is how a command line shows them (``safevocab-grpo`` calls it).
"""

from __future__ import annotations

import logging
import sys

from transformers.trainer_callback import PrinterCallback, ProgressCallback

__all__ = ["PROJECT_PREFIXES", "VLLM_ONLY_PREFIXES", "console_keys", "quiet_console", "show_notices"]

#: Prefixes of the project's metrics (docs/metrics.md; ``lr_base`` and ``length_decay/*`` with length decay, see
#: :mod:`trl_integration.grpo.length_decay`); ``eval_`` versions are matched too.
PROJECT_PREFIXES = ("safevocab/", "mismatch/", "length_decay/", "lr_base")
#: trl's importance-sampling metrics, which stock trl logs only for vLLM rollouts.
VLLM_ONLY_PREFIXES = ("sampling/",)


def console_keys(logs: dict, hidden: tuple[str, ...] = PROJECT_PREFIXES) -> dict:
    """``logs`` without the keys starting with a ``hidden`` prefix (a new dict; ``logs`` is shared with the other
    callbacks)."""
    return {key: value for key, value in logs.items() if not key.removeprefix("eval_").startswith(hidden)}


class _QuietConsole:
    """A console callback (mixed in before transformers' own) that prints the logs without the ``hidden`` keys."""

    def __init__(self, hidden: tuple[str, ...], **kwargs):
        super().__init__(**kwargs)
        self.hidden = hidden

    def on_log(self, args, state, control, logs=None, **kwargs):
        return super().on_log(args, state, control, logs=console_keys(logs or {}, self.hidden), **kwargs)


class _QuietProgress(_QuietConsole, ProgressCallback):
    """``ProgressCallback`` (above the progress bar) without the hidden keys."""


class _QuietPrinter(_QuietConsole, PrinterCallback):
    """``PrinterCallback`` (with ``disable_tqdm``) without the hidden keys."""


def quiet_console(trainer) -> bool:
    """Make ``trainer``'s console callback print trl's keys only (unless ``args.safe_vocab_print_metrics``); returns
    whether one was swapped. Called when the trainer is built (no progress bar yet); the new callback takes the old
    one's place in the handler's list and its ``max_str_len``."""
    if getattr(trainer.args, "safe_vocab_print_metrics", False):
        return False
    hidden = PROJECT_PREFIXES + (() if getattr(trainer, "use_vllm", False) else VLLM_ONLY_PREFIXES)
    callbacks = trainer.callback_handler.callbacks
    for index, callback in enumerate(callbacks):
        if type(callback) is ProgressCallback:
            callbacks[index] = _QuietProgress(hidden, max_str_len=callback.max_str_len)
        elif type(callback) is PrinterCallback:
            callbacks[index] = _QuietPrinter(hidden)
        else:
            continue
        return True
    return False


class _NoticeHandler(logging.StreamHandler):
    """The handler :func:`show_notices` adds (found again by its type, so a second call adds none). Without a stream
    of its own it writes to ``sys.stdout`` as it is when a notice is logged (a caller may have replaced it since)."""

    def __init__(self, stream=None):
        super().__init__(stream)
        self.follow_stdout = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self.follow_stdout:
            self.stream = sys.stdout
        super().emit(record)


def show_notices(stream=None) -> None:
    """Show the ``trl_integration`` logger's INFO notices and warnings on ``stream`` (default: stdout, where the
    command's other notices go), as their bare message. For command lines: a library user configures logging."""
    logger = logging.getLogger("trl_integration")
    logger.setLevel(logging.INFO)
    if not any(isinstance(handler, _NoticeHandler) for handler in logger.handlers):
        handler = _NoticeHandler(stream)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.propagate = False
