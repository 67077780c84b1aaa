"""Moved: the mismatch lab to :mod:`trl_integration.lab`, the ``safevocab diagnose`` command to
:mod:`trl_integration.commands.diagnose` and ``safevocab`` to :mod:`trl_integration.commands`. Importing a name
from here warns; this alias goes away in the next release.
"""

from trl_integration._moved import moved

__all__ = [
    "DTYPES",
    "DEFAULT_TEXTS",
    "DiagnoseResult",
    "build_parser",
    "parse_compare",
    "default_texts",
    "run_diagnose",
    "write_outputs",
    "main",
]

__getattr__ = moved(
    __name__,
    {
        "DTYPES": "trl_integration.lab.inputs",
        "DEFAULT_TEXTS": "trl_integration.lab.inputs",
        "parse_compare": "trl_integration.lab.inputs",
        "default_texts": "trl_integration.lab.inputs",
        "DiagnoseResult": "trl_integration.lab.engine",
        "run_diagnose": "trl_integration.lab.engine",
        "BOUND_TOLERANCE": "trl_integration.lab.engine",
        "write_outputs": "trl_integration.lab.report",
        "DEFAULT_RULE": "trl_integration.config",
        "build_parser": "trl_integration.commands._legacy:diagnose_parser",
        "main": "trl_integration.commands",
    },
)
