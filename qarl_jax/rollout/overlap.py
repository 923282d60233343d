"""Asynchronous (k-step-off) rollouts: the batch trained at step s was rolled out by weights k updates old.

With ``rollout.async_steps = k >= 1`` the loop keeps k rolled-out, graded batches waiting. While step
s trains on the oldest, the engine already decodes (and the grader pool grades) batch s + k with the
weights it holds, those of update s; batch b was therefore rolled out by the weights of update
max(0, b - k), and its staleness (``rollout/staleness``) never exceeds k. With ``rollout.devices``
the two phases run on disjoint device groups (:func:`device_groups`) and overlap in wall clock; the
engine's weights are swapped only after its batch is done, so what a batch records is what produced
it.

Exactness. Both phases are deterministic functions of their inputs (the weights version, the data
position, the step's keys), so running them one after the other (``rollout.overlap=false``: the same
schedule without concurrency) gives the same bits as overlapping them; the tests compare the two
runs metric for metric. A checkpoint after step s holds the k waiting batches (:class:`Produced`,
JSON: every number survives the round trip exactly), so a run killed at any point resumes with the
batches it would have trained on.

Where the time goes (:class:`PhaseClock`): each step's rollout and training intervals, their
overlap, and each side's idle time.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from qarl_jax.errors import ConfigError
from qarl_jax.rollout.driver import Sample
from qarl_jax.rollout.groups import Groups

T = TypeVar("T")


@dataclasses.dataclass
class Produced:
    """One rolled-out and graded batch, waiting for the step that trains on it.

    ``drawn``: the step's first draw (its rewards and lengths are the step's figures); ``groups``:
    what trains (after dynamic sampling's filtering and refills); ``version``: the number of updates
    behind the weights that rolled it out; ``check``: the alignment check of its log-probs against
    the training forward at those weights (``mismatch_*``, ``policy_entropy``), made when it was
    produced, so a resumed run reports what an uninterrupted one does."""

    drawn: Groups
    groups: Groups
    dynamic: dict[str, float]
    version: int
    rollout_s: float  # seconds generating
    tokens: int  # tokens generated
    check: dict[str, float] = dataclasses.field(default_factory=dict)
    # the training batch built for the check, kept for the step that trains on it (not saved: a
    # resumed run builds it again from the groups)
    batch: Any = dataclasses.field(default=None, repr=False)

    def to_json(self) -> dict:
        return {
            "drawn": _groups_json(self.drawn),
            "groups": _groups_json(self.groups),
            "dynamic": self.dynamic,
            "version": self.version,
            "rollout_s": self.rollout_s,
            "tokens": self.tokens,
            "check": self.check,
        }

    @classmethod
    def from_json(cls, obj: dict) -> Produced:
        return cls(
            drawn=_groups_from_json(obj["drawn"]),
            groups=_groups_from_json(obj["groups"]),
            dynamic={k: float(v) for k, v in obj["dynamic"].items()},
            version=int(obj["version"]),
            rollout_s=float(obj["rollout_s"]),
            tokens=int(obj["tokens"]),
            check={k: float(v) for k, v in obj["check"].items()},
        )


def _groups_json(groups: Groups) -> dict:
    """A JSON object of ``groups``. Floats go through Python's float (f64): f32 log-probs and f64
    rewards come back bit for bit."""
    return {
        "prompts": groups.prompts,
        "samples": [[dataclasses.asdict(s) for s in group] for group in groups.samples],
        "scores": np.asarray(groups.scores, np.float64).tolist(),
        "rewards": np.asarray(groups.rewards, np.float64).tolist(),
        "dtypes": [str(np.asarray(groups.scores).dtype), str(np.asarray(groups.rewards).dtype)],
    }


def _groups_from_json(obj: dict) -> Groups:
    score_dtype, reward_dtype = obj["dtypes"]
    return Groups(
        [list(p) for p in obj["prompts"]],
        [[Sample(**s) for s in group] for group in obj["samples"]],
        np.asarray(obj["scores"], np.float64).astype(score_dtype),
        np.asarray(obj["rewards"], np.float64).astype(reward_dtype),
    )


class Background:
    """``fn()`` on a daemon thread (an interrupted run does not wait for a decode to finish);
    :meth:`result` joins it and re-raises what it raised. JAX dispatch is thread-safe and releases
    the GIL while devices compute, so the two phases overlap on disjoint devices."""

    def __init__(self, fn: Callable[[], T]):
        self._out: list = []
        self._error: list[BaseException] = []
        self.start = time.perf_counter()
        self.end = self.start

        def run():
            try:
                self._out.append(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the joining thread
                self._error.append(e)
            finally:
                self.end = time.perf_counter()

        self._thread = threading.Thread(target=run, name="qarl-rollout", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self._out[0]


@dataclasses.dataclass
class PhaseClock:
    """The intervals of one step's rollout and training phases (perf_counter seconds)."""

    rollout: tuple[float, float] | None = None
    train: tuple[float, float] | None = None

    def timed(self, phase: str, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            setattr(self, phase, (start, time.perf_counter()))

    def metrics(self, step_s: float) -> dict[str, float]:
        """``time/rollout_busy`` and ``time/train_busy`` (seconds each phase ran), ``time/idle_*``
        (the step's wall time the phase did not use) and ``time/overlap_frac``: the seconds both ran
        at once over the shorter phase's (1: the shorter one was hidden entirely)."""
        r0, r1 = self.rollout or (0.0, 0.0)
        t0, t1 = self.train or (0.0, 0.0)
        busy_r, busy_t = r1 - r0, t1 - t0
        both = max(0.0, min(r1, t1) - max(r0, t0))
        shorter = min(busy_r, busy_t)
        return {
            "time/rollout_busy": busy_r,
            "time/train_busy": busy_t,
            "time/idle_rollout": max(0.0, step_s - busy_r),
            "time/idle_train": max(0.0, step_s - busy_t),
            "time/overlap_frac": both / shorter if shorter > 0 else 0.0,
        }


def run_phases(produce: Callable[[], Any] | None, train: Callable[[], T], overlap: bool, clock: PhaseClock):
    """(produce(), train()): together (``produce`` on a background thread) when ``overlap``, else
    one after the other in that order; ``produce=None`` skips it (the last steps have nothing left
    to roll out). Both phases' intervals go to ``clock``."""
    if produce is None:
        return None, clock.timed("train", train)
    if not overlap:
        produced = clock.timed("rollout", produce)
        return produced, clock.timed("train", train)
    background = Background(produce)
    try:
        trained = clock.timed("train", train)
    finally:
        produced = background.result()  # joined even when training raised: no stray decode
        clock.rollout = (background.start, background.end)
    return produced, trained


def device_groups(rollout_devices: int) -> tuple[list, list]:
    """(training devices of the whole run, this process's rollout devices): the first
    ``rollout_devices / processes`` of each process's devices decode, the rest of every process's
    train; 0: every device does both (the phases take turns)."""
    processes, local = jax.process_count(), jax.local_device_count()
    if rollout_devices == 0:
        return jax.devices(), jax.local_devices()
    if rollout_devices % processes:
        raise ConfigError(
            f"rollout.devices ({rollout_devices}) must split evenly over the {processes} processes"
        )
    per_process = rollout_devices // processes
    if per_process >= local:
        raise ConfigError(
            f"rollout.devices ({rollout_devices}) leaves no device to train on: each of the "
            f"{processes} process(es) has {local}"
        )
    decoding = {d for p in range(processes) for d in jax.local_devices(process_index=p)[:per_process]}
    return [d for d in jax.devices() if d not in decoding], jax.local_devices()[:per_process]
