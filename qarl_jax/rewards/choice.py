"""Multiple-choice grading (ARC-C, GPQA, MMLU-Pro style): the response's chosen option letter
against the reference letter.

The choice is read after the response's last anchor, as the number graders read theirs: the last
``\\boxed{...}`` (``\\boxed{B}``, ``\\boxed{(B)}``, ``\\boxed{\\text{B}}``, ``\\boxed{B. 42}``), else
the last "answer is" / "answer:" (``The answer is (C).``), else a last line that is a letter alone
(``B``, ``(B)``, ``B.``). A letter anywhere else in the text is not a choice: "I think" must not
read as option I. Only the letters ``A`` to ``J`` (MMLU-Pro's ten options) are choices. Pure
regular expressions in linear time, never ``eval``: safe in-process.
"""

from __future__ import annotations

import collections
import re

from qarl_jax.rewards.answers import boxed_content

LETTERS = "ABCDEFGHIJ"
_ANCHOR_RE = re.compile(r"\\boxed\s*\{|(?i:answer is|answer:)")
# a letter alone, maybe in parentheses or \text{}, maybe followed by "." / ")" / ":" and the option
_LETTER_RE = re.compile(rf"\s*(?:\\text\s*\{{\s*)?\(?([{LETTERS}])(?![A-Za-z])")
_SPAN_CHARS = 200


def extract_choice(response: str) -> str | None:
    """The option letter the response chose (see the module docstring), or None."""
    last = collections.deque(_ANCHOR_RE.finditer(response), maxlen=1)
    if last:
        anchor = last[0]
        if anchor.group().endswith("{"):
            span = boxed_content(response, anchor.end()) or ""
        else:
            span = response[anchor.end() : anchor.end() + _SPAN_CHARS].split("\n", 1)[0]
        m = _LETTER_RE.match(span.lstrip(" :*$"))
        return m.group(1) if m else None
    lines = response.strip().splitlines()
    if not lines:
        return None
    m = re.fullmatch(rf"\(?([{LETTERS}])[.)]?", lines[-1].strip())
    return m.group(1) if m else None


def grade_choice(response: str, answer: str, timeout_s: int = 0) -> float:
    """1.0 when the response chose the reference letter ``answer`` (``timeout_s`` unused: the
    pool's signature; nothing here can run long)."""
    return float(extract_choice(response) == answer.strip().upper())
