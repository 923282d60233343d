"""JSONL prompt files (GSM8K's ``question``/``answer`` or any ``prompt``/``answer`` form).

The file is read and validated once, at construction: under ``bad_rows="error"`` a bad row stops
the run before the first step (naming file and line), under ``"skip"`` it is counted in
:attr:`JsonlSource.skipped` and never seen again. Rows are read as bytes so bad UTF-8 is a counted
row, not a crash. Blank lines are not rows.
"""

from __future__ import annotations

import collections
import json
import logging
import pathlib

from qarl_jax.data.records import AnswerFormat, Record, Rejected, make_record

log = logging.getLogger(__name__)


def _parse_line(raw: bytes, origin: str) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejected("bad_utf8", origin, str(e))
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return Rejected("bad_json", origin, str(e))


class JsonlSource:
    """Random-access source over the valid rows of one JSONL file; ids are ``file:line``."""

    def __init__(
        self,
        path: str | pathlib.Path,
        prompt_key: str = "question",
        answer_key: str = "answer",
        answer_format: AnswerFormat = "gsm8k",
        bad_rows: str = "skip",
    ):
        self.path = pathlib.Path(path)
        self.skipped: collections.Counter[str] = collections.Counter()
        self._records: list[Record] = []
        with self.path.open("rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                origin = f"{self.path}:{line_no}"
                row = _parse_line(raw, origin)
                if not isinstance(row, Rejected):
                    row = make_record(row, prompt_key, answer_key, answer_format, origin)
                if isinstance(row, Rejected):
                    if bad_rows == "error":
                        raise row.error()
                    if not self.skipped:
                        log.warning("skipping malformed rows; first: %s", row.error())
                    self.skipped[row.reason] += 1
                    continue
                self._records.append(row)
        if not self._records:
            raise ValueError(f"{self.path}: no valid rows (skipped: {dict(self.skipped)})")

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> Record:
        return self._records[index]
