"""Verifiable rewards: exact-number, math-verify and multiple-choice graders, run safely in a worker
pool."""

from qarl_jax.rewards.answers import FinalAnswer, boxed_content, final_answer
from qarl_jax.rewards.choice import extract_choice, grade_choice
from qarl_jax.rewards.latex import grade_math
from qarl_jax.rewards.numbers import extract_number, grade_number, parse_reference
from qarl_jax.rewards.pool import GRADER_COUNTS, GRADERS, Grader, grade

__all__ = [
    "GRADER_COUNTS",
    "FinalAnswer",
    "GRADERS",
    "Grader",
    "boxed_content",
    "extract_choice",
    "extract_number",
    "final_answer",
    "grade",
    "grade_choice",
    "grade_math",
    "grade_number",
    "parse_reference",
]
