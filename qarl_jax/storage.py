"""Every path a user gives, local or in a GCS bucket, as one type: etils' ``epath.Path``.

``run.output_dir``, ``--export-hf``, ``--export-compressed-tensors``, ``--out`` and the checkpoint
arguments of ``verify_checkpoint``, ``evaluate``, ``serve`` and ``tools.export`` all go through
:func:`parse`: a local path or ``gs://BUCKET/...``, the same code for both. Why epath: orbax takes
it natively (its CheckpointManager writes ``gs://`` through TensorStore), MaxText and Tunix use it,
and it is pathlib's API, so the code reads the same for a disk and a bucket.

The backend is pinned here, once, as defaults (a variable you set yourself wins): ``gs://`` goes
through fsspec/gcsfs. etils' own default, TensorFlow's gfile whenever TensorFlow is importable (it
is: tensorflow-datasets), ignores ``STORAGE_EMULATOR_HOST`` (so it cannot be tested against a local
GCS server) and imports TensorFlow on the first path operation. gcsfs' experimental
``ExtendedGcsFileSystem`` first asks the Storage Control gRPC API for each bucket's layout (zonal
or hierarchical), which the JSON API does not serve and which logs a warning per call without it,
so the plain JSON-API ``GCSFileSystem`` is used. Listings are not cached: every host writes into
one bucket, and a cached listing would hide another host's checkpoint or lock.

A real bucket needs credentials only (Application Default Credentials: the TPU VM's service
account, or ``gcloud auth application-default login``). Tests point everything at a local
fake-gcs-server with the standard variables alone: ``STORAGE_EMULATOR_HOST`` (gcsfs),
``TENSORSTORE_GCS_HTTP_URL`` and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (TensorStore, i.e. orbax).

A URL of any other scheme (``s3://``, ``http://``), or a ``gs://`` URL that lost a slash on the way
(``gs:/bucket``: what pathlib makes of one), is refused in one line: never a local directory
named ``s3:`` or ``gs:``.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator

os.environ.setdefault("EPATH_USE_TF", "false")  # read at etils' first gs:// operation
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read when gcsfs is imported

import fsspec  # noqa: E402
from etils import epath  # noqa: E402

from qarl_jax.errors import ConfigError  # noqa: E402

fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)

Path = epath.Path
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")  # two letters at least: never a drive letter


def parse(value: str | os.PathLike, what: str) -> epath.Path:
    """``value`` as a path, or a :class:`ConfigError` naming ``what`` (the key or option) when it is
    a URL this project cannot write (see the module docstring)."""
    text = os.fspath(value)
    match = _SCHEME.match(text)
    if match:
        scheme = match.group(1)
        if scheme.lower() != "gs" or not text.startswith("gs://"):
            shown = f"{scheme}://" if text[len(scheme) :].startswith("://") else f"{scheme}:/"
            raise ConfigError(
                f"{what} {text}: {shown} is not a storage this project reads or writes (a local path, "
                "or gs://BUCKET/...)"
            )
        if not text[len("gs://") :].split("/")[0]:
            raise ConfigError(f"{what} {text}: no bucket name (gs://BUCKET/...)")
        return epath.Path(text)
    return epath.Path(os.path.expanduser(text))


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is in a bucket (no local directory, no ``flock``, objects immutable)."""
    return os.fspath(path).startswith("gs://")


def absolute(path: epath.Path) -> epath.Path:
    """A local path made absolute; a bucket's as it is (``absolute()`` would prepend the working
    directory to its ``/gs/...`` form)."""
    return path if is_remote(path) else epath.Path(os.path.abspath(path))


def upload_tree(local: str, remote: epath.Path) -> None:
    """Copy every file under the local directory ``local`` to ``remote``, keeping relative paths."""
    for root, _, files in os.walk(local):
        for name in files:
            source = os.path.join(root, name)
            target = remote / os.path.relpath(source, local)
            target.parent.mkdir(parents=True, exist_ok=True)
            epath.Path(source).copy(target, overwrite=True)


def download_tree(remote: epath.Path, local: epath.Path) -> None:
    """Copy every object under ``remote`` (a bucket directory) to the local directory ``local``,
    keeping relative paths (:func:`upload_tree`'s inverse)."""
    fs, root = fsspec.core.url_to_fs(os.fspath(remote))
    for key in fs.find(root):
        target = local / os.path.relpath(key, root)
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(key, os.fspath(target))


def move(source: epath.Path, target: epath.Path) -> None:
    """Move a file or a directory tree to ``target``. In a bucket object by object through gcsfs
    (copy, then delete): a bucket has no folders, and epath's ``rename`` refuses a target whose
    parent "folder" holds no object yet (measured: moving a damaged checkpoint aside failed so)."""
    if is_remote(source):
        fsspec.filesystem("gcs").mv(os.fspath(source), os.fspath(target), recursive=True)
    else:
        source.rename(target)


@contextlib.contextmanager
def staged(out: epath.Path) -> Iterator[epath.Path]:
    """A local directory to write ``out``'s files into: ``out`` itself when it is local; for a
    bucket a temporary directory uploaded to ``out`` when the block ends without an error (the
    writers of Hugging Face and compressed-tensors files write local files: safetensors, the
    tokenizer's own ``save``)."""
    if not is_remote(out):
        yield out
        return
    with tempfile.TemporaryDirectory(prefix="qarl-upload-") as local:
        yield epath.Path(local)
        upload_tree(local, out)
