"""Preemption: a notice on any host stops every process at one step, which is saved.

Cloud TPU VMs (spot, queued resources, maintenance) get a SIGTERM before they go. Each host of a
pod gets its own, at its own moment, and a multi-host run can only save a checkpoint with every
process at the same step, so the hosts must agree on one. JAX's distributed runtime does this:
``jax.distributed.initialize`` starts a preemption sync manager that catches SIGTERM on its host
(its own handler, in C++) and tells the others through the coordination service; every process
calls :func:`jax.experimental.multihost_utils.reached_preemption_sync_point` once a step, and it
returns True on all of them at the same step (one past the furthest any process had reached).
Orbax and MaxText save at that point and exit; so does the training loop, with
:class:`~qarl_jax.errors.Preempted` (exit code 75), and the same command resumes from the saved step.

A process that did not start ``jax.distributed`` (one host) has no sync manager, and the sync
point is never reached there; :class:`Watch` then installs its own SIGTERM handler, which only
notes the notice, and the loop stops at the end of the step it is in. Off the main thread no
handler can be installed (Python's rule) and SIGTERM keeps its default: the process ends.
"""

from __future__ import annotations

import signal
import threading
import types
from typing import Any

import jax
from jax.experimental import multihost_utils


class Watch:
    """Whether a preemption notice asks the run to stop after a step (a context manager: the
    one-process SIGTERM handler lives inside it; the previous handler is restored on exit)."""

    def __init__(self) -> None:
        self._noticed = False
        self._previous: Any = None  # the handler signal.signal() returned
        self._installed = False

    def __enter__(self) -> Watch:
        if not jax.distributed.is_initialized() and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._notice)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _notice(self, signum: int, frame: types.FrameType | None) -> None:
        self._noticed = True

    def reached(self, step: int) -> bool:
        """Whether the run stops after step ``step`` (every process calls this after every step,
        with the same steps): True on every process at the same step once any host had a notice."""
        if jax.distributed.is_initialized():
            try:
                return multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # jax_enable_preemption_service=False: no notices (orbax does the same)
                return False
        return self._noticed
