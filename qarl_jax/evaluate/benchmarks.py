"""Benchmark files: JSONL rows -> questions, reference answers and the grader that compares them.

A benchmark is named on the command line as ``FILE[:PRESET[:FIELD=KEY,...]]``. The preset says
which fields hold the question, the answer and (multiple choice) the options, how the answer is
written, and which grader of :mod:`qarl_jax.rewards` scores a response; ``FIELD=KEY`` renames a
field (``question=prompt,answer=solution``). FILE is local or ``gs://BUCKET/...``. A preset lists
several names for a field where the published copies of one benchmark differ (AIME 2024 has
``problem``, some AIME 2025 copies ``question``): the first one a row has is used.

Multiple-choice items are rendered as the question followed by one ``A. option`` line per option;
the reference becomes the option's letter, whether the file gives a letter (MMLU-Pro's
``answer``), a 0-based index (``answer_index``) or a label among the options' own labels (ARC's
``choices: {text, label}`` with ``answerKey``, some of whose labels are ``1``..``4``). GPQA's
original layout (``Correct Answer`` and three ``Incorrect Answer N``) has no order: the options
are placed by a permutation drawn from a hash of the question text, the same on every run.

A row that cannot become an item is counted by reason and kept with its ``file:line`` in
:attr:`Benchmark.rejected`: the report names every one, nothing is dropped silently.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
from typing import Any

import numpy as np

from qarl_jax import storage
from qarl_jax.data.jsonl import parse_line
from qarl_jax.data.records import AnswerFormat, Rejected, clean_answer
from qarl_jax.errors import ConfigError, DataError
from qarl_jax.rewards.choice import LETTERS
from qarl_jax.storage import epath

FIELDS = ("question", "answer", "choices")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a row keeps its parts (candidate field names, first present wins) and how to grade."""

    question: tuple[str, ...]
    answer: tuple[str, ...]
    kind: str  # a grader of qarl_jax.rewards.GRADERS
    answer_format: AnswerFormat = "plain"
    choices: tuple[str, ...] = ()  # multiple choice: the field holding the options
    # GPQA: options in these fields, the first the correct one, placed by a hash of the question
    shuffled_options: tuple[str, ...] = ()


MATH = Layout(("problem", "question", "Problem", "Question"), ("answer", "final_answer", "Answer"), "math")
CHOICE = Layout(
    ("question", "Question"),
    ("answer", "answerKey", "answer_index", "label"),
    "choice",
    choices=("choices", "options"),
)
GPQA = Layout(
    ("Question", "question"),
    (),
    "choice",
    shuffled_options=("Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"),
)
# layouts, and the benchmarks of the paper's table by the layout of their usual Hugging Face copies
PRESETS: dict[str, Layout] = {
    "math": MATH,
    "math500": MATH,
    "aime": MATH,
    "amc": MATH,
    "minerva": MATH,
    "olympiadbench": MATH,
    "gsm8k": Layout(("question",), ("answer",), "gsm8k", answer_format="gsm8k"),
    "choice": CHOICE,
    "arc": CHOICE,
    "mmlu_pro": CHOICE,
    "gpqa": GPQA,
}


@dataclasses.dataclass(frozen=True)
class Item:
    """One benchmark question: its ``file:line``, the text the template wraps, the reference."""

    id: str
    question: str
    answer: str


@dataclasses.dataclass
class Benchmark:
    """A benchmark file's items, its grader kind, and the rows that did not become items."""

    name: str
    path: epath.Path
    preset: str
    kind: str
    items: list[Item]
    rejected: list[Rejected]

    @property
    def skipped(self) -> dict[str, int]:
        return dict(collections.Counter(r.reason for r in self.rejected))

    def skipped_line(self) -> str | None:
        """The malformed rows in one line (counts by reason, the first named), or None."""
        if not self.rejected:
            return None
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items()))
        first = self.rejected[0]
        return (
            f"{self.path}: {len(self.rejected)} malformed row(s) not evaluated ({counts}); first: "
            f"{first.origin}: {first.reason}: {first.detail} (every one is listed in the JSON report)"
        )


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")  # a URL's scheme: gs:// (others refused by name)


def parse_spec(spec: str) -> tuple[epath.Path, str, Layout]:
    """``FILE[:PRESET[:FIELD=KEY,...]]`` -> (file, preset name, layout); a bad part is one line.
    FILE is local or ``gs://BUCKET/...`` (:func:`qarl_jax.storage.parse`; a URL's scheme is not a
    FILE:PRESET separator)."""
    scheme = _URL.match(spec)
    head = scheme.group(0) if scheme else ""
    path, _, rest = spec[len(head) :].partition(":")
    name, _, renames = rest.partition(":")
    name = name or "math"
    if name not in PRESETS:
        raise ConfigError(f"--bench {spec}: unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    layout = PRESETS[name]
    for part in filter(None, renames.split(",")):
        field, sep, key = part.partition("=")
        if not sep or field not in FIELDS or not key:
            raise ConfigError(
                f"--bench {spec}: {part!r} is not FIELD=KEY with FIELD one of {', '.join(FIELDS)}"
            )
        if field == "choices" and layout.kind != "choice":
            raise ConfigError(f"--bench {spec}: preset {name!r} is not multiple choice (no choices field)")
        renamed: dict[str, Any] = {field: (key,)}
        layout = dataclasses.replace(layout, **renamed)
    if not path:
        raise ConfigError(f"--bench {spec}: no file named")
    return storage.parse(head + path, "--bench"), name, layout


def _first(row: dict, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in row), None)


def _options(row: dict, layout: Layout, question: str) -> tuple[list[Any], list[str] | None, int | None]:
    """(options, their own labels or None, the correct option's position when the layout fixes it)."""
    if layout.shuffled_options:
        missing = [f for f in layout.shuffled_options if f not in row]
        if missing:
            raise KeyError(f"missing {missing}")
        fields = list(layout.shuffled_options)
        digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
        order = np.random.default_rng(int.from_bytes(digest, "little")).permutation(len(fields))
        return [row[fields[i]] for i in order], None, int(np.flatnonzero(order == 0)[0])
    field = _first(row, layout.choices)
    if field is None:
        raise KeyError(f"missing {list(layout.choices)}")
    options = row[field]
    if isinstance(options, dict) and {"text", "label"} <= set(options):  # ARC
        labels = options["label"]
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise ValueError(f"{field!r}: labels must be a list of strings")
        return options["text"], labels, None
    return options, None, None


def _choice_letter(answer: Any, labels: list[str] | None, count: int) -> str:
    """The reference as the letter of the option it names (a letter, a 0-based index, a label)."""
    if labels is not None and isinstance(answer, str) and answer.strip() in labels:
        return LETTERS[labels.index(answer.strip())]
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < count:
        return LETTERS[answer]
    if isinstance(answer, str) and answer.strip().upper() in LETTERS[:count]:
        return answer.strip().upper()
    raise ValueError(f"{answer!r} names none of the {count} options (a letter, a 0-based index or a label)")


def _item(row: Any, layout: Layout, origin: str) -> Item | Rejected:
    """One decoded row as an item, or why not."""
    if not isinstance(row, dict):
        return Rejected("not_object", origin, f"row is a {type(row).__name__}, not an object")
    q_field = _first(row, layout.question)
    if q_field is None:
        return Rejected("missing_field", origin, f"no question field {list(layout.question)}")
    question = row[q_field]
    if not isinstance(question, str) or not question.strip():
        return Rejected("bad_question", origin, f"{q_field!r} is not a non-empty string")
    if layout.kind == "choice":
        try:
            options, labels, correct = _options(row, layout, question)
        except (KeyError, ValueError) as e:
            return Rejected("bad_choices", origin, str(e).strip("'\""))
        texts = isinstance(options, list) and all(isinstance(o, str | int | float) for o in options)
        if not (texts and 2 <= len(options) <= len(LETTERS)):
            detail = f"expected a list of 2-{len(LETTERS)} options, got {options!r}"
            return Rejected("bad_choices", origin, detail[:200])
        if correct is not None:
            answer = LETTERS[correct]
        else:
            a_field = _first(row, layout.answer)
            if a_field is None:
                return Rejected("missing_field", origin, f"no answer field {list(layout.answer)}")
            try:
                answer = _choice_letter(row[a_field], labels, len(options))
            except ValueError as e:
                return Rejected("bad_answer", origin, f"{a_field!r}: {e}")
        lines = [f"{LETTERS[i]}. {o}" for i, o in enumerate(options)]
        return Item(origin, question.strip() + "\n\n" + "\n".join(lines), answer)
    a_field = _first(row, layout.answer)
    if a_field is None:
        return Rejected("missing_field", origin, f"no answer field {list(layout.answer)}")
    value = row[a_field]
    if isinstance(value, list):  # OlympiadBench's final_answer: a list of one answer
        if len(value) != 1:
            return Rejected("bad_answer", origin, f"{a_field!r} holds {len(value)} answers; one is graded")
        value = value[0]
    try:
        answer = clean_answer(value, layout.answer_format)
    except (TypeError, ValueError) as e:
        return Rejected("bad_answer", origin, f"{a_field!r}: {e}")
    return Item(origin, question, answer)


def read_benchmark(spec: str, strict: bool = False) -> Benchmark:
    """The benchmark ``spec`` names (see :func:`parse_spec`); with ``strict`` the first malformed
    row is an error. A file with no item, or whose rows all lack a field, is one line naming it."""
    path, preset, layout = parse_spec(spec)
    if not path.is_file():
        what = "is a directory, not a JSONL file" if path.is_dir() else "does not exist"
        raise DataError(f"benchmark file {path} {what}")
    items: list[Item] = []
    rejected: list[Rejected] = []
    first_keys: list[str] | None = None
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            origin = f"{path}:{line_no}"
            row = parse_line(raw, origin)
            if first_keys is None and isinstance(row, dict):
                first_keys = sorted(row)
            item = row if isinstance(row, Rejected) else _item(row, layout, origin)
            if isinstance(item, Rejected):
                if strict:
                    raise item.error()
                rejected.append(item)
            else:
                items.append(item)
    if not items:
        if rejected and all(r.reason == "missing_field" for r in rejected):
            raise DataError(
                f"{path}: no row has the fields preset {preset!r} reads ({rejected[0].detail}; the first "
                f"row's fields: {first_keys}); name them as {path}:{preset}:question=KEY,answer=KEY"
            )
        why = f"; first: {rejected[0].error()}" if rejected else " (the file is empty)"
        raise DataError(f"{path}: no valid rows{why}")
    return Benchmark(path.stem, path, preset, layout.kind, items, rejected)


def read_benchmarks(specs: list[str], strict: bool = False) -> list[Benchmark]:
    """Every benchmark, read before any model work; two of the same name are refused (the table's
    columns are the file names)."""
    benches = [read_benchmark(s, strict) for s in specs]
    names = collections.Counter(b.name for b in benches)
    twice = [n for n, c in names.items() if c > 1]
    if twice:
        raise ConfigError(
            f"--bench: two benchmark files named {twice[0]!r} (the table's columns are file names)"
        )
    return benches
