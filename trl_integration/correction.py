"""Moved to :mod:`safevocab.correction` (torch only); this alias goes away in the next release."""

import warnings

from safevocab.correction import IS_MODES, ImportanceRatio, importance_sampling_ratio
from safevocab.mismatch import LOG_RATIO_BOUND

warnings.warn(
    "trl_integration.correction moved to safevocab.correction; import it from there",
    FutureWarning,
    stacklevel=2,
)

__all__ = ["IS_MODES", "LOG_RATIO_BOUND", "ImportanceRatio", "importance_sampling_ratio"]
