"""What a test session builds once and every pytest-xdist worker reads: the first worker to ask
builds it under a file lock in the session's shared temporary directory (the parent of every
worker's own), the others wait on the lock and read what it built. Why: several modules, spread
over both workers, read the same expensive run (a training run, a two-host run) and each built
its own. Imported as a plain module (``import once``)."""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
from collections.abc import Callable

BUILT = ".built"  # written last: a build that died half-way is redone, never read


def built_once(base: pathlib.Path, name: str, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """The directory ``name`` of this session, made by ``build(directory)`` once. ``base`` is this
    process's pytest temporary root; under xdist (``$PYTEST_XDIST_WORKER`` set) its parent is the
    one every worker of the session shares. Callers read it, never write it (copy it first)."""
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or its holder dies)
        out = root / name
        if (out / BUILT).exists():
            return out
        shutil.rmtree(out, ignore_errors=True)  # a build that failed before in this session
        out.mkdir()
        build(out)
        (out / BUILT).touch()
        return out
