"""Exact-number grading: find the response's final answer, compare it with the reference as a rational.

The final answer is taken after the last anchor in the response: ``\\boxed{...}``, ``####``,
"answer is", "answer:" or "A:"; with no anchor, the last number in the text. Commas between
thousands, ``$``, ``%``, units and trailing periods are ignored; ``18``, ``18.00`` and ``$18.`` are
equal. Every pattern here runs in linear time and numbers longer than :data:`MAX_NUMBER_CHARS` are
refused, so megabytes of garbage cost milliseconds and never a huge integer conversion. Pure
functions: safe to call in-process (the synthetic task) or in grading workers.
"""

from __future__ import annotations

import collections
import re
from fractions import Fraction

MAX_NUMBER_CHARS = 64
_SPAN_CHARS = 200

_NUMBER = r"(?:(?<![0-9A-Za-z)\]}])-)?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?"
_NUMBER_RE = re.compile(_NUMBER)
_ANCHOR_RE = re.compile(r"\\boxed\s*\{|\\fbox\s*\{|####|(?i:answer is|answer:)|(?<![0-9A-Za-z])A:")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox|mathbf)\s*\{([^{}]*)\}")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?[0-9]+)\s*\}\s*\{\s*([0-9]+)\s*\}")
_VARIABLE_RE = re.compile(r"^\s*[A-Za-z]\s*=")
_BOXED_RE = re.compile(rf"\s*({_NUMBER})[\sA-Za-z.]*")
_NOISE = (*r"^{\circ} ^\circ \left \right \$ $ \% % \! \, \; ~".split(), "\\ ")


def parse_number(text: str) -> Fraction | None:
    """``text`` (one number token, maybe with thousands commas or ``a/b``) as a rational, or None."""
    text = text.replace(",", "")
    if len(text) > MAX_NUMBER_CHARS:
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def boxed_content(text: str, start: int) -> str | None:
    """Text between the brace at ``start - 1`` and its match; None when unbalanced."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _boxed_number(content: str) -> Fraction | None:
    """A boxed answer must be a number (units allowed); ``\\frac{1}{2}``, ``\\$1,000``, ``x = 5`` are."""
    s = _FRAC_RE.sub(r"\1/\2", _TEXT_CMD_RE.sub(r" \1", content))
    for noise in _NOISE:
        s = s.replace(noise, "")
    s = _VARIABLE_RE.sub("", s)
    m = _BOXED_RE.fullmatch(s)
    return parse_number(m.group(1)) if m else None


def extract_number(response: str) -> Fraction | None:
    """The response's final numeric answer (see the module docstring), or None."""
    last = collections.deque(_ANCHOR_RE.finditer(response), maxlen=1)
    if not last:
        numbers = _NUMBER_RE.findall(response)
        return parse_number(numbers[-1]) if numbers else None
    anchor = last[0]
    if anchor.group().endswith("{"):
        content = boxed_content(response, anchor.end())
        return None if content is None else _boxed_number(content)
    span = response[anchor.end() : anchor.end() + _SPAN_CHARS].split("\n", 1)[0]
    m = _NUMBER_RE.search(span.lstrip(" :*$\\"))
    return parse_number(m.group()) if m else None


def parse_reference(answer: str) -> Fraction | None:
    """A reference answer (``"18"``, ``"1,000"``, ``"#### 18"``, ``"\\frac{1}{2}"``) as a rational."""
    text = answer.rsplit("####", 1)[-1].strip().rstrip(".")
    for noise in _NOISE:
        text = text.replace(noise, "")
    m = _NUMBER_RE.fullmatch(text.strip())
    return parse_number(m.group()) if m else _boxed_number(text)


def grade_number(response: str, answer: str) -> float:
    """1.0 when the response's final number equals the reference number, else 0.0."""
    reference = parse_reference(answer)
    return float(reference is not None and extract_number(response) == reference)
