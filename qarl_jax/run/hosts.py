"""Do the processes of a multi-host run see one run directory? Checked before any work.

Every process of a run writes its shards of each checkpoint into the run directory and reads them
all back on resume, so the directory must be one place that every host reaches: a bucket
(``gs://...``) or a shared filesystem. On a Cloud TPU pod each host has its own boot disk, so a
local path such as the configs' ``runs/...`` names a different directory on every host: orbax then
commits only process 0's shards, the others' stay in temporary folders, and a resumed run restores
on host 0 while the other hosts start at step 0 and fall out of step (they hang). Nothing in
orbax notices, so :func:`check_shared` asks directly: process 0 writes a random token (new every
launch) into the run directory, a collective makes every process wait for it and tells them what
it is, each other process reads the file back at its own ``run.output_dir``, and a second
collective gathers who saw it. A process that did not is named, with its host, on every process,
which then stops with :class:`~qarl_jax.errors.HostsError` (exit code 7). One process has nothing
to check.

The token file is named after the token, so two launches on one directory never read each
other's, and process 0 deletes it once every process has looked. Paths are ``etils.epath`` paths,
so a bucket is checked the same way as a local disk.
"""

from __future__ import annotations

import os
import secrets
import socket

import jax
from etils import epath

from qarl_jax.errors import HostsError, OutputError
from qarl_jax.run import distributed

TOKEN_PREFIX = ".hosts-check-"


def shown(path: epath.Path) -> str:
    """A run directory as a user should read it in a message: a local one absolute (the same
    relative path names another directory on each host), a URL as given."""
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


def check_shared(run_dir: epath.PathLike) -> None:
    """Raise :class:`HostsError` on every process unless every process reads, at its own
    ``run_dir``, the token process 0 wrote there (collective: every process calls it)."""
    if jax.process_count() == 1:
        return
    run_dir = epath.Path(run_dir)
    primary = jax.process_index() == 0
    token, failure = secrets.token_hex(16) if primary else "", ""
    path = run_dir / f"{TOKEN_PREFIX}{token}"
    if primary:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(token)
        except OSError as e:
            failure = f"{e.strerror or e}"
    # process 0's token, after it is written (a collective: nobody reads before it is there)
    first = distributed.gather_json({"host": socket.gethostname(), "token": token, "failure": failure})[0]
    if first["failure"]:
        where = f"run.output_dir {shown(run_dir)}"
        raise OutputError(f"{where}: process 0 ({first['host']}) cannot write it ({first['failure']})")
    token = first["token"]
    path = run_dir / f"{TOKEN_PREFIX}{token}"
    sees = primary or _read(path) == token
    everyone = distributed.gather_json({"host": socket.gethostname(), "dir": shown(run_dir), "sees": sees})
    if primary:
        try:
            path.unlink()
        except OSError:
            pass  # a leftover token file is inert: every launch makes a new name
    apart = [f"process {i} ({e['host']}: {e['dir']})" for i, e in enumerate(everyone) if not e["sees"]]
    if apart:
        raise HostsError(
            f"the hosts do not share the run directory: {', '.join(apart)} cannot read what process 0 "
            f"({everyone[0]['host']}: {everyone[0]['dir']}) wrote there, so each host would keep its own "
            "checkpoint shards; set run.output_dir to a directory every host reaches (on a Cloud TPU pod "
            "a bucket: run.output_dir=gs://BUCKET/RUN)"
        )


def _read(path: epath.Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
