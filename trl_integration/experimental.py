"""The warning an experimental package gives once at import, as ``trl.experimental`` does.

``trl_integration.lab``, ``trl_integration.study`` (and the core's ``safevocab.bench``, which warns the same way
without importing this package) may change or go in any release without deprecation. Importing one warns once per
process with :class:`ExperimentalWarning`, naming the package and where the stable API is listed; the variable
``SAFEVOCAB_EXPERIMENTAL_SILENCE=1`` (read at import, never set here) silences it. The command lines that are these
packages' supported entry points (``safevocab diagnose``, ``safevocab study``, ``safevocab bench``) set it for their
own process: their user asked for the tool, not the library.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["SILENCE_VARIABLE", "ExperimentalWarning", "warn_experimental"]

#: The variable that silences the warning (any of ``1``, ``true``, ``yes``).
SILENCE_VARIABLE = "SAFEVOCAB_EXPERIMENTAL_SILENCE"

#: The packages that warned in this process (a package imported again, or reloaded, does not warn again).
_warned: set[str] = set()


class ExperimentalWarning(UserWarning):
    """An experimental package of safevocab was imported: its names may change without deprecation."""


def warn_experimental(package: str) -> None:
    """Warn once that ``package`` is experimental, unless ``SAFEVOCAB_EXPERIMENTAL_SILENCE`` is set."""
    if package in _warned or os.environ.get(SILENCE_VARIABLE, "").strip().lower() in ("1", "true", "yes"):
        return
    _warned.add(package)
    warnings.warn(
        f"{package} is experimental: its names may change or go in any release without deprecation (the stable API "
        f"is in docs/api.md); set {SILENCE_VARIABLE}=1 to silence this",
        ExperimentalWarning,
        stacklevel=3,
    )
