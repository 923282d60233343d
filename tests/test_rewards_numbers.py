"""Exact-number grading: each answer form, reference forms, and garbage that must grade 0 fast."""

import time
from fractions import Fraction

import numpy as np
import pytest

from qarl_jax.rewards import extract_number, grade, grade_number, parse_reference


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Janet sells 9 eggs.\n#### 18", 18),
        ("so 2 + 3 = 5\n#### 1,234", 1234),
        ("The answer is 18.", 18),
        ("The answer is: $1,000.50 in total", Fraction(200100, 200)),
        ("Therefore the final answer is -5 degrees.", -5),
        ("She makes 9 * 2 = $<<9*2=18>>18 every day.\nA: 18", 18),
        ("A: 3,000", 3000),
        ("We get \\boxed{42}.", 42),
        ("\\boxed{\\$18.00}", 18),
        ("\\boxed{18 \\text{ dollars}}", 18),
        ("\\boxed{1,000}", 1000),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
        ("\\boxed{x = 7}", 7),
        ("\\boxed{50\\%}", 50),
        ("first \\boxed{3} then on reflection \\boxed{4}", 4),
        ("16 - 3 = 13 eggs are left, sold for 26", 26),
        ("16-3=13", 13),
        ("Answer: 12 cm.", 12),
    ],
)
def test_each_answer_form(response, expected):
    assert extract_number(response) == expected
    assert grade_number(response, str(expected) if isinstance(expected, int) else f"{expected}") == 1.0
    assert grade_number(response, "999999") == 0.0


@pytest.mark.parametrize(
    "response",
    [
        "#### 17",  # wrong number after the anchor
        "The answer is 18 plus 1 = 19\n#### 19",  # the last anchor wins
        "\\boxed{18x^2}",  # not a number: the exact grader refuses it
        "\\boxed{{{18",  # unbalanced
        "no numbers at all",
        "",
        "A: eighteen",
    ],
)
def test_non_answers_grade_zero(response):
    assert grade_number(response, "18") == 0.0


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("18", 18),
        ("1,000", 1000),
        ("#### 72", 72),
        ("-3", -3),
        ("0.5", Fraction(1, 2)),
        ("\\frac{1}{2}", Fraction(1, 2)),
    ],
)
def test_reference_forms(answer, expected):
    assert parse_reference(answer) == expected


def test_reference_that_is_not_a_number_grades_zero():
    assert parse_reference("(1, 2]") is None
    assert grade_number("(1, 2]", "(1, 2]") == 0.0


GARBAGE = {
    "digits_1mb": "1" * 1_000_000,
    "error_token_loop": "to " * 300_000,
    "anchor_loop": "A:" * 500_000,
    "unbalanced_braces": "\\boxed{" + "{" * 200_000 + "18",
    "deep_nesting": "\\boxed{" * 100_000 + "5" + "}" * 100_000,
    "huge_answer": "#### " + "9" * 5_000,
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_garbage_grades_zero_quickly_in_process(name):
    start = time.perf_counter()
    assert grade_number(GARBAGE[name], "18") == 0.0
    assert time.perf_counter() - start < 1.0


def test_synthetic_grade_is_in_process_and_vectorised():
    scores = grade(["#### 3", "A: 4", "nothing"], ["3", "3", "3"], "synthetic")
    np.testing.assert_array_equal(scores, np.array([1, 0, 0], np.float32))
    assert scores.dtype == np.float32
    with pytest.raises(ValueError, match="answers"):
        grade(["1"], [], "synthetic")
