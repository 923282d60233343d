"""TFDS sources through ``tfds.data_source`` (array_record, random access), and an offline GSM8K.

The only module that imports tensorflow_datasets; the pipeline imports it when a TFDS source is
configured. TFDS's stock ``gsm8k`` builder downloads four files, one of which (``train_socratic``)
the shared data folder lacks; :class:`Gsm8kLocal` keeps its features and example generator but
prepares whichever splits the local folder has, with no network.

On a pod the dataset is prepared once per run: process 0 runs TFDS's ``download_and_prepare``
while the others wait at a JAX barrier (:func:`prepare_once`). ``data_dir`` may be:

- a local directory: each other host then opens it after the barrier, reusing the prepared copy
  where it is a shared disk (TFDS finds it prepared and writes nothing: no race) or preparing its
  own where it is the host's own disk;
- ``gs://BUCKET/...`` (:func:`open_from_bucket`): array_record, TFDS's random-access format, reads
  and writes local files only (its pip build has no ``gs://``), so TFDS works on a local mirror of
  the bucket's directory (under TFDS's local data dir, ``$TFDS_DATA_DIR``). Process 0 prepares
  into its mirror, unless the bucket holds the dataset already, and uploads the prepared version
  directory (``dataset_info.json`` last: the bucket's copy is complete once it is there); after
  the barrier every host downloads that one copy into its own mirror, unless there already, and
  reads it from its disk. The data is prepared once for the whole pod and for every later run.

The folder of GSM8K files of ``gsm8k_local`` may be ``gs://`` too.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.text.gsm8k import gsm8k as tfds_gsm8k

from qarl_jax.data.records import AnswerFormat, Record, Rejected, make_record
from qarl_jax.storage import download_tree, is_remote, parse

T = TypeVar("T")
PREPARED_BARRIER = "qarl_jax: TFDS dataset prepared"
INFO = "dataset_info.json"  # TFDS writes it when a dataset is prepared; uploaded last to a bucket

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
    """``tfds.data_source(name, split)``, process 0 preparing first (:func:`prepare_once`, or
    :func:`open_from_bucket` for a ``gs://`` ``data_dir``); ``name="gsm8k_local"`` prepares from
    ``gsm8k_dir`` (local or ``gs://``) first."""
    if data_dir is not None:
        data_dir = os.fspath(parse(data_dir, "data.tfds_data_dir"))  # another scheme: one line
    if name == "gsm8k_local" and gsm8k_dir is None:
        raise ValueError("path: tfds_name='gsm8k_local' needs the folder of GSM8K files")

    def prepare(local_dir: str | None) -> None:
        if name == "gsm8k_local":
            prepare_gsm8k_local(gsm8k_dir, local_dir or tfds.core.constants.DATA_DIR)  # type: ignore[arg-type]
        else:
            tfds.builder(name, data_dir=local_dir).download_and_prepare()

    def open_(local_dir: str | None) -> Any:
        return tfds.data_source(name, split=split, data_dir=local_dir)

    def prepare_and_open() -> Any:
        prepare(data_dir)
        return open_(data_dir)

    if data_dir is not None and is_remote(data_dir):
        data = open_from_bucket(name, data_dir, prepare, open_)
    else:
        data = prepare_once(prepare_and_open)
    return TfdsSource(data, name, split, prompt_key, answer_key, answer_format)


def local_mirror(bucket_dir: str) -> epath.Path:
    """Where this host keeps its copy of the bucket directory ``bucket_dir`` (``gs://B/P``):
    ``$TFDS_DATA_DIR/gs/B/P`` (TFDS's local data dir, ``~/tensorflow_datasets`` by default)."""
    return epath.Path(tfds.core.constants.DATA_DIR).expanduser() / "gs" / bucket_dir.removeprefix("gs://")


def open_from_bucket(
    name: str, bucket_dir: str, prepare: Callable[[str], None], open_: Callable[[str], T]
) -> T:
    """The dataset ``name`` of the bucket directory ``bucket_dir``, read from this host's
    :func:`local_mirror` (module docstring): process 0 runs ``prepare(mirror)`` and uploads the
    prepared version directory unless the bucket holds it, the others wait for it at the barrier,
    then every host downloads it unless its mirror has it and returns ``open_(mirror)``."""
    import jax
    from jax.experimental import multihost_utils

    mirror = local_mirror(bucket_dir)
    version = os.path.relpath(tfds.builder(name, data_dir=os.fspath(mirror)).data_dir, mirror)
    remote, local = epath.Path(bucket_dir) / version, mirror / version
    if jax.process_index() == 0 and not (remote / INFO).exists():
        if not (local / INFO).exists():
            prepare(os.fspath(mirror))
        files = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
        for f in sorted(files, key=lambda f: f == INFO):  # dataset_info.json last: then complete
            (remote / f).parent.mkdir(parents=True, exist_ok=True)
            (local / f).copy(remote / f, overwrite=True)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(PREPARED_BARRIER)
    if not (local / INFO).exists():
        if not (remote / INFO).exists():
            raise FileNotFoundError(f"{remote}: no prepared {name} dataset (process 0 prepares it)")
        part = local.with_name(local.name + ".part")  # renamed when whole: a mirror is complete
        if part.exists():
            shutil.rmtree(part)
        download_tree(remote, part)
        part.rename(local)
    return open_(os.fspath(mirror))
