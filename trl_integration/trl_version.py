"""The trl releases the integration is tested against, checked from ``trl.__version__`` alone.

A leaf: it imports ``trl``'s top level (a lazy module: its version, not its trainer stack) and ``packaging``, so
the config (:mod:`trl_integration.grpo.config`) refuses an untested trl at import without loading trl's trainer and
vLLM with it (~3 s), and the fence (:mod:`trl_integration._private`) checks the same range before it does load them.
"""

from __future__ import annotations

from packaging.version import Version

__all__ = ["SUPPORTED_TRL", "TRL_MAX", "TRL_MIN", "check_trl_version", "unsupported_trl"]

#: The trl releases this integration is tested against: ``TRL_MIN <= version < TRL_MAX``.
TRL_MIN = "1.16"
TRL_MAX = "1.17"
SUPPORTED_TRL = f"trl>={TRL_MIN},<{TRL_MAX}"


def unsupported_trl(version: str, detail: str) -> ImportError:
    """The one-line error for trl ``version``: what is wrong (``detail``), the supported range, the fix."""
    return ImportError(
        f"trl {version} is not supported by safevocab's trl integration (tested: {SUPPORTED_TRL}): {detail}; "
        f"install a supported version, e.g. pip install '{SUPPORTED_TRL}'"
    )


def check_trl_version(version: str) -> None:
    """Check that ``version`` is in the tested range :data:`SUPPORTED_TRL` (run at import before trl's trainer stack
    loads, so an unsupported trl is answered in about the time of ``import torch``, not after ~7 s of trl's imports).

    Raises:
        ImportError: one line naming the version and the supported range.
    """
    try:
        parsed = Version(version)
    except Exception:  # noqa: BLE001 - any unparsable version is unsupported
        raise unsupported_trl(version, "unparsable version") from None
    if not Version(TRL_MIN) <= Version(parsed.base_version) < Version(TRL_MAX):
        raise unsupported_trl(version, "outside the tested range")
