"""Plain dataclasses for the prompt pipeline; the trainer's YAML config nests them.

Validation runs on construction and names the offending field, so a typo fails at start-up rather
than when the first batch is drawn.
"""

from __future__ import annotations

import dataclasses

SOURCES = ("synthetic", "jsonl", "tfds")
TEMPLATES = ("plain", "qwen3_chat")
BAD_ROW_POLICIES = ("skip", "error")
ANSWER_FORMATS = ("gsm8k", "plain")
SYNTHETIC_OPS = "+-*"


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


def _check_choice(value: object, field: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, field, f"must be one of {choices}, got {value!r}")


def _check_int(value: object, field: str, minimum: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    _check(ok, field, f"must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """Multi-step integer arithmetic: ``steps`` operations on operands of up to ``digits`` digits.

    The reference solution has one line per step, so ``steps`` also sets the response length a model
    needs; ``size`` is the number of distinct problems (record ``i`` depends only on seed and ``i``).
    """

    digits: int = 2
    steps: int = 2
    ops: str = "+-"
    size: int = 100_000

    def __post_init__(self) -> None:
        _check_int(self.digits, "synthetic.digits", 1)
        _check(self.digits <= 18, "synthetic.digits", f"must be <= 18, got {self.digits}")
        _check_int(self.steps, "synthetic.steps", 1)
        _check_int(self.size, "synthetic.size", 1)
        ok = isinstance(self.ops, str) and bool(self.ops) and set(self.ops) <= set(SYNTHETIC_OPS)
        _check(ok, "synthetic.ops", f"must be a non-empty subset of {SYNTHETIC_OPS!r}, got {self.ops!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are shuffled, templated, tokenised and batched.

    ``path`` is the JSONL file (source ``jsonl``) or, for ``tfds_name="gsm8k_local"``, the folder of
    GSM8K JSONL files the offline builder prepares from. ``prompt_key``/``answer_key`` name the row
    fields (GSM8K: ``question``/``answer``; generic files: e.g. ``prompt``/``answer``);
    ``answer_format="gsm8k"`` keeps what follows ``####``. ``num_epochs=None`` repeats forever.
    ``split`` is the TFDS split, or the synthetic source's ``train``/``test`` half. ``bad_rows``
    (``skip`` counts, ``error`` raises) applies to malformed rows and to prompts longer than
    ``max_prompt_tokens``; under ``skip`` a source with fewer than ``min_valid_fraction`` of its
    rows usable is an error naming the file and the limit. A JSONL file has no test split: the
    trainer evaluates on ``eval_path``, or splits ``path`` by a hash of each prompt's text
    (``hash_split``, as the synthetic task splits its problems), so evals never see training rows.
    """

    source: str = "synthetic"  # one of SOURCES (plain str so YAML configs nest it)
    path: str | None = None
    tfds_name: str | None = None
    tfds_data_dir: str | None = None
    split: str = "train"
    prompt_key: str = "question"
    answer_key: str = "answer"
    answer_format: str = "gsm8k"
    template: str = "plain"
    max_prompt_tokens: int = 512
    batch_size: int = 8
    samples_per_prompt: int = 1
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    bad_rows: str = "skip"
    min_valid_fraction: float = 0.1  # stop when fewer of a source's rows are usable (names file, limit)
    eval_path: str | None = None  # JSONL: the held-out file (else a content-hash split of `path`)
    hash_split: str | None = None  # JSONL: "train"/"test" keeps one side of the content-hash split
    synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)

    def __post_init__(self) -> None:
        _check_choice(self.source, "source", SOURCES)
        _check_choice(self.template, "template", TEMPLATES)
        _check_choice(self.bad_rows, "bad_rows", BAD_ROW_POLICIES)
        _check_choice(self.answer_format, "answer_format", ANSWER_FORMATS)
        _check_int(self.max_prompt_tokens, "max_prompt_tokens", 1)
        _check_int(self.batch_size, "batch_size", 1)
        _check_int(self.samples_per_prompt, "samples_per_prompt", 1)
        _check_int(self.seed, "seed", 0)
        ok = isinstance(self.min_valid_fraction, int | float) and 0 <= self.min_valid_fraction <= 1
        _check(ok, "min_valid_fraction", f"must be in [0, 1], got {self.min_valid_fraction!r}")
        if self.hash_split is not None:
            _check_choice(self.hash_split, "hash_split", ("train", "test"))
        _check(isinstance(self.shuffle, bool), "shuffle", f"must be a bool, got {self.shuffle!r}")
        if self.num_epochs is not None:
            _check_int(self.num_epochs, "num_epochs", 1)
        _check(isinstance(self.synthetic, SyntheticConfig), "synthetic", "must be a SyntheticConfig")
        for field in ("prompt_key", "answer_key", "split"):
            value = getattr(self, field)
            _check(isinstance(value, str) and bool(value), field, f"must be non-empty text, got {value!r}")
        if self.source == "synthetic":
            _check_choice(self.split, "split", ("train", "test"))
        if self.source == "jsonl":
            _check(bool(self.path), "path", "source='jsonl' needs the path of a JSONL file")
        if self.source == "tfds":
            _check(bool(self.tfds_name), "tfds_name", "source='tfds' needs a TFDS dataset name")
            where = str(self.tfds_data_dir or "")
            _check(
                "://" not in where or where.startswith("gs://"),
                "tfds_data_dir",
                f"must be a local directory or gs://BUCKET/..., got {where!r}",
            )
            if self.tfds_name == "gsm8k_local":
                _check(bool(self.path), "path", "tfds_name='gsm8k_local' needs the folder of GSM8K files")
