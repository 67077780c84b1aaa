"""Moved to :mod:`trl_integration.demo.arithmetic`; importing a name from here warns, and this alias goes away in
the next release."""

from trl_integration._moved import moved

__all__ = [
    "OPERATIONS",
    "MAX_ANSWER_CHARS",
    "arithmetic_reward",
    "parse_answer",
    "is_test_problem",
    "sample_problems",
    "make_dataset",
    "completion_text",
    "accuracy",
]

__getattr__ = moved(__name__, {name: "trl_integration.demo.arithmetic" for name in __all__})
