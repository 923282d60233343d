"""LaTeX / boxed answers (fractions, expressions, intervals) with Hugging Face's ``math-verify``.

math-verify parses with sympy and bounds its own time with ``signal.alarm``, which works only in a
process's main thread: call this in a grading worker (see :mod:`qarl_jax.rewards.pool`), which also
enforces a hard limit from outside. Nothing here evaluates the response as code.
"""

from __future__ import annotations

from qarl_jax.rewards.numbers import grade_number


def _as_latex(answer: str) -> str:
    """math-verify finds answers inside math delimiters; a bare reference like ``1/2`` has none."""
    return answer if "$" in answer or "\\boxed" in answer or "\\(" in answer else f"${answer}$"


def grade_math(response: str, answer: str, timeout_s: int = 5) -> float:
    """1.0 when the response's final answer is mathematically equal to the reference.

    An exact final-number match counts first (math-verify reads ``1,000`` as a tuple); otherwise
    math-verify decides, with ``timeout_s`` (whole seconds, for ``signal.alarm``) per parse/verify.
    """
    if grade_number(response, answer):
        return 1.0
    from math_verify import parse, verify  # sympy-heavy: loaded by the grading workers that use it

    gold = parse(_as_latex(answer), parsing_timeout=timeout_s)
    pred = parse(response, parsing_timeout=timeout_s)
    return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout_s))
