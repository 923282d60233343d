"""A response's final answer, read once: the number, the units, the canonical form a vote counts.

Every grader and maj@k read a response through :func:`final_answer`, so a vote's key and its grade
come from one extraction. The final answer is taken after the last anchor, as Qwen2.5-Math's
evaluation (``extract_answer`` in its ``evaluation/parser.py``) takes it: the last ``\\boxed{...}``
(or ``\\fbox``), else ``####``, "answer is", "answer:" or "A:" (then the first ``$...$`` /
``\\(...\\)`` on the rest of that line unless a number comes before it, else the line itself),
else the last number in the text.

Units are removed only where they are units, following the conventions of math-verify's
``NormalizationConfig(units=True)`` (latex2sympy2_extended's ``math_normalization``), lighteval's
math normalisation and Qwen2.5-Math's ``strip_string``, but stricter than all three: a trailing
``\\text{...}`` / ``\\mathrm{...}`` / ``\\mbox{...}`` of words, a word of :data:`UNITS` (all of
two letters or more), degree signs, a percent sign (kept as a flag: ``50\\%`` equals 50 and 0.5, as
math-verify has it), currency signs, ``\\,`` / ``{,}`` thousands spacing. Never a bare single
letter (math-verify's list has ``c``, ``d``, ``h``, ``m``, ``s``, ``t``: ``3c`` would equal 3), a
constant (``\\pi``, ``e``) or the imaginary unit (``i``): those make a different mathematical
object, which the number path leaves to math-verify (:mod:`qarl_jax.rewards.latex`).

Everything here is regular expressions in linear time on bounded spans; nothing evaluates text.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from fractions import Fraction
from typing import Literal

MAX_NUMBER_CHARS = 64
_SPAN_CHARS = 200

NUMBER = r"(?:(?<![0-9A-Za-z)\]}])-)?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?"
NUMBER_RE = re.compile(NUMBER)
ANCHOR_RE = re.compile(r"\\boxed\s*\{|\\fbox\s*\{|####|(?i:answer is|answer:)|(?<![0-9A-Za-z])A:")
_MATH_RE = re.compile(r"\$\$?([^$]{1,200}?)\$|\\\((.{1,200}?)\\\)")

# Units of measure, time, money and angle a number may carry (plurals by "s" / "es" too). Only
# words of two letters or more: one letter after a number is a variable (3x, 3c) unless it sits in
# \text{} / \mathrm{} (5\text{ m}). Qwen2.5-Math's and math-verify's lists also hold single letters
# and count nouns ("apple", "student"); those read 3c or 3 apples as 3, which this grader refuses.
UNITS = frozenset(
    """mm cm km nm inch inches ft foot feet yd yard mi mile meter metre centimeter centimetre
    millimeter millimetre kilometer kilometre sq square cubic cu ml liter litre gal gallon quart pint
    cup ounce oz fl kg mg gram kilogram lb lbs pound ton tonne sec second min minute hr hrs hour day
    week month yr yrs year am pm mph kph kmh kmph dollar cent euro yuan rupee usd deg degree radian
    rad unit ohm watt volt joule newton acre hectare""".split()
)
_TEXT_CMD = r"\\(?:text|textrm|textnormal|textup|textit|textbf|mathrm|mbox)\s*"
_TEXT_WHOLE_RE = re.compile(rf"{_TEXT_CMD}\{{([^{{}}]*)\}}")
_POWER = r"(?:\s*\^\s*(?:\{\s*[23]\s*\}|[23])|[²³])?"
# a trailing \text{...} of words (letters, spaces, "/", "."), maybe squared / cubed; not e or i alone
_TEXT_UNIT_RE = re.compile(rf"\s*{_TEXT_CMD}\{{\s*(?![ei]\s*\}})[A-Za-z][A-Za-z ./\-]*\}}{_POWER}\s*$")
_WORD_UNIT_RE = re.compile(rf"(?<=[0-9}}\s])\s*([A-Za-z]{{2,}}(?:\s*/\s*[A-Za-z]+)?)\.?{_POWER}\s*$")
_PERCENT_RE = re.compile(rf"\s*(?:\\%|%|\bpercent\b|{_TEXT_CMD}\{{\s*(?:\\%|%|percent)\s*\}})\s*$")
_DEGREE_RE = re.compile(
    r"\s*(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree)\s*(?:\\text\s*\{\s*[CF]\s*\}|[CF](?![A-Za-z]))?\s*$"
)
_NOISE_RE = re.compile(r"\\[!,;:> ]|~|\\q?quad|\\left(?![a-z])|\\right(?![a-z])|\\displaystyle|\\\$|\$")
_THOUSANDS_RE = re.compile(r"(?<=[0-9])\{,\}(?=[0-9]{3})")
_DFRAC_RE = re.compile(r"\\[dtc]frac")
_FRAC_RE = re.compile(r"\\frac\s*\{\s*(-?[0-9]+)\s*\}\s*\{\s*([0-9]+)\s*\}|\\frac\s*([0-9])\s*([0-9])")
_SQRT_RE = re.compile(r"\\sqrt\s*([0-9A-Za-z])")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*([0-9A-Za-z])\s*([0-9A-Za-z])")
_VARIABLE_RE = re.compile(r"^\s*[A-Za-z]\s*=(?!=)")
# what may follow the number of a prose answer ("The answer is 18 apples"): not a glued letter run
# unless a unit (3x, 10i), not a constant or root (2 pi, 2\pi, 3\sqrt2), not a power other than a
# degree sign (2^{10})
_CONTINUATION_RE = re.compile(
    r"([A-Za-z]+)|\s*(?:\\(?:pi|sqrt|cdot|times|mathrm\s*\{\s*[ei]|text\s*\{\s*[ei]\s*\})|π|√|"
    r"(?:pi|i|e)(?![A-Za-z.])|\^(?!\s*\{?\s*\\circ))"
)
_ORDINALS = frozenset(("st", "nd", "rd", "th"))
_LATEX_RE = re.compile(r"[\\{}^_]")
_DIGIT_RE = re.compile(r"[0-9]")
_PROSE_PERCENT_RE = re.compile(r"\s*(?:\\%|%|percent\b)")


@dataclasses.dataclass(frozen=True)
class Number:
    """A number answer: its value, and whether it carried a percent sign."""

    value: Fraction
    percent: bool = False

    def equals(self, other: Number) -> bool:
        """Equal values; a side with a percent sign may also mean its value / 100 (math-verify's
        convention: ``50\\%`` equals 50 and 0.5)."""
        a, b = self.value, other.value
        return a == b or (self.percent and a / 100 == b) or (other.percent and b / 100 == a)


Where = Literal["boxed", "math", "prose", "last_number"]


@dataclasses.dataclass(frozen=True)
class FinalAnswer:
    """A response's final answer: its text and where it was found (see the module docstring)."""

    text: str
    where: Where

    def number(self) -> Number | None:
        """The answer as a number (with units), or None when anything else is left in it."""
        if self.where in ("boxed", "math"):
            return read_number(self.text)
        m = NUMBER_RE.search(self.text)  # prose: the first number, unless inside LaTeX or continued
        if m is None or _LATEX_RE.search(self.text, 0, m.start()) or _continues(self.text[m.end() :]):
            return None
        value = parse_number(m.group())
        return None if value is None else Number(value, bool(_PROSE_PERCENT_RE.match(self.text, m.end())))

    def key(self) -> str:
        """The canonical form a vote counts: the number (``1/2``, ``1000``; a percent sign dropped,
        as Qwen2.5-Math's ``strip_string`` drops it), else the text normalised by
        :func:`normalise`."""
        number = self.number()
        return str(number.value) if number is not None else normalise(self.text)

    def latex(self) -> str:
        """The text math-verify parses: the units removed, inside math delimiters (prose too: its
        expression reader would take the 3 of ``3x``)."""
        core, percent = strip_units(self.text)
        return f"${core}\\%$" if percent else f"${core}$"


def _continues(rest: str) -> bool:
    """Whether the text after a prose answer's number makes it another object (3x, 2 pi, 10i)."""
    m = _CONTINUATION_RE.match(rest)
    if m is None:
        return False
    word = m.group(1)
    return word is None or not (_is_unit(word) or word.lower() in _ORDINALS)


def _is_unit(word: str) -> bool:
    w = word.lower()
    return any(x in UNITS for x in (w, w[:-1] if w.endswith("s") else w, w[:-2] if w.endswith("es") else w))


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


def strip_units(text: str) -> tuple[str, bool]:
    """(``text`` without spacing noise, currency signs, trailing units and degree / percent signs,
    whether a percent sign was among them). A whole answer in ``\\text{}`` is unwrapped first."""
    s = _THOUSANDS_RE.sub(",", text.strip())
    whole = _TEXT_WHOLE_RE.fullmatch(s)
    s = _NOISE_RE.sub("", whole.group(1) if whole else s).strip().rstrip(".").strip()
    percent = False
    for _ in range(4):  # "5 cm^2", "30^\circ", "50\%": a few trailing parts at most
        before = s
        s, hits = _PERCENT_RE.subn("", s)
        percent = percent or hits > 0
        s = _DEGREE_RE.sub("", _TEXT_UNIT_RE.sub("", s))
        m = _WORD_UNIT_RE.search(s)
        if m and all(_is_unit(w) for w in re.split(r"\s*/\s*", m.group(1))):
            s = s[: m.start()]
        s = s.strip().rstrip(".").strip()
        if s == before:
            break
    return s, percent


def read_number(text: str) -> Number | None:
    """A whole answer (a box's content, a reference) as a number with units, or None: ``18``,
    ``\\$1{,}000``, ``\\frac{3}{4}``, ``\\dfrac12``, ``x = 7``, ``5\\text{ cm}^2``, ``30^\\circ``,
    ``50\\%`` are numbers; ``3x``, ``2\\pi``, ``10i``, ``3\\sqrt{2}``, ``3 c`` are not."""
    core, percent = strip_units(text)
    core = _VARIABLE_RE.sub("", _DFRAC_RE.sub(r"\\frac", core)).strip()
    core = _FRAC_RE.sub(lambda m: f"{m[1] or m[3]}/{m[2] or m[4]}", core)
    m = re.fullmatch(rf"\s*({NUMBER})\s*", core)
    value = parse_number(m.group(1)) if m else None
    return None if value is None else Number(value, percent)


def normalise(text: str) -> str:
    """A non-number answer's canonical text, the parts of Qwen2.5-Math's ``strip_string`` that
    change no value: units and spacing removed (:func:`strip_units`), ``\\dfrac`` / ``\\tfrac`` as
    ``\\frac``, ``\\frac12`` as ``\\frac{1}{2}``, ``\\sqrt3`` as ``\\sqrt{3}``, no ``x =`` prefix,
    no whitespace. ``\\dfrac{\\sqrt3}{2}`` and ``\\frac{\\sqrt{3}}{2}`` are one key."""
    core, percent = strip_units(text)
    core = _VARIABLE_RE.sub("", _DFRAC_RE.sub(r"\\frac", core))
    core = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", _SQRT_RE.sub(r"\\sqrt{\1}", core))
    return "".join(core.split()) + ("%" if percent else "")


def final_answer(response: str) -> FinalAnswer | None:
    """The response's final answer (see the module docstring), or None when it has none."""
    last = collections.deque(ANCHOR_RE.finditer(response), maxlen=1)
    if not last:
        numbers = collections.deque(NUMBER_RE.finditer(response), maxlen=1)
        if not numbers or _continues(response[numbers[0].end() : numbers[0].end() + _SPAN_CHARS]):
            return None
        return FinalAnswer(numbers[0].group(), "last_number")
    anchor = last[0]
    if anchor.group().endswith("{"):
        content = boxed_content(response, anchor.end())
        return None if content is None or not content.strip() else FinalAnswer(content, "boxed")
    span = response[anchor.end() : anchor.end() + _SPAN_CHARS].split("\n", 1)[0]
    math = _MATH_RE.search(span)
    if math is not None and not _DIGIT_RE.search(span, 0, math.start()):  # "is therefore $\\frac12$"
        return FinalAnswer(math.group(1) or math.group(2), "math")
    span = span.replace("\\$", "$").strip(" :*")
    return FinalAnswer(span, "prose") if span else None
