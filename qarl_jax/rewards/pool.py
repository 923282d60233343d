"""Grading in worker processes with a per-sample time limit.

A pathological response (sympy on deep nesting, a regex in C) can run for minutes or crash the
interpreter, and math-verify's own timeout needs a main thread. So each sample is graded in a worker
process's main thread; the parent hands out one sample at a time, and a worker that exceeds the
limit is killed, one that dies is noticed; a dead worker is replaced, its sample scores 0.

A time limit is also what a busy host runs into with a correct answer (math-verify's symbolic check
of ``2x + 1`` against ``1 + 2x`` took past its second under load in CI, and the sample silently
scored 0). So a sample that runs out of time, in the worker (math-verify's own alarm: the grader
raises :class:`GradeTimeout`) or in the parent (killed), is graded again once with twice the time
before it scores 0. Every such event is counted in :attr:`Grader.stats` (``retries``, ``timeouts``:
samples that scored 0 for time, ``crashes``, ``errors``), which the training loop logs per step.

Workers start with ``spawn`` (no fork of a JAX process) and only receive samples once they report
ready, so start-up time never eats a sample's budget.
As with any ``spawn`` pool, a script that creates a :class:`Grader` needs an
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import multiprocessing as mp
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from qarl_jax.errors import GraderError
from qarl_jax.rewards.choice import grade_choice
from qarl_jax.rewards.latex import GradeTimeout, grade_math
from qarl_jax.rewards.numbers import grade_number

GradeFn = Callable[[str, str, int], float]
GRADER_COUNTS = ("graded", "retries", "timeouts", "crashes", "errors")  # Grader.stats' keys
RETRIES = 1  # more attempts of a sample that ran out of time, each with twice the time of the last


def _grade_synthetic(response: str, answer: str, timeout_s: int) -> float:
    return grade_number(response, answer)


GRADERS: dict[str, GradeFn] = {
    "synthetic": _grade_synthetic,
    "gsm8k": _grade_synthetic,
    "math": grade_math,
    "choice": grade_choice,
}
IN_PROCESS_KINDS = frozenset({"synthetic", "choice"})
# one sample a worker grades before it reports ready: math-verify imports sympy on first use (seconds,
# more on a loaded machine), which must not count against a real sample's time limit; not a number,
# which grade_math compares without math-verify
WARM_UP = {"math": ("\\boxed{x + 1}", "1 + x")}


def _worker(conn: Connection, graders: Mapping[str, GradeFn]) -> None:
    """Grade ``(kind, response, answer, timeout_s)`` messages until the pipe closes, answering
    ``(score, status)``: status ``ok``, ``timeout`` (the grader's own limit) or ``error`` (score 0)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its timeout warnings echo the whole input
    for kind, (response, answer) in WARM_UP.items():
        if kind in graders:
            graders[kind](response, answer, 60)
    conn.send("ready")
    while True:
        try:
            kind, response, answer, timeout_s = conn.recv()
        except EOFError:
            return
        try:
            conn.send((float(graders[kind](response, answer, timeout_s)), "ok"))
        except GradeTimeout:
            conn.send((0.0, "timeout"))
        except Exception:  # a grader bug or a sympy RecursionError: the sample is wrong, not the run
            conn.send((0.0, "error"))


@dataclasses.dataclass
class _Task:
    index: int  # the sample's
    attempt: int  # 0, then 1.. for retries
    limit_s: float  # the parent's limit for this attempt
    start: float


class _Worker:
    def __init__(self, ctx: Any, graders: Mapping[str, GradeFn]):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, graders), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.task: _Task | None = None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class Grader:
    """A pool of grading workers; use as a context manager, or call :meth:`close`.

    ``time_limit_s`` bounds each sample's first attempt from the parent (kill and replace);
    math-verify's own alarm gets half of it; a retry gets twice the time (module docstring).
    ``graders`` adds or replaces kinds (picklable module-level functions ``(response, answer,
    timeout_s) -> float`` that may raise :class:`GradeTimeout`). Kind ``synthetic`` grades
    in-process (pure, fast).
    """

    def __init__(
        self,
        num_workers: int = 2,
        time_limit_s: float = 5.0,
        graders: Mapping[str, GradeFn] | None = None,
    ):
        if num_workers < 1 or time_limit_s <= 0:
            raise ValueError(f"need num_workers >= 1 and time_limit_s > 0, got {num_workers}, {time_limit_s}")
        self.time_limit_s = time_limit_s
        self.graders = {**GRADERS, **(graders or {})}
        self.stats: collections.Counter[str] = collections.Counter()
        self._ctx = mp.get_context("spawn")
        self._inner_timeout = _inner(time_limit_s)
        self._num_workers = num_workers
        self._workers: list[_Worker] = []  # started on first use: in-process kinds never need them
        self._logged: collections.Counter[str] = collections.Counter()

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.graders)

    def counts_since_last_call(self) -> dict[str, int]:
        """What happened since the previous call (``graded``, ``retries``, ``timeouts``,
        ``crashes``, ``errors``): a training step's share of :attr:`stats`."""
        now = {k: self.stats[k] for k in GRADER_COUNTS}
        delta = {k: v - self._logged[k] for k, v in now.items()}
        self._logged.update(delta)
        return delta

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._spawn()

    def grade(self, responses: Sequence[str], answers: Sequence[str], kind: str) -> np.ndarray:
        """Scores in [0, 1] as float32, one per response; never raises for a bad response."""
        if kind not in self.graders:
            raise ValueError(f"kind: unknown {kind!r}, expected one of {sorted(self.graders)}")
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        if kind in IN_PROCESS_KINDS:
            fn = self.graders[kind]
            graded = [fn(r, a, self._inner_timeout) for r, a in zip(responses, answers, strict=True)]
            return _checked(np.asarray(graded, np.float32), kind, self.graders[kind])
        while len(self._workers) < self._num_workers:
            self._workers.append(self._spawn())
        scores = np.zeros(len(responses), np.float32)
        pending = collections.deque((i, 0) for i in range(len(responses)))  # (sample, attempt)
        while pending or any(w.task for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    self._dispatch(w, *pending.popleft(), kind, responses, answers)
            self._collect(scores, pending)
        self.stats["graded"] += len(responses)
        return _checked(scores, kind, self.graders[kind])

    def _dispatch(
        self, w: _Worker, i: int, attempt: int, kind: str, responses: Sequence[str], answers: Sequence[str]
    ) -> None:
        limit = self.time_limit_s * 2**attempt
        w.task = _Task(i, attempt, limit, time.monotonic())
        try:
            w.conn.send((kind, responses[i], answers[i], _inner(limit)))
        except (BrokenPipeError, OSError):
            w.task = None
            self.stats["crashes"] += 1
            self._replace(w)

    def _out_of_time(self, task: _Task, pending: collections.deque) -> None:
        """A retry with twice the time, or the sample scores 0 (it already does) as a timeout."""
        if task.attempt < RETRIES:
            self.stats["retries"] += 1
            pending.appendleft((task.index, task.attempt + 1))
        else:
            self.stats["timeouts"] += 1

    def _collect(self, scores: np.ndarray, pending: collections.deque) -> None:
        """Wait for results or the nearest deadline; kill and replace workers that overran or died."""
        now = time.monotonic()
        deadlines = [w.task.start + w.task.limit_s - now for w in self._workers if w.task]
        timeout = max(0.0, min(deadlines)) if deadlines else 1.0
        by_conn = {w.conn: w for w in self._workers}
        for conn in wait(list(by_conn), timeout=timeout):
            w = by_conn[conn]
            try:
                message = w.conn.recv()  # w.conn is conn, typed as a Connection
            except (EOFError, OSError):
                if not w.ready:
                    w.process.join(timeout=5)
                    raise RuntimeError(f"grading worker exited at start-up ({w.process.exitcode})") from None
                if w.task is not None:
                    self.stats["crashes"] += 1
                self._replace(w)
                continue
            if message == "ready":
                w.ready = True
                continue
            score, status = message
            assert w.task is not None, "a worker sends a score only for the task it was dispatched"
            scores[w.task.index] = score
            if status == "timeout":
                self._out_of_time(w.task, pending)
            elif status == "error":
                self.stats["errors"] += 1
            w.task = None
        now = time.monotonic()
        for w in list(self._workers):
            if w.task and now - w.task.start > w.task.limit_s:
                self._out_of_time(w.task, pending)
                self._replace(w)

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _inner(limit_s: float) -> int:
    """The grader's own limit inside a parent's limit of ``limit_s``: half of it, in the whole
    seconds ``signal.alarm`` takes (at least 1), so the parent rarely needs to kill."""
    return max(1, math.floor(limit_s / 2))


def _checked(scores: np.ndarray, kind: str, fn: GradeFn) -> np.ndarray:
    """``scores``, unless a grader broke the contract (a score in [0, 1]): then a
    :class:`GraderError` naming it, since a NaN or 5.0 reward would silently skew every advantage."""
    bad = np.flatnonzero(~((scores >= 0.0) & (scores <= 1.0)))  # NaN fails both comparisons
    if bad.size:
        name = getattr(fn, "__qualname__", repr(fn))
        raise GraderError(
            f"grader {kind!r} ({getattr(fn, '__module__', '?')}.{name}) returned {float(scores[bad[0]])} for "
            f"response {int(bad[0])} ({bad.size} of {scores.size} outside [0, 1]); scores must be in [0, 1]"
        )
    return scores


def grade(responses: Sequence[str], answers: Sequence[str], kind: str, **grader_kwargs: Any) -> np.ndarray:
    """One-off grading; a training loop should keep one :class:`Grader` (workers start once)."""
    with Grader(**grader_kwargs) as grader:
        return grader.grade(responses, answers, kind)
