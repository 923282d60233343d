"""The run directory: one run at a time in it, and nothing in it replaced without being asked.

A run holds ``run.lock`` for its whole life: an exclusive ``flock`` on the file (released by the
kernel when the process dies, however it dies) plus the holder's pid and host written inside, so a
second run on the same directory refuses naming who holds it. A lock file whose lock is free but
whose text names a holder is what a killed run leaves: it is taken over, saying so. A finished run
empties the file.

Before writing anything, the run decides: resume (the directory has a checkpoint; the checkpointer
checks it was written by this config), start (the directory holds no run), or refuse: an earlier
run's logs without a checkpoint are replaced only with ``run.overwrite=true``, since starting at
step 0 would silently overwrite its metrics and mix TensorBoard events of two runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import socket
import sys
from typing import TextIO

from qarl_jax.errors import OutputError, RunDirError

LOCK_FILE = "run.lock"
LOGS = ("metrics.jsonl", "config.json", "tb")  # what a started run leaves besides checkpoints


def say(message: str) -> None:
    """A status line on stderr, at once (progress the user should see, not a log record)."""
    print(f"qarl: {message}", file=sys.stderr, flush=True)


def check_output_dir(path: pathlib.Path) -> None:
    """Fail before any work when ``run.output_dir`` cannot be a run directory: a file is there, a
    part of the path is a file, or the directory (or the nearest existing one above it, where it
    would be created) is not writable. Nothing is created here (see :func:`decide`)."""
    if path.exists() and not path.is_dir():
        raise OutputError(f"run.output_dir {path} exists and is not a directory")
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"run.output_dir {path}: {existing} is a file, so the directory cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"run.output_dir {path}: {existing} is not writable (permission denied)")


class RunLock:
    """The lock of one run directory (see the module docstring); a context manager."""

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


def decide(run_dir: pathlib.Path, latest_step: int | None, overwrite: bool) -> None:
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
        shutil.rmtree(target) if target.is_dir() else target.unlink()
