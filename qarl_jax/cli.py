"""What every command-line entry point shares: one way to fail, one way to check arguments, one
``--json``.

A user's mistake must end a command with one line on stderr that names the key, file or value,
and an exit code that says which kind of fault it was, the same code in every command (the table
is :data:`EXIT_CODES`, and ``docs/usage.md`` prints it). So each command parses its arguments with
:class:`ArgumentParser` (a usage error is one line, not the usage block) and runs its work inside
:func:`run`, which turns the project's errors (:mod:`qarl_jax.errors`) and the OS errors a user can
cause (a read-only or full disk, a path under a file) into that line and code. Output paths are
checked with :func:`writable_file` / :func:`writable_dir` before any work, so a bad one costs
seconds, not a finished training run.
"""

from __future__ import annotations

import argparse
import errno
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from qarl_jax.errors import OutputError, QarlError, one_line

if TYPE_CHECKING:  # etils and fsspec load with the first path checked, not with --help
    from etils import epath

USAGE = 2  # a bad argument: argparse's own code, kept
OS_ERROR = OutputError.exit_code  # an OS error on a file the command writes or reads
# exit code -> what it means; the same for every command (docs/usage.md prints this table)
EXIT_CODES = {
    0: "done",
    1: "the command ran and its answer is no: memory_plan's plan does not fit, verify_checkpoint "
    "found a damaged checkpoint",
    2: "usage or config: a bad argument, key or value, a config file that is missing or not valid "
    "YAML, a plan that cannot be made, multi-host settings, a port in use",
    3: "checkpoint or model: a model directory or run checkpoint that cannot be loaded, resumed or served",
    4: "data: prompt data that cannot be used, a run's logs that cannot be read",
    5: "output: a path the command must write that is in use, not writable, or would replace a run; "
    "an OS error on a file",
    6: "grader: a grader that returned a score outside [0, 1]",
    7: "hosts: the processes of a multi-host run do not see one run directory (set a shared "
    "run.output_dir, a gs:// bucket path on a Cloud TPU pod)",
    75: "preempted (SIGTERM on any host, or JAX's preemption notice): every process saved the same "
    "step; the same command resumes from it",
    130: "interrupted (Ctrl-C); the message says where a rerun resumes",
}
# a value that is a key=value override (``run.steps=3``): an option given it swallowed an override
_OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.\w+)*=")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the argument (argparse prints the whole
    usage block first, which buries it in a batch job's log), and no option may take a
    ``key=value`` override as its value: ``--json quant.fmt=w8a8`` once planned w4a16 and wrote a
    file named ``quant.fmt=w8a8``."""

    def error(self, message: str) -> NoReturn:
        print(f"usage error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USAGE)

    def parse_known_args(  # type: ignore[override]  # argparse's overloads; same behaviour
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if action.option_strings and isinstance(value, str) and _OVERRIDE.match(value):
                self.error(
                    f"argument {'/'.join(action.option_strings)}: got {value!r}, a key=value override; "
                    "give the option its own value"
                )
        return parsed, extra


def run(body: Callable[[], int]) -> int:
    """``body()``'s exit code, or the one line and code of the fault that ended it."""
    try:
        return body()
    except QarlError as e:
        print(one_line(e), file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"file error: {os_error(e)}", file=sys.stderr)
        return OS_ERROR
    except KeyboardInterrupt:
        print("qarl: interrupted", file=sys.stderr)
        return 130


def os_error(e: OSError) -> str:
    """``path: reason`` (``OSError``'s own text puts the errno first and quotes the path)."""
    reason = e.strerror or str(e)
    paths = [p for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(map(str, paths))}: {reason}" if paths else reason


def writable_dir(path: str | os.PathLike, what: str) -> epath.Path:
    """``path`` as a directory this process can write into (created, with its parents; in a bucket,
    ``gs://``, an object written and deleted), or an :class:`OutputError` naming ``what`` (the option
    or key) and why not; a URL of another scheme is a :class:`ConfigError` (:mod:`qarl_jax.storage`)."""
    from qarl_jax import storage

    out = storage.parse(path, what)
    if storage.is_remote(out):
        probe = out / ".qarl-write-check"
        try:
            probe.write_text("")
            probe.unlink()
        except Exception as e:  # no bucket, credentials, permission: the client's own words
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise OutputError(f"{what} {out}: not writable ({reason})") from None
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{what} {out} exists and is not a directory") from None
    except OSError as e:
        raise OutputError(f"{what} {out}: cannot create it ({_why(e)})") from None
    try:  # a real write: permission bits say nothing for root, or on a read-only mount
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise OutputError(f"{what} {out}: not writable ({_why(e)})") from None
    return out


def writable_file(path: str | os.PathLike, what: str, suffixes: Sequence[str] = ()) -> pathlib.Path:
    """``path`` as a file this process can create or replace (its directory created), with one of
    ``suffixes`` when given, or an :class:`OutputError` naming ``what`` and why not."""
    path = pathlib.Path(path)
    if suffixes and path.suffix.lower() not in suffixes:
        raise OutputError(f"{what} {path}: the file name must end in {' or '.join(suffixes)}")
    if path.is_dir():
        raise OutputError(f"{what} {path} is a directory; name a file")
    writable_dir(path.parent, f"{what}'s directory")
    if path.exists():
        try:
            open(path, "ab").close()  # appends nothing: the file stays as it is until replaced
        except OSError as e:
            raise OutputError(f"{what} {path}: not writable ({_why(e)})") from None
    return path


def _why(e: OSError) -> str:
    if e.errno == errno.ENOTDIR:
        return "a part of the path is a file"
    return e.strerror or str(e)


def at_least(low: int | float, kind: type = int, strict: bool = False) -> Callable[[str], Any]:
    """An argparse ``type``: a ``kind`` number >= ``low`` (> ``low`` when ``strict``); a bad one is
    a one-line usage error naming the option."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not (value > low if strict else value >= low):  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def port(text: str) -> int:
    """An argparse ``type``: a TCP port, 0 (any free one) to 65535."""
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {text}")
    return value


def add_json(parser: argparse.ArgumentParser, what: str) -> None:
    """The one ``--json`` convention: a flag (it takes no value, so it can swallow nothing); stdout
    then carries exactly one JSON object, ``what``, and nothing else (status lines go to stderr), so
    ``> FILE`` saves it and a pipe reads it."""
    parser.add_argument(
        "--json", action="store_true", help=f"print {what} as one JSON object on stdout, nothing else"
    )


def add_multihost(parser: argparse.ArgumentParser) -> None:
    """The multi-host flags (:func:`qarl_jax.run.distributed.maybe_initialize` reads them, else the
    $JAX_* environment variables)."""
    group = parser.add_argument_group("multi-host (jax.distributed; nothing to give on one host)")
    group.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address, the same on every host"
    )
    group.add_argument("--num-processes", type=at_least(1), metavar="N", help="number of processes (hosts)")
    group.add_argument("--process-id", type=at_least(0), metavar="I", help="this process's index, 0..N-1")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="let JAX detect the cluster (SLURM, ...; a multi-host Cloud TPU slice is detected without it)",
    )


def plain(text: str) -> str:
    """A docstring paragraph as ``--help`` shows it: without reStructuredText markup
    (``x`` and :mod:`x` both read as x on a terminal)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text).replace("\\\\", "\\")
