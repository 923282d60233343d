"""The CLI in a child process that freezes itself mid-run, on an event rather than a clock: the
SIGKILL tests (test_checkpoint, test_async_rollouts) kill a real ``python -m qarl_jax.main`` at a
known point of its run without racing it. Imported as a plain module (``import stopped_cli``).

The child is the CLI itself (``runpy`` of ``qarl_jax.main``) with one addition: once the save of
checkpoint ``step`` has been started (so checkpoint ``step - 1`` is committed: orbax waits for the
previous save before it starts the next; ``step`` itself is being written in the background), the
process sends itself SIGSTOP, every thread frozen where it is, its run lock held. The parent waits
for that stop (``waitpid`` with ``WUNTRACED``: the kernel's event, no polling), then does what it
tests to the frozen run and kills it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Sequence

CHILD = """
import os, runpy, signal, sys
from qarl_jax.run.checkpoint import Checkpointer
stop_at = int(sys.argv.pop(1))
real_save = Checkpointer.save
def save(self, step, *args, **kwargs):
    real_save(self, step, *args, **kwargs)
    if step == stop_at:
        os.kill(os.getpid(), signal.SIGSTOP)
Checkpointer.save = save
sys.argv[0] = "qarl_jax.main"
runpy.run_module("qarl_jax.main", run_name="__main__", alter_sys=True)
"""


def start_and_stop(
    args: Sequence[str], step: int, log: pathlib.Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``python -m qarl_jax.main *args`` in a child, returned once it has stopped itself after
    starting checkpoint ``step``'s save; its stderr goes to ``log`` (a file: a pipe nobody reads
    until the stop could fill and block it first), stdout is dropped."""
    cmd = [sys.executable, "-c", CHILD, str(step), *args]
    with log.open("wb") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):  # it ended (reaped here): say how, with its last words
        proc.returncode = os.waitstatus_to_exitcode(status)
        raise AssertionError(
            f"the run ended ({proc.returncode}) before checkpoint {step}: {log.read_text()[-3000:]}"
        )
    return proc


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the stopped child and reap it."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
