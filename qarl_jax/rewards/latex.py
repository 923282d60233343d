"""LaTeX / boxed answers (fractions, expressions, intervals) with Hugging Face's ``math-verify``.

math-verify parses with sympy and bounds its own time with ``signal.alarm``, which works only in a
process's main thread: call this in a grading worker (see :mod:`qarl_jax.rewards.pool`), which also
enforces a hard limit from outside. Nothing here evaluates the response as code.
"""

from __future__ import annotations

import time

from qarl_jax.rewards.numbers import grade_number


class GradeTimeout(Exception):
    """A grader's own time limit cut it short: the sample may be correct, so the pool grades it
    again with more time before it scores 0 (:mod:`qarl_jax.rewards.pool`)."""


def _timed(call, timeout_s: int):
    """``call()``, or :class:`GradeTimeout` where math-verify's alarm cut it short: it then returns
    the empty answer it returns for a failure, after at least ``timeout_s`` (nothing else takes that
    long: the alarm would have fired), and logs a warning nobody reads."""
    start = time.monotonic()
    result = call()
    if not result and time.monotonic() - start >= timeout_s:
        raise GradeTimeout(f"math-verify ran past its {timeout_s} s")
    return result


def _as_latex(answer: str) -> str:
    """math-verify finds answers inside math delimiters; a bare reference like ``1/2`` has none."""
    return answer if "$" in answer or "\\boxed" in answer or "\\(" in answer else f"${answer}$"


def grade_math(response: str, answer: str, timeout_s: int = 5) -> float:
    """1.0 when the response's final answer is mathematically equal to the reference.

    An exact final-number match counts first (math-verify reads ``1,000`` as a tuple); otherwise
    math-verify decides, with ``timeout_s`` (whole seconds, for ``signal.alarm``) per parse/verify;
    one cut short by it raises :class:`GradeTimeout` instead of scoring 0.
    """
    if grade_number(response, answer):
        return 1.0
    from math_verify import parse, verify  # sympy-heavy: loaded by the grading workers that use it

    gold = _timed(lambda: parse(_as_latex(answer), parsing_timeout=timeout_s), timeout_s)
    pred = _timed(lambda: parse(response, parsing_timeout=timeout_s), timeout_s)
    if not (gold and pred):
        return 0.0
    return float(_timed(lambda: verify(gold, pred, timeout_seconds=timeout_s), timeout_s))
