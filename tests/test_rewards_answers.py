"""The grader never takes another mathematical object for the reference, and takes every way of
writing the reference that the evaluators people use accept (issue 48).

Conventions cited per row: "math-verify" is Hugging Face's math-verify 0.9 (``parse`` / ``verify``,
its ``latex2sympy2_extended`` normalisation; lighteval's math tasks grade with it); "Qwen" is
Qwen2.5-Math's ``evaluation/parser.py`` (``extract_answer``, ``strip_string``, ``_fix_fracs``,
``_fix_sqrt``) and ``grader.py`` (``math_equal``); "GSM8K" is the dataset's own ``#### N`` answers.
Where the row says "refused", one of those evaluators accepts it and this grader does not, on
purpose: the answer is another object (math-verify's unit list holds ``c`` and ``s``; Qwen's holds
``t``, ``h``, ``c``, ``l``, ``s``).
"""

import pytest

from qarl_jax.evaluate.metrics import answer_key
from qarl_jax.rewards import grade_math, grade_number

# (response, reference, why it is a different object)
DIFFERENT = [
    ("\\boxed{3x}", "3", "a trailing variable: 3*x (math-verify parses 3*x)"),
    ("\\boxed{3 x}", "3", "the same, spaced"),
    ("\\boxed{2 pi}", "2", "a constant written out: math-verify parses 2*p*i"),
    ("\\boxed{2\\pi}", "2", "a constant: 2*pi (math-verify)"),
    ("\\boxed{10i}", "10", "the imaginary unit: 10*i (math-verify)"),
    ("\\boxed{3e}", "3", "Euler's e: 3*E (math-verify)"),
    ("\\boxed{3\\mathrm{e}}", "3", "Euler's e in \\mathrm is not a unit"),
    ("\\boxed{5\\text{ i}}", "5", "i in \\text is not a unit"),
    ("\\boxed{3\\sqrt{2}}", "3", "a root: 3*sqrt(2) (math-verify)"),
    ("\\boxed{2^{10}}", "2", "a power"),
    ("\\boxed{3c}", "3", "refused: math-verify's unit list strips c (3c = 3 there)"),
    ("\\boxed{3 s}", "3", "refused: math-verify's unit list strips s; one letter is a variable here"),
    ("\\boxed{12 apples}", "12", "refused: a count noun is no unit here (math-verify and Qwen list apple)"),
    ("\\boxed{\\frac{1}{3}}", "0.5", "another number (math-verify)"),
    ("\\boxed{0.33}", "\\frac{1}{3}", "a rounding is another number (math-verify)"),
    ("\\boxed{3.0001}", "3", "another number (math-verify float_rounding 6)"),
    ("\\boxed{5\\%}", "50", "5% is 5 or 0.05, never 50 (math-verify percentage)"),
    ("\\boxed{-3}", "3", "the sign"),
    ("\\boxed{(1, 2)}", "(1,2]", "an open interval is another set (math-verify)"),
    ("first \\boxed{3}, on reflection \\boxed{4}", "3", "the last box is the answer (Qwen extract_answer)"),
    ("The answer is 3x.", "3", "a prose anchor's number continued by a variable (Qwen 'answer is')"),
    ("The answer is $3\\sqrt{2}$.", "3", "a prose anchor's math, a root"),
    ("so the total is 10i", "10", "no anchor: the last number (Qwen), continued by i"),
    ("no answer at all", "3", "nothing to grade"),
]

# (response, reference, the convention that calls them equal)
EQUAL = [
    ("\\boxed{5\\text{ cm}}", "5", "units in \\text: math-verify units, Qwen _remove_right_units"),
    ("\\boxed{5 \\text{ cm}^2}", "5", "a squared unit: math-verify units"),
    ("\\boxed{\\text{5 cm}}", "5", "the whole answer in \\text: math-verify units"),
    ("\\boxed{5\\,\\mathrm{m}}", "5", "a one-letter unit in \\mathrm: math-verify units"),
    ("\\boxed{12 cm}", "12", "a unit word: math-verify's unit list (cm)"),
    ("\\boxed{18 \\text{ dollars}}", "18", "a currency word: Qwen _remove_right_units"),
    ("\\boxed{\\$18.00}", "18", "a dollar sign: Qwen strip_string, math-verify removes \\$"),
    ("\\boxed{5^\\circ}", "5", "a degree sign: Qwen strip_string removes ^\\circ, math-verify"),
    ("\\boxed{30^{\\circ}}", "30", "a degree sign in braces: Qwen strip_string, math-verify"),
    ("\\boxed{50\\%}", "50", "a percent sign: Qwen strip_string drops \\%, math-verify 50% = 50"),
    ("\\boxed{50\\%}", "0.5", "percent as a fraction: math-verify, Qwen math_equal include_percentage"),
    ("\\boxed{\\dfrac12}", "1/2", "\\dfrac, unbraced digits: Qwen _fix_fracs, math-verify"),
    ("\\boxed{0.5}", "\\frac{1}{2}", "a decimal of a fraction: math-verify"),
    ("\\boxed{1{,}000}", "1000", "{,} thousands: math-verify parses 1{,}000 as 1000"),
    ("\\boxed{1,000}", "1000", "thousands commas: GSM8K answers, Qwen strip_string"),
    ("\\boxed{1\\,000}", "1000", "thin-space thousands: Qwen strip_string removes \\,"),
    ("\\boxed{x = 7}", "7", "an assignment's value: Qwen strip_string drops 'x=', math-verify"),
    ("\\boxed{\\frac{\\sqrt3}{2}}", "\\dfrac{\\sqrt{3}}{2}", "Qwen _fix_sqrt / _fix_fracs, math-verify"),
    ("\\boxed{2+1}", "3", "an expression of the number: math-verify decides"),
    ("\\boxed{2\\pi}", "2\\pi", "the same constant: math-verify"),
    ("Hence $x \\in \\boxed{(1, 2]}$", "(1,2]", "an interval: math-verify"),
    ("The answer is $\\frac{1}{2}$.", "0.5", "a prose anchor's math: Qwen extract_answer 'answer is'"),
    ("The answer is 18 apples.", "18", "a prose anchor's number, words after it are prose (GSM8K-style)"),
    ("Janet makes 9 * 2 = 18\n#### 1,234", "1234", "GSM8K's #### answer with thousands commas"),
]


@pytest.mark.parametrize("response, reference, why", DIFFERENT)
def test_a_different_object_scores_0(response, reference, why):
    assert grade_math(response, reference) == 0.0, why
    assert grade_number(response, reference) == 0.0, why


@pytest.mark.parametrize("response, reference, why", EQUAL)
def test_an_equivalent_writing_scores_1(response, reference, why):
    assert grade_math(response, reference) == 1.0, why


def test_equivalent_writings_are_one_vote():
    """maj@k's key is the canonical form the grade reads (metrics.answer_key)."""
    halves = ("\\boxed{\\frac12}", "\\boxed{\\dfrac{1}{2}}", "\\boxed{0.5}", "The answer is 1/2.")
    keys = {answer_key("math", r) for r in halves}
    assert keys == {"1/2"}
    roots = {answer_key("math", r) for r in ("\\boxed{\\dfrac{\\sqrt3}{2}}", "\\boxed{\\frac{\\sqrt{3}}{2}}")}
    assert roots == {"\\frac{\\sqrt{3}}{2}"}
    assert answer_key("math", "\\boxed{3x}") != answer_key("math", "\\boxed{3}")


# maj@4 counted by hand on six items whose equivalent answers are written differently:
# 1. 1/3 | \dfrac12 | \tfrac12 | 0.5: votes 1/2 x3, 1/3 x1 -> 1/2, right (1). On raw strings
#    (before issue 48) all four differed and the tie's first, 1/3, won: 0.
# 2. \sqrt{3} | \dfrac{\sqrt3}{2} | \frac{\sqrt{3}}{2} | \tfrac{\sqrt3}{2}: \frac{\sqrt{3}}{2} x3
#    -> right (1); on raw strings: 0.
# 3. 1{,}000 | 1,000 | #### 1000 | 999: 1000 x3 -> right (1).
# 4. 50\% | 3x | 3x | 50 (reference 50): 50 x2 (the percent sign dropped), 3x x2, a tie: the first
#    given, 50, wins: right (1).
# 5. 3x | 3 | 3x | 3 (reference 3): 3x x2, 3 x2, a tie: 3x first: wrong (0). Before issue 48 all
#    four were the vote 3 and 3x graded 1.
# 6. three samples without an answer and \boxed{3}: no answer never wins -> 3, right (1).
# maj@4 = (1 + 1 + 1 + 1 + 0 + 1) / 6 = 5/6; pass@1 = (3 + 3 + 3 + 2 + 2 + 1) / 4 / 6 = 7/12.
HAND_BUILT = [
    ("\\frac{1}{2}", ["\\boxed{1/3}", "\\boxed{\\dfrac12}", "\\boxed{\\tfrac12}", "\\boxed{0.5}"]),
    (
        "\\frac{\\sqrt{3}}{2}",
        [
            "\\boxed{\\sqrt{3}}",
            "\\boxed{\\dfrac{\\sqrt3}{2}}",
            "\\boxed{\\frac{\\sqrt{3}}{2}}",
            "\\boxed{\\tfrac{\\sqrt3}{2}}",
        ],
    ),
    ("1000", ["\\boxed{1{,}000}", "\\boxed{1,000}", "so\n#### 1000", "\\boxed{999}"]),
    ("50", ["\\boxed{50\\%}", "\\boxed{3x}", "\\boxed{3x}", "\\boxed{50}"]),
    ("3", ["\\boxed{3x}", "\\boxed{3}", "\\boxed{3x}", "\\boxed{3}"]),
    ("3", ["no answer", "I do not know", "\\boxed{3}", "still thinking"]),
]


def test_majority_on_a_hand_built_file_equals_the_count_by_hand():
    """The records evaluate writes (answer key and grade per sample, one extraction), through the
    figures it computes (command._figures)."""
    from qarl_jax.evaluate.command import _figures

    records = [
        {
            "samples": [
                {
                    "response": r,
                    "answer": answer_key("math", r),
                    "grade": grade_math(r, ref),
                    "tokens": 1,
                    "finish": "eos",
                }
                for r in responses
            ]
        }
        for ref, responses in HAND_BUILT
    ]
    grades = [[s["grade"] for s in rec["samples"]] for rec in records]
    assert grades == [[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 1], [0, 1, 0, 1], [0, 0, 1, 0]]
    figures = _figures(records, [1])
    assert figures["maj@4"] == pytest.approx(5 / 6, abs=1e-12)
    assert figures["pass@1"] == pytest.approx(7 / 12, abs=1e-12)
