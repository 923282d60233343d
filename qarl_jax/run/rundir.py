"""The run directory: one run at a time in it, and nothing in it replaced without being asked.

A run holds ``run.lock`` for its whole life: an exclusive ``flock`` on the file (released by the
kernel when the process dies, however it dies) plus the holder's pid and host written inside, so a
second run on the same directory refuses naming who holds it. A lock file whose lock is free but
whose text names a holder is what a killed run leaves: it is taken over, saying so. A finished run
empties the file. A run directory in a bucket (``gs://``) has no ``flock``: :class:`BucketLock`.

Before writing anything, the run decides: resume (the directory has a checkpoint; the checkpointer
checks it was written by this config), start (the directory holds no run), or refuse: an earlier
run's logs without a checkpoint are replaced only with ``run.overwrite=true``, since starting at
step 0 would silently overwrite its metrics and mix TensorBoard events of two runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import socket
import sys
import threading
import time
from typing import Any, TextIO

from etils import epath

from qarl_jax import storage
from qarl_jax.errors import OutputError, RunDirError

LOCK_FILE = "run.lock"
LOGS = ("metrics.jsonl", "config.json", "tb")  # what a started run leaves besides checkpoints


def say(message: str) -> None:
    """A status line on stderr, at once (progress the user should see, not a log record)."""
    print(f"qarl: {message}", file=sys.stderr, flush=True)


def check_output_dir(path: epath.Path) -> None:
    """Fail before any work when ``run.output_dir`` cannot be a run directory: a file is there, a
    part of the path is a file, or the directory (or the nearest existing one above it, where it
    would be created) is not writable; in a bucket: the bucket cannot be read. Nothing is created
    here (see :func:`decide`)."""
    if storage.is_remote(path):
        bucket = epath.Path("gs://" + os.fspath(path)[len("gs://") :].split("/")[0])
        try:
            found = bucket.exists()
            is_object = found and path.exists() and not path.is_dir()
        except Exception as e:  # credentials, permission, network: the client's own words
            raise OutputError(f"run.output_dir {path}: cannot read the bucket ({_first_line(e)})") from e
        if not found:
            raise OutputError(f"run.output_dir {path}: no bucket {bucket} (or no access to it)")
        if is_object:
            raise OutputError(f"run.output_dir {path} exists and is not a directory")
        return
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"run.output_dir {path} exists and is not a directory")
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"run.output_dir {path}: {existing} is a file, so the directory cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"run.output_dir {path}: {existing} is not writable (permission denied)")


def run_lock(run_dir: epath.Path) -> RunLock | BucketLock:
    """The lock of ``run_dir``: a ``flock`` on a disk, a create-only object in a bucket."""
    return BucketLock(run_dir) if storage.is_remote(run_dir) else RunLock(pathlib.Path(run_dir))


class RunLock:
    """The lock of one local run directory (see the module docstring); a context manager."""

    def __init__(self, run_dir: pathlib.Path):
        self.path = run_dir / LOCK_FILE
        self._file: TextIO | None = None

    def __enter__(self) -> RunLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = self.path.open("a+")
        except OSError as e:
            raise RunDirError(f"{self.path.parent}: cannot create the run directory ({e.strerror})") from e
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(f)
            f.close()
            raise RunDirError(
                f"{self.path.parent} is in use by another run ({holder}); wait for it to finish, or "
                "choose another run.output_dir"
            ) from None
        previous = _holder(f)
        if previous != "unknown holder":
            say(f"taking over the lock of a run that is gone ({previous}) in {self.path.parent}")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
            self._file.close()  # closing releases the flock
            self._file = None


def _holder(f) -> str:
    f.seek(0)
    try:
        info = json.loads(f.read() or "null")
        return f"pid {info['pid']} on host {info['host']}"
    except (json.JSONDecodeError, TypeError, KeyError):
        return "unknown holder"


def decide(run_dir: epath.Path, latest_step: int | None, overwrite: bool) -> None:
    """Resume, start or refuse (see the module docstring); with ``overwrite`` the earlier run's
    logs are removed here, before the new run writes its own."""
    if latest_step is not None:
        return
    found = [name for name in LOGS if (run_dir / name).exists()]
    if not found:
        return
    if not overwrite:
        raise RunDirError(
            f"{run_dir} holds an earlier run ({', '.join(found)}) but no checkpoint to resume from; "
            "pass run.overwrite=true to replace it, or choose another run.output_dir"
        )
    say(f"run.overwrite=true: replacing the earlier run in {run_dir} ({', '.join(found)})")
    for name in found:
        target = run_dir / name
        target.rmtree() if target.is_dir() else target.unlink()


HEARTBEAT_S = 30.0  # how often a bucket lock's holder renews it
GONE_AFTER_S = 180.0  # a bucket lock not renewed for this long: its holder is gone


class BucketLock:
    """The lock of a run directory in a bucket, where there is no ``flock``: the object
    ``run.lock``, created only if absent (GCS's precondition ``ifGenerationMatch=0``), holding the
    holder's pid, host and start time. The holder renews it every :data:`HEARTBEAT_S` seconds (each
    rewrite conditional on its own last generation), so its update time says the run is alive, and
    deletes it when the run ends.

    Today's takeover rule, for a holder that is gone: a local lock is taken over when its flock is
    free; here, when the holder ran on this host and its pid is no longer running, or when its lock
    has not been renewed for :data:`GONE_AFTER_S` seconds (a preempted TPU VM leaves its lock
    behind, and the rerun may start on a new VM). The takeover rewrite is conditional on the
    generation read, so of two runs taking over at once one wins and the other refuses. The
    objects go through google-cloud-storage (a dependency of gcsfs), whose preconditions are
    typed arguments and errors."""

    def __init__(self, run_dir: epath.Path):
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        self._blob: Any = None  # google.cloud.storage.Blob, imported with the first bucket lock
        self._stop = threading.Event()
        self._renewals: threading.Thread | None = None

    def __enter__(self) -> BucketLock:
        from google.api_core import exceptions

        bucket, _, name = os.fspath(self.path)[len("gs://") :].partition("/")
        try:
            from google.cloud import storage as gcs

            self._blob = blob = gcs.Client().bucket(bucket).blob(name)
            try:
                blob.upload_from_string(self._text, if_generation_match=0)
            except exceptions.PreconditionFailed:
                self._take_over(blob.bucket, name)
        except RunDirError:
            raise
        except Exception as e:  # credentials, permission, network: the client's own words
            raise RunDirError(f"{self.path}: cannot take the run lock ({_first_line(e)})") from e
        self._renewals = threading.Thread(target=self._renew, name="qarl-run-lock", daemon=True)
        self._renewals.start()
        return self

    def _take_over(self, bucket, name: str) -> None:
        from google.api_core import exceptions

        held = bucket.get_blob(name)
        if held is None:  # released since: create it again
            self._blob.upload_from_string(self._text, if_generation_match=0)
            return
        holder, pid, host = _holder_of(held.download_as_text())
        age = time.time() - held.updated.timestamp()
        if not _gone(pid, host, age):
            raise RunDirError(
                f"{self.run_dir} is in use by another run ({holder}, its lock renewed {age:.0f} s ago); "
                f"wait for it to finish, or choose another run.output_dir (a lock not renewed for "
                f"{GONE_AFTER_S:.0f} s is taken over)"
            )
        try:
            self._blob.upload_from_string(self._text, if_generation_match=held.generation)
        except exceptions.PreconditionFailed:
            taken = f"{self.run_dir}: another run took over the lock first ({holder} was gone)"
            raise RunDirError(taken) from None
        say(f"taking over the lock of a run that is gone ({holder}) in {self.run_dir}")

    def _renew(self) -> None:
        from google.api_core import exceptions

        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._blob.upload_from_string(self._text, if_generation_match=self._blob.generation)
            except exceptions.PreconditionFailed:
                say(f"the run lock of {self.run_dir} was taken over by another run; this run lost it")
                return
            except Exception as e:  # a network hiccup: the next renewal tries again
                say(f"could not renew the run lock of {self.run_dir} ({_first_line(e)})")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._renewals is not None:
            self._renewals.join()
            with contextlib.suppress(Exception):  # taken over, or gone: nothing of ours to delete
                self._blob.delete(if_generation_match=self._blob.generation)
            self._renewals = None


def _holder_of(text: str) -> tuple[str, int | None, str | None]:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']}", int(info["pid"]), str(info["host"])
    except (json.JSONDecodeError, TypeError, KeyError, ValueError):
        return "unknown holder", None, None


def _gone(pid: int | None, host: str | None, age: float) -> bool:
    """Whether a bucket lock's holder is gone (see :class:`BucketLock`)."""
    if host == socket.gethostname() and pid is not None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # running, as another user
            return False
        return False
    return age > GONE_AFTER_S


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
