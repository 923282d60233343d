"""Prompt records and the malformed-row policy shared by every source.

A record is a plain dict ``{"prompt": str, "answer": str, "id": str}`` (sources may add fields, e.g.
the synthetic task's reference ``solution``). A row that cannot become a record is a :class:`Rejected`
value rather than an exception, so a pipeline can count and skip it hours into a run; the ``error``
policy turns it into a :class:`MalformedRowError` naming where the row came from.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, TypeGuard

from qarl_jax.errors import MalformedRowError

AnswerFormat = Literal["gsm8k", "plain"]
Record = dict[str, Any]


def is_answer_format(value: str) -> TypeGuard[AnswerFormat]:
    """Whether ``value`` names an :data:`AnswerFormat`: configs hold it as plain text (YAML has no
    literal types), so the type checker learns the narrower type here."""
    return value in typing.get_args(AnswerFormat)


CATEGORIES = ("malformed", "too_long", "empty", "undecodable")  # what the metrics count skips by
_CATEGORY = {"bad_utf8": "undecodable", "empty_prompt": "empty", "too_long": "too_long"}


def category(reason: str) -> str:
    """The metrics' category of a rejection reason (every reason not named is ``malformed``)."""
    return _CATEGORY.get(reason, "malformed")


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A row that did not become a record: why (a short counter key), where, and the detail."""

    reason: str
    origin: str
    detail: str

    def error(self) -> MalformedRowError:
        return MalformedRowError(f"{self.origin}: {self.reason}: {self.detail}")


def clean_answer(answer: Any, answer_format: AnswerFormat) -> str:
    """The reference answer as a string: GSM8K's text after ``####``, or the value as is.

    Raises ``TypeError`` for a wrong type and ``ValueError`` for a missing marker or an empty answer
    (the caller turns either into a rejection).
    """
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise TypeError(f"answer must be a string or number, got {type(answer).__name__}")
    text = str(answer)
    if answer_format == "gsm8k":
        if "####" not in text:
            raise ValueError("GSM8K answer has no '#### <number>' line")
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    if not text:
        raise ValueError("empty answer")
    return text


def make_record(
    row: Any, prompt_key: str, answer_key: str, answer_format: AnswerFormat, origin: str
) -> Record | Rejected:
    """Validate one decoded row (a mapping) into a record, or say why not."""
    if not isinstance(row, dict):
        return Rejected("not_object", origin, f"row is a {type(row).__name__}, not an object")
    missing = [k for k in (prompt_key, answer_key) if k not in row]
    if missing:
        return Rejected("missing_field", origin, f"missing {missing}")
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        return Rejected("wrong_type", origin, f"{prompt_key!r} is a {type(prompt).__name__}, not a string")
    if not prompt.strip():
        return Rejected("empty_prompt", origin, f"{prompt_key!r} is empty")
    try:
        answer = clean_answer(row[answer_key], answer_format)
    except TypeError as e:
        return Rejected("wrong_type", origin, f"{answer_key!r}: {e}")
    except ValueError as e:
        return Rejected("bad_answer", origin, f"{answer_key!r}: {e}")
    return {"prompt": prompt, "answer": answer, "id": origin}
