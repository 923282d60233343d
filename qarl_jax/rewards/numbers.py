"""Exact-number grading: the response's final answer (:mod:`qarl_jax.rewards.answers`) as a number,
compared with the reference as a rational.

The final answer is taken after the last anchor in the response: ``\\boxed{...}``, ``####``,
"answer is", "answer:" or "A:"; with no anchor, the last number in the text. Commas between
thousands, ``$``, ``%``, units and trailing periods are ignored; ``18``, ``18.00`` and ``$18.`` are
equal; ``3x``, ``2\\pi``, ``10i`` are not numbers (they score 0 here; the math grader hands them to
math-verify). Every pattern runs in linear time and numbers longer than :data:`MAX_NUMBER_CHARS`
are refused, so megabytes of garbage cost milliseconds and never a huge integer conversion. Pure
functions: safe to call in-process (the synthetic task) or in grading workers.
"""

from __future__ import annotations

from fractions import Fraction

from qarl_jax.rewards.answers import MAX_NUMBER_CHARS, NUMBER_RE, Number, final_answer, read_number

__all__ = ["MAX_NUMBER_CHARS", "extract_number", "grade_number", "parse_reference", "reference_number"]


def reference_number(answer: str) -> Number | None:
    """A reference answer (``"18"``, ``"1,000"``, ``"#### 18"``, ``"\\frac{1}{2}"``, ``"50\\%"``)
    as a number with its percent flag, or None when it is something else (``"(1, 2]"``)."""
    text = answer.rsplit("####", 1)[-1].strip().rstrip(".")
    m = NUMBER_RE.fullmatch(text)
    return read_number(m.group() if m else text)


def parse_reference(answer: str) -> Fraction | None:
    """The value of :func:`reference_number`, or None."""
    number = reference_number(answer)
    return None if number is None else number.value


def extract_number(response: str) -> Fraction | None:
    """The response's final numeric answer (see the module docstring), or None."""
    final = final_answer(response)
    number = None if final is None else final.number()
    return None if number is None else number.value


def grade_number(response: str, answer: str) -> float:
    """1.0 when the response's final number equals the reference number (a percent sign may mean
    the value / 100, :meth:`Number.equals`), else 0.0."""
    reference = reference_number(answer)
    final = final_answer(response) if reference is not None else None
    number = None if final is None else final.number()
    return float(reference is not None and number is not None and number.equals(reference))
