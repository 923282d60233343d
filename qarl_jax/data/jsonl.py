"""JSONL prompt files (GSM8K's ``question``/``answer`` or any ``prompt``/``answer`` form).

The file is read and validated once, at construction: under ``bad_rows="error"`` a bad row stops
the run before the first step (naming file and line), under ``"skip"`` it is counted in
:attr:`JsonlSource.skipped` and never seen again. Rows are read as bytes so bad UTF-8 is a counted
row, not a crash. Blank lines are not rows. The file is local or in a bucket (``gs://BUCKET/...``, through
:func:`qarl_jax.storage.parse`): a pod's hosts read one copy, none needs it on its disk.
"""

from __future__ import annotations

import collections
import json
import logging
import os

from qarl_jax.data.records import AnswerFormat, Record, Rejected, make_record
from qarl_jax.data.synthetic import split_of
from qarl_jax.errors import DataError
from qarl_jax.storage import parse

log = logging.getLogger(__name__)


def parse_line(raw: bytes, origin: str) -> object:
    """One line's JSON value, or a :class:`Rejected` saying why not (bad UTF-8, bad JSON)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejected("bad_utf8", origin, str(e))
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return Rejected("bad_json", origin, str(e))


class JsonlSource:
    """Random-access source over the valid rows of one JSONL file; ids are ``file:line``.

    ``hash_split`` ("train" / "test") keeps only the rows on that side of the content-hash split of
    their prompt text (:func:`qarl_jax.data.synthetic.split_of`); rows that do not parse are
    counted on the training side only. Under ``skip``, fewer than
    ``min_valid_fraction`` of the rows valid is a :class:`DataError` naming file and limit; the
    first skipped row is logged once, with its line."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        prompt_key: str = "question",
        answer_key: str = "answer",
        answer_format: AnswerFormat = "gsm8k",
        bad_rows: str = "skip",
        min_valid_fraction: float = 0.0,
        hash_split: str | None = None,
    ):
        self.path = parse(path, "data file")  # local or gs://
        if not self.path.is_file():
            what = "is a directory, not a JSONL file" if self.path.is_dir() else "does not exist"
            raise DataError(f"data file {self.path} {what}")
        self.skipped: collections.Counter[str] = collections.Counter()
        self.first_skipped: Rejected | None = None
        self._records: list[Record] = []
        rows = 0
        with self.path.open("rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                origin = f"{self.path}:{line_no}"
                row = parse_line(raw, origin)
                if not isinstance(row, Rejected):
                    row = make_record(row, prompt_key, answer_key, answer_format, origin)
                if isinstance(row, Rejected) and hash_split == "test":
                    continue  # a row without a prompt to hash: counted (once) by the training side
                if not isinstance(row, Rejected) and hash_split and split_of(row["prompt"]) != hash_split:
                    continue  # the other side of the split: not a row of this source
                rows += 1
                if isinstance(row, Rejected):
                    if bad_rows == "error":
                        raise row.error()
                    if self.first_skipped is None:
                        self.first_skipped = row
                        log.warning("skipping malformed rows; first: %s", row.error())
                    self.skipped[row.reason] += 1
                    continue
                self._records.append(row)
        side = f" ({hash_split} side of the content-hash split)" if hash_split else ""
        if not self._records:
            raise DataError(f"{self.path}{side}: no valid rows (skipped: {dict(self.skipped)})")
        if len(self._records) < min_valid_fraction * rows:
            assert self.first_skipped is not None, "fewer valid rows than rows: one was skipped"
            raise DataError(
                f"{self.path}: only {len(self._records)} of {rows} rows are valid, below "
                f"data.min_valid_fraction={min_valid_fraction} (skipped: {dict(self.skipped)}; first: "
                f"{self.first_skipped.error()})"
            )

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> Record:
        return self._records[index]
