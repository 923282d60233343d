"""The project's one error hierarchy.

Every error a user can cause (a bad key, a missing file, a damaged checkpoint, a busy run directory)
is a :class:`QarlError` whose message is one line naming the key, file or value at fault, so the
command-line entry points can print it without a traceback and exit non-zero, and library callers
can catch one base class. The subclasses also derive from the built-in exception the same failure
raised before there was a hierarchy (``ValueError`` for bad input, ``RuntimeError`` for a failed
environment), so existing ``except ValueError`` code keeps working.

Each class's ``exit_code`` is the code of its kind of fault, the same in every command
(:data:`qarl_jax.cli.EXIT_CODES` is the table): 2 usage or config, 3 checkpoint or model, 4 data,
5 output, 6 grader, 7 hosts that do not share the run directory, 75 preempted (saved: rerun), 130
interrupted.
"""

from __future__ import annotations

import re


class QarlError(Exception):
    """Base of every error this package raises on purpose; the message is a one-line explanation."""

    exit_code = 1  # what a command-line entry point exits with


class ConfigError(QarlError, ValueError):
    """A configuration value or key that cannot be used; the message names the key."""

    exit_code = 2


class CheckpointError(QarlError, ValueError):
    """A model directory or run checkpoint that cannot be loaded, resumed from or trusted; the
    message names the directory (and the file or array) and says why."""

    exit_code = 3


class DataError(QarlError, ValueError):
    """Prompt data that cannot be used: a missing file, too few valid rows; names the file."""

    exit_code = 4


class MalformedRowError(DataError):
    """A row (or prompt) rejected under ``bad_rows="error"``; the message names its origin."""


class OutputError(QarlError, RuntimeError):
    """A path a command must write (a run directory, ``--out``, ``output_dir``) that cannot be
    written: a file where a directory belongs, no permission, a read-only disk."""

    exit_code = 5


class RunDirError(OutputError):
    """A run directory that this run may not write: held by another run, or an old run that would
    be replaced without ``run.overwrite=true``."""


class GraderError(QarlError, ValueError):
    """A grader that returned something other than a score in [0, 1]; names the grader."""

    exit_code = 6


class DistributedError(QarlError, RuntimeError):
    """Multi-host settings that cannot start ``jax.distributed``."""

    exit_code = 2


class RunLogError(QarlError, ValueError):
    """A run directory or one of its files cannot be read (the logs are a command's input data)."""

    exit_code = 4


class PlanError(QarlError, ValueError):
    """A memory plan that cannot be made: a dimension that does not divide, an unknown shape."""

    exit_code = 2


class ServeError(QarlError, RuntimeError):
    """The server cannot start on the given address (a port already bound); a checkpoint it cannot
    serve is a :class:`CheckpointError`."""

    exit_code = 2


class HostsError(QarlError, RuntimeError):
    """The processes of a multi-host run do not see one run directory (each host's own disk, not a
    shared one); the message names the processes and hosts that disagree and what to set."""

    exit_code = 7


class Preempted(QarlError):
    """The run stopped at a preemption notice (SIGTERM, on any host) after saving a checkpoint at the
    step every process agreed on; the same command resumes from it. 75 is sysexits.h's EX_TEMPFAIL
    ("a temporary failure: retry"), so a launcher can tell a saved stop from a crash (1) or a kill
    by the signal itself (143)."""

    exit_code = 75


class Interrupted(QarlError):
    """The run was stopped (Ctrl-C); the message says which checkpoint a rerun resumes from."""

    exit_code = 130


def one_line(error: QarlError) -> str:
    """How an entry point prints ``error``: its kind from the class name, then the message
    (``CheckpointError`` -> "checkpoint error: ..."), on one line."""
    kind = " ".join(w.lower() for w in re.findall(r"[A-Z][a-z]*", type(error).__name__))
    message = " ".join(str(error).split("\n"))
    return f"qarl: {message}" if isinstance(error, Interrupted | Preempted) else f"{kind}: {message}"
