"""LaTeX / boxed answers (fractions, expressions, intervals) with Hugging Face's ``math-verify``.

A number with units is compared exactly (:mod:`qarl_jax.rewards.answers`); anything else left in
the answer goes to math-verify, never the other way round: a number match can not hide ``3x`` or
``2\\pi`` (issue 48: they scored 1 against 3 and 2 when the number was found first).

math-verify parses with sympy and bounds its own time with ``signal.alarm``, which works only in a
process's main thread: call this in a grading worker (see :mod:`qarl_jax.rewards.pool`), which also
enforces a hard limit from outside. Nothing here evaluates the response as code.
"""

from __future__ import annotations

import time

from qarl_jax.rewards.answers import FinalAnswer, final_answer
from qarl_jax.rewards.numbers import reference_number


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


def _config():
    """math-verify's extraction with its unit stripping off: units were removed already, where they
    are units (:func:`qarl_jax.rewards.answers.strip_units`); its own list reads ``3c`` or ``3 s``
    as 3."""
    from latex2sympy2_extended.latex2sympy2 import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    norm = NormalizationConfig(
        basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all", equations=False
    )
    return [LatexExtractionConfig(normalization_config=norm), ExprExtractionConfig()]


def grade_math(response: str, answer: str, timeout_s: int = 5) -> float:
    """1.0 when the response's final answer is mathematically equal to the reference.

    The final answer is read once (:func:`qarl_jax.rewards.answers.final_answer`: the last box,
    else the anchor's line, else the last number; none scores 0). When it and the reference are
    both numbers with units, they are compared as rationals (math-verify reads ``1,000`` as a
    tuple); otherwise math-verify decides on what is left once units are removed, with
    ``timeout_s`` (whole seconds, for ``signal.alarm``) per parse/verify; one cut short by it
    raises :class:`GradeTimeout` instead of scoring 0.
    """
    final = final_answer(response)
    if final is None:
        return 0.0
    reference, number = reference_number(answer), final.number()
    if reference is not None and number is not None:
        return float(number.equals(reference))
    from math_verify import parse, verify  # sympy-heavy: loaded by the grading workers that use it

    config = _config()
    gold_text = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    gold_latex = FinalAnswer(gold_text.strip(), "boxed").latex()
    gold = _timed(lambda: parse(gold_latex, config, parsing_timeout=timeout_s), timeout_s)
    pred = _timed(lambda: parse(final.latex(), config, parsing_timeout=timeout_s), timeout_s)
    if not (gold and pred):
        return 0.0
    return float(_timed(lambda: verify(gold, pred, timeout_seconds=timeout_s), timeout_s))
