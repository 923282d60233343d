"""glibc malloc thresholds that keep XLA:CPU's per-call temporaries in the heap.

Why: an XLA:CPU executable allocates its temporaries afresh on every call, as a few large blocks
(the default run's update: ~60 MB a call). glibc serves a block above its mmap threshold (dynamic,
never above 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` on free, so every call
faults all of its pages in again. Measured on the default run's update (16 x 48 tokens, 2 cores):
15,550 minor page faults and 30-42 ms of system time a call; with the tunables below, 3-7,800
faults and 0.4-16 ms, and the update 10-29% faster (``benchmarks/heap.py``). Over the whole
default run the saved system CPU (33-37 s) is partly spent again as user CPU (reused pages are cold
in cache): no wall gain beyond a drifting machine's noise there (``benchmarks/RESULTS.md``).

glibc takes a threshold above 32 MiB only from ``GLIBC_TUNABLES``, which it reads when the process
starts: the CLI re-executes itself once with them set (:func:`reexec_with_tunables`), and the test
suite sets them for its worker processes and the commands they run. The cost: up to
``TRIM_THRESHOLD`` of freed memory stays with the process instead of returning to the system.
Not set: ``arena_max=1``, which would also keep the blocks that XLA's worker threads allocate
(their own arenas are heaps of at most 64 MiB, unmapped once empty), but made the whole default
run ~30% slower through the threads' contention for one arena. A ``GLIBC_TUNABLES`` that already
sets any ``glibc.malloc`` tunable is left as it is (the user's choice wins); elsewhere than on Linux
with glibc nothing changes.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap (XLA's temporaries)
TRIM_THRESHOLD = 512 << 20  # freed memory kept before the heap's top is returned to the system
TUNABLES = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"


def on_glibc() -> bool:
    """Whether this process runs on Linux with glibc (the only place the tunables mean anything)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def tuned_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """``environ`` with the malloc tunables added to ``GLIBC_TUNABLES``; None where nothing is to
    change (not glibc, or a malloc tunable already set)."""
    if not on_glibc():
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in current:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, (current, TUNABLES)))}


def reexec_with_tunables() -> None:
    """Replace this process by the same command with the thresholds set (same PID, arguments and
    environment otherwise); returns where they are set already or do not apply. Call it first
    thing in a ``__main__`` block, before anything worth keeping exists."""
    env = tuned_environ(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
