"""The grain prompt pipeline: source -> host shard -> shuffle -> epochs -> template + tokenise -> batches.

Everything up to tokenisation is a random-access grain ``MapDataset``, so the position in the stream
is one integer and restoring it replays exactly the same records. :class:`PromptIterator` adds what
grain does not: skipping (and counting) rejected rows and over-long prompts, and grouping ``n``
samples per prompt into RL batches. Its state is a small JSON-serialisable dict for the trainer's
checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from qarl_jax.data.config import DataConfig
from qarl_jax.data.jsonl import JsonlSource
from qarl_jax.data.records import CATEGORIES, Record, Rejected, category, is_answer_format
from qarl_jax.data.synthetic import SyntheticArithmetic
from qarl_jax.data.templates import apply_template
from qarl_jax.errors import DataError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import grain

STATE_VERSION = 1


def make_source(config: DataConfig) -> Any:
    """The random-access record source ``config`` names (TFDS is imported only here, lazily)."""
    if config.source == "synthetic":
        return SyntheticArithmetic(config.synthetic, config.seed, config.split)
    answer_format = config.answer_format
    assert is_answer_format(answer_format), "DataConfig checks answer_format"
    if config.source == "jsonl":
        assert config.path is not None, "DataConfig checks that source='jsonl' has a path"
        return JsonlSource(
            config.path,
            config.prompt_key,
            config.answer_key,
            answer_format,
            bad_rows=config.bad_rows,
            min_valid_fraction=config.min_valid_fraction,
            hash_split=config.hash_split,
        )
    from qarl_jax.data.tfds_source import tfds_source

    assert config.tfds_name is not None, "DataConfig checks that source='tfds' has a tfds_name"
    return tfds_source(
        config.tfds_name,
        config.split,
        config.tfds_data_dir,
        config.prompt_key,
        config.answer_key,
        answer_format,
        gsm8k_dir=config.path,
    )


@dataclasses.dataclass(frozen=True)
class _Tokenise:
    """Template + tokenise one record; an over-long prompt becomes a rejection (grain map function)."""

    tokenizer: Tokenizer
    template: str
    max_prompt_tokens: int

    def __call__(self, record: Record | Rejected) -> Record | Rejected:
        if isinstance(record, Rejected):
            return record
        text = apply_template(self.template, record["prompt"])
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) > self.max_prompt_tokens:
            detail = f"prompt has {len(ids)} tokens > max_prompt_tokens={self.max_prompt_tokens}"
            return Rejected("too_long", record["id"], detail)
        return {**record, "text": text, "prompt_ids": np.asarray(ids, np.int32)}


def build_dataset(
    config: DataConfig, source: Any, tokenizer: Tokenizer, shard_index: int = 0, shard_count: int = 1
) -> grain.MapDataset:
    """Records of this host's shard, shuffled (reshuffled each epoch), repeated, tokenised."""
    import grain  # here, not at the top: the model, engine and config import this package without it

    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
    ds = grain.MapDataset.source(source)[shard_index::shard_count]
    if len(ds) == 0:
        raise ValueError(f"shard {shard_index}/{shard_count} of a {len(source)}-row source is empty")
    if config.shuffle:
        ds = ds.shuffle(seed=config.seed)
    ds = ds.repeat(config.num_epochs)
    return ds.map(_Tokenise(tokenizer, config.template, config.max_prompt_tokens))


class PromptIterator:
    """Batches of ``batch_size`` prompts, each repeated ``samples_per_prompt`` times (a GRPO group).

    A batch is a dict of per-sample lists: ``prompt_ids`` (int32 arrays), ``text`` (templated prompt),
    ``prompt``, ``answer``, ``id``, and ``group`` (int32, the prompt's index within the batch). With
    finite epochs the last batch may be short. Rejected rows are counted in :attr:`skipped` (or raise,
    under ``bad_rows="error"``); a source's load-time skips are in :meth:`stats`.
    """

    def __init__(self, config: DataConfig, dataset: grain.MapDataset, epoch_size: int, source: Any = None):
        self._config = config
        self._iter = iter(dataset)
        self._epoch_size = epoch_size
        self._source = source
        self.name = str(getattr(source, "path", None) or config.source)  # for messages
        self.skipped: collections.Counter[str] = collections.Counter()
        self._seen = 0  # rows drawn (valid or not), for min_valid_fraction
        self._first_logged = False

    def __iter__(self) -> PromptIterator:
        return self

    def _next_record(self) -> Record | None:
        for run, item in enumerate(self._iter, start=1):
            self._seen += 1
            if not isinstance(item, Rejected):
                return item
            if self._config.bad_rows == "error":
                raise item.error()
            self.skipped[item.reason] += 1
            if not self._first_logged:
                self._first_logged = True
                log.warning("%s: skipping rows; first: %s", self.name, item.error())
            if run >= 2 * self._epoch_size:  # then a whole epoch was rejected: repeating would spin
                raise DataError(
                    f"{self.name}: a whole epoch of rows was rejected (skipped: {dict(self.skipped)}; "
                    f"data.max_prompt_tokens={self._config.max_prompt_tokens})"
                )
            self._check_fraction()
        return None

    def _check_fraction(self) -> None:
        """After a whole epoch has been drawn: too few usable rows is an error naming the limit."""
        skipped, limit = sum(self.skipped.values()), self._config.min_valid_fraction
        if self._seen >= self._epoch_size and self._seen - skipped < limit * self._seen:
            raise DataError(
                f"{self.name}: {skipped} of the {self._seen} rows drawn were skipped "
                f"({dict(self.skipped)}), leaving fewer than data.min_valid_fraction={limit} "
                f"(data.max_prompt_tokens={self._config.max_prompt_tokens})"
            )

    def __next__(self) -> dict[str, Any]:
        records: list[Record] = []
        while len(records) < self._config.batch_size and (record := self._next_record()) is not None:
            records.append(record)
        if not records:
            raise StopIteration
        n = self._config.samples_per_prompt
        batch: dict[str, Any] = {
            key: [r[key] for r in records for _ in range(n)]
            for key in ("prompt_ids", "text", "prompt", "answer", "id")
        }
        batch["group"] = np.repeat(np.arange(len(records), dtype=np.int32), n)
        return batch

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable position (grain's) plus skip counts, taken between batches."""
        state = {"version": STATE_VERSION, "grain": self._iter.get_state(), "skipped": dict(self.skipped)}
        return state | {"seen": self._seen}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"iterator state version {state.get('version')!r} != {STATE_VERSION}")
        self._iter.set_state(state["grain"])
        self.skipped = collections.Counter(state["skipped"])
        self._seen = state.get("seen", 0)

    def stats(self) -> dict[str, int]:
        """Rows skipped so far: at source load (whole file) and while iterating (this shard)."""
        counts = collections.Counter(getattr(self._source, "skipped", {}))
        counts.update(self.skipped)
        return dict(counts)

    def skipped_by_category(self) -> dict[str, int]:
        """:meth:`stats` summed into the metrics' categories (every one present, zeros included)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for reason, n in self.stats().items():
            out[category(reason)] += n
        return out

    def check_start(self, dataset: grain.MapDataset, rows: int = 64) -> None:
        """Before any work: a :class:`DataError` when none of the first ``rows`` records of the
        stream (at most an epoch) is usable (all too long, say), naming the source and the limit."""
        first = [dataset[i] for i in range(min(rows, self._epoch_size))]
        if first and all(isinstance(r, Rejected) for r in first):
            reasons = dict(collections.Counter(r.reason for r in first))
            which = "a whole epoch of rows was" if len(first) == self._epoch_size else "the first rows were"
            raise DataError(
                f"{self.name}: {which} rejected ({len(first)} rows: {reasons}; first: "
                f"{first[0].error()}; data.max_prompt_tokens={self._config.max_prompt_tokens})"
            )


def build_pipeline(
    config: DataConfig, tokenizer: Tokenizer, shard_index: int = 0, shard_count: int = 1
) -> PromptIterator:
    """The prompt iterator for one host: pass ``jax.process_index()``/``jax.process_count()``."""
    source = make_source(config)
    dataset = build_dataset(config, source, tokenizer, shard_index, shard_count)
    epoch_size = len(range(shard_index, len(source), shard_count))
    iterator = PromptIterator(config, dataset, epoch_size, source)
    iterator.check_start(dataset)
    return iterator
