"""The grading pool: math-verify answers, adversarial outputs within the limit, hung and dying workers,
a sample that ran out of time graded again before it scores 0."""

import os
import time

import numpy as np
import pytest

from qarl_jax.rewards import Grader, grade_number
from qarl_jax.rewards.latex import GradeTimeout

LIMIT_S = 2.0
WORST_S = LIMIT_S + 2 * LIMIT_S  # a sample out of time: its first attempt, then one with twice the time
SLACK_S = 1.5  # process scheduling on a loaded CI machine


def hang(response: str, answer: str, timeout_s: int) -> float:
    time.sleep(60)
    return 1.0


def die(response: str, answer: str, timeout_s: int) -> float:
    os._exit(3)


def broken(response: str, answer: str, timeout_s: int) -> float:
    raise RecursionError("maximum recursion depth exceeded")


def slow_first(response: str, answer: str, timeout_s: int) -> float:
    """Out of time at the first attempt's own limit (1 s), correct with the retry's (2 s)."""
    if timeout_s < 2:
        raise GradeTimeout("cut short")
    return 1.0


@pytest.fixture(scope="module")
def grader():
    with Grader(
        num_workers=2,
        time_limit_s=LIMIT_S,
        graders={"hang": hang, "die": die, "broken": broken, "slow_first": slow_first},
    ) as g:
        yield g


@pytest.mark.parametrize(
    "response, answer",
    [
        ("so the probability is \\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
        ("The expression simplifies to \\boxed{2x + 1}.", "1 + 2x"),
        ("Hence $x \\in \\boxed{(1, 2]}$", "(1,2]"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("#### 1,000", "1000"),
        ("A: 72", "72"),
    ],
)
def test_math_kind_accepts_equivalent_answers(grader, response, answer):
    assert grader.grade([response], [answer], "math")[0] == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("\\boxed{2x - 1}", "1 + 2x"),
        ("\\boxed{[1, 2]}", "(1,2]"),
        ("", "1"),
    ],
)
def test_math_kind_rejects_different_answers(grader, response, answer):
    assert grader.grade([response], [answer], "math")[0] == 0.0


def test_gsm8k_kind_in_the_pool_matches_in_process(grader):
    responses = ["#### 18", "A: 1,000", "The answer is 7.", "\\boxed{5}", "no idea"] * 20
    answers = ["18", "1000", "8", "5", "3"] * 20
    expected = np.array([grade_number(r, a) for r, a in zip(responses, answers, strict=True)], np.float32)
    np.testing.assert_array_equal(grader.grade(responses, answers, "gsm8k"), expected)


ADVERSARIAL = {
    "digits_1mb": "1" * 1_000_000,
    "error_token_loop": "to " * 300_000,
    "unbalanced_braces": "$\\boxed{" + "{" * 100_000 + "42$",
    "deep_nesting_parens": "$" + "(" * 20_000 + "1" + ")" * 20_000 + "$",
    "deep_nesting_boxed": "\\boxed{" * 50_000 + "7" + "}" * 50_000,
    "tower_of_powers": "\\boxed{9^{9^{9^{9^{9}}}}}",
    "nested_sqrt": "$" + "\\sqrt{" * 3_000 + "2" + "}" * 3_000 + "$",
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_outputs_grade_zero_within_the_limit(grader, name):
    start = time.monotonic()
    assert grader.grade([ADVERSARIAL[name]], ["42"], "math")[0] == 0.0
    assert time.monotonic() - start < WORST_S + SLACK_S


def test_hung_worker_is_killed_replaced_and_counted(grader):
    before = dict(grader.stats)
    start = time.monotonic()
    scores = grader.grade(["a", "b", "c"], ["1", "1", "1"], "hang")
    assert time.monotonic() - start < 40  # killed each time (one hang alone is 60 s)
    np.testing.assert_array_equal(scores, np.zeros(3, np.float32))
    assert grader.stats["retries"] - before.get("retries", 0) == 3  # each tried again, with 2 x the time
    assert grader.stats["timeouts"] - before.get("timeouts", 0) == 3
    assert grader.grade(["#### 4"], ["4"], "gsm8k")[0] == 1.0


def test_dead_worker_is_replaced_and_counted(grader):
    before = grader.stats["crashes"]
    np.testing.assert_array_equal(grader.grade(["x", "y"], ["1", "1"], "die"), np.zeros(2, np.float32))
    assert grader.stats["crashes"] - before == 2
    assert grader.grade(["\\boxed{4}"], ["4"], "math")[0] == 1.0


def test_grader_exception_scores_zero_and_is_counted(grader):
    before = grader.stats["errors"]
    assert grader.grade(["x"], ["1"], "broken")[0] == 0.0
    assert grader.stats["errors"] - before == 1


def test_a_sample_out_of_time_is_graded_again_with_twice_the_time(grader):
    before = dict(grader.stats)
    assert grader.grade(["x", "y"], ["1", "1"], "slow_first").tolist() == [1.0, 1.0]
    assert grader.stats["retries"] - before.get("retries", 0) == 2
    assert grader.stats["timeouts"] == before.get("timeouts", 0)  # none scored 0 for time
    grader.counts_since_last_call()
    grader.grade(["x"], ["1"], "hang")
    counts = grader.counts_since_last_call()
    assert counts == {"graded": 1, "retries": 1, "timeouts": 1, "crashes": 0, "errors": 0}


def test_bad_calls_raise(grader):
    with pytest.raises(ValueError, match="kind"):
        grader.grade(["1"], ["1"], "chess")
    with pytest.raises(ValueError, match="answers"):
        grader.grade(["1", "2"], ["1"], "math")
    with pytest.raises(ValueError, match="num_workers"):
        Grader(num_workers=0)
