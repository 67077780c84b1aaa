"""safevocab: safe-vocabulary (Dynamic Vocabulary Pruning) log-probabilities for LLM RL.

Core package: depends on torch only. See :mod:`safevocab.rules`, :mod:`safevocab.logprobs` and
:mod:`safevocab.bounds`; :mod:`safevocab.testing` (needs hypothesis) is imported explicitly.
"""

from safevocab.logprobs import SafeLogProbs, fused_safe_logprobs, safe_log_softmax, transform_logits
from safevocab.rules import (
    Intersection,
    MinP,
    MinProb,
    NoPruning,
    SafeVocabRule,
    TopK,
    TopP,
    parse_rule,
)
from safevocab.support import SafeSupport

__version__ = "0.1.0"

__all__ = [
    "SafeLogProbs",
    "safe_log_softmax",
    "fused_safe_logprobs",
    "transform_logits",
    "SafeVocabRule",
    "NoPruning",
    "MinP",
    "MinProb",
    "TopK",
    "TopP",
    "Intersection",
    "parse_rule",
    "SafeSupport",
]
