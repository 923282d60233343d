"""Verifiable rewards: exact-number and math-verify graders, run safely in a worker pool."""

from qarl_jax.rewards.latex import grade_math
from qarl_jax.rewards.numbers import extract_number, grade_number, parse_reference
from qarl_jax.rewards.pool import GRADER_COUNTS, GRADERS, Grader, grade

__all__ = [
    "GRADER_COUNTS",
    "GRADERS",
    "Grader",
    "extract_number",
    "grade",
    "grade_math",
    "grade_number",
    "parse_reference",
]
