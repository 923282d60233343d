"""TFDS sources through ``tfds.data_source`` (array_record, random access), and an offline GSM8K.

The only module that imports tensorflow_datasets; the pipeline imports it when a TFDS source is
configured. TFDS's stock ``gsm8k`` builder downloads four files, one of which (``train_socratic``)
the shared data folder lacks; :class:`Gsm8kLocal` keeps its features and example generator but
prepares whichever splits the local folder has, with no network.

On a pod the dataset is prepared once per run (:func:`prepare_once`): process 0 runs TFDS's
``download_and_prepare`` while the others wait at a JAX barrier; then each other host opens it,
reusing the prepared copy where ``data_dir`` is a shared disk (TFDS finds it prepared and writes
nothing: no race) or preparing its own where ``data_dir`` is the host's own disk. ``data_dir`` is
local (array_record, TFDS's random-access format, reads and writes local files only: a ``gs://``
one is refused by :class:`~qarl_jax.data.DataConfig`); the folder of GSM8K files of
``gsm8k_local`` may be ``gs://``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.text.gsm8k import gsm8k as tfds_gsm8k

from qarl_jax.data.records import AnswerFormat, Record, Rejected, make_record
from qarl_jax.storage import parse

T = TypeVar("T")
PREPARED_BARRIER = "qarl_jax: TFDS dataset prepared"

GSM8K_SPLITS = ("train", "test", "train_socratic", "test_socratic")


class Gsm8kLocal(tfds_gsm8k.Gsm8k):
    """TFDS's ``gsm8k`` (same features: question, answer, annotation, short_answer) from local files."""

    # TFDS 4.9.10 resolves a builder's code path through `importlib_resources`, which it only
    # declares for Python < 3.9; our builder has no checksums or metadata files to find anyway.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    def __init__(self, *, source_dir: str | os.PathLike[str] | None = None, **kwargs: Any):
        # Without `source_dir` (e.g. from `tfds.data_source` by name) it only reads a prepared copy.
        self._source_dir = source_dir
        super().__init__(**kwargs)

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        del dl_manager
        if self._source_dir is None:
            raise ValueError("Gsm8kLocal needs source_dir (the folder of GSM8K JSONL files) to prepare")
        files = {s: parse(self._source_dir, "data.path") / f"{s}.jsonl" for s in GSM8K_SPLITS}
        found = {s: self._generate_examples(p) for s, p in files.items() if p.is_file()}
        if not found:
            raise FileNotFoundError(f"no GSM8K split files ({GSM8K_SPLITS}) in {self._source_dir}")
        return found


def prepare_gsm8k_local(source_dir: str | os.PathLike[str], data_dir: str | os.PathLike[str]) -> Gsm8kLocal:
    """Build (once) the array_record GSM8K dataset under ``data_dir`` from ``source_dir``'s JSONL."""
    builder = Gsm8kLocal(source_dir=source_dir, data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if hasattr(value, "item"):  # numpy scalar
        return _decode(value.item())
    return value


class TfdsSource:
    """Random-access ``{prompt, answer, id}`` view of a TFDS data source; ids are ``name/split:index``.

    Rows are validated lazily (the pipeline counts or raises on :class:`Rejected` values).
    """

    def __init__(
        self,
        data_source: Any,
        name: str,
        split: str,
        prompt_key: str,
        answer_key: str,
        answer_format: AnswerFormat,
    ):
        self._data = data_source
        self._origin = f"{name}/{split}"
        self._keys = (prompt_key, answer_key, answer_format)

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int) -> Record | Rejected:
        origin = f"{self._origin}:{index}"
        try:
            row = {k: _decode(v) for k, v in self._data[index].items()}
        except UnicodeDecodeError as e:
            return Rejected("bad_utf8", origin, str(e))
        return make_record(row, *self._keys, origin)


def prepare_once(prepare: Callable[[], T]) -> T:
    """``prepare()`` (download and prepare if needed, then open) on one process; with several,
    process 0 runs it first while the others wait at a barrier (``sync_global_devices``,
    collective), then the others run it (a prepared copy is reused, not rewritten). Should process 0
    fail, it exits and JAX's coordination service ends the waiting processes."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return prepare()
    if jax.process_index() == 0:
        out = prepare()
        multihost_utils.sync_global_devices(PREPARED_BARRIER)
        return out
    multihost_utils.sync_global_devices(PREPARED_BARRIER)
    return prepare()


def tfds_source(
    name: str,
    split: str,
    data_dir: str | None,
    prompt_key: str,
    answer_key: str,
    answer_format: AnswerFormat,
    gsm8k_dir: str | None = None,
) -> TfdsSource:
    """``tfds.data_source(name, split)``, process 0 preparing first (:func:`prepare_once`);
    ``name="gsm8k_local"`` prepares from ``gsm8k_dir`` (local or ``gs://``) first."""
    if data_dir is not None:
        data_dir = os.fspath(parse(data_dir, "data.tfds_data_dir"))  # another scheme: one line
    if name == "gsm8k_local" and gsm8k_dir is None:
        raise ValueError("path: tfds_name='gsm8k_local' needs the folder of GSM8K files")

    def prepare() -> Any:
        if name == "gsm8k_local":
            prepare_gsm8k_local(gsm8k_dir, data_dir or tfds.core.constants.DATA_DIR)  # type: ignore[arg-type]
        return tfds.data_source(name, split=split, data_dir=data_dir)

    data = prepare_once(prepare)
    return TfdsSource(data, name, split, prompt_key, answer_key, answer_format)
