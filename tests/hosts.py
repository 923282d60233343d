"""Two hosts played by two JAX processes on this machine (two CPU devices each, gloo collectives):
the launcher tests/test_multihost.py and tests/test_pod_hosts.py share, and the metrics view both
compare runs by. Imported as a plain module (``import hosts``: pytest puts tests/ on the path)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "loop_smoke.yaml")
# the session's two-host run (:func:`reference`), beside configs/loop_smoke.yaml, and the shape of
# every two-host training run (their programs compiled once per session: the compilation cache,
# tests/conftest.py): one-step-off rollouts on each host's first device (rollout.devices counts
# both hosts'), training on the other two with fsdp across the hosts (the weights sharded across
# them: each host's engine gathers them, both processes write pieces of each checkpoint, the export
# gathers them). One run for what two hosts train, log, checkpoint and export (test_multihost) and
# what a preempted one must equal once resumed, waiting batches and all (test_pod_hosts), instead of
# a synchronous and an asynchronous run. 4 steps: a run preempted after step 1 (or 2 or 3, see
# qarl_jax.run.preemption) has steps left to resume; no regular checkpoint (checkpoint_every=0: the
# final one only, and a preempted run only the preemption's save); a progress line every step
STEPS = 4
RUN = [
    f"run.steps={STEPS}",
    *("rollout.async_steps=1", "rollout.devices=2", "mesh.fsdp=2"),
    *("run.eval_prompts=4", "run.eval_samples=2", "run.checkpoint_every=0"),
    *("run.progress=true", "run.log_every=1"),
]


# The child: ``python -m qarl_jax.main`` (runpy), with process 1's OWN programs (its rollout engine
# and eval, on its local devices) written to the session's compilation cache too. Why: JAX writes
# cache entries from process 0 only, so process 1's own programs (another device assignment,
# another cache key) were compiled afresh in every run (~60-90 s each of the pod test's three runs
# on two loaded cores, process 0 idle meanwhile). Programs over both hosts' devices stay process
# 0's to write (one key for both processes: two writers of one file would interleave its bytes);
# no global state is touched (orbax's threads read the process index meanwhile). What a run
# computes is unchanged; a JAX without these private functions fails here loudly, to be revisited.
CHILD = """
import re, runpy, sys
from jax._src import compilation_cache, compiler, distributed

real_write = compiler._cache_write

def write_own_programs_too(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if distributed.global_state.process_id == 0:
        return real_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
    header = executable.hlo_modules()[0].to_string().split(chr(10), 1)[0]
    devices = 1
    for count in re.findall(r"(?:replica_count|num_partitions)=(\\d+)", header):
        devices *= int(count)
    if not host_callbacks and devices <= len(executable.local_devices()):
        compilation_cache.put_executable_and_time(
            cache_key, module_name, executable, backend, int(compile_time_secs))

compiler._cache_write = write_own_programs_too
sys.argv[0] = "qarl_jax.main"
runpy.run_module("qarl_jax.main", run_name="__main__", alter_sys=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def without_time(metrics: dict) -> dict:
    """A metrics row without what depends on the host's speed (timings, the grader's clock)."""
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "grader/"))}


def rows(run) -> list[dict]:
    """metrics.jsonl of a run directory (a local path or an ``epath`` in a bucket), without timings."""
    return [without_time(json.loads(line)) for line in (run / "metrics.jsonl").read_text().splitlines()]


@dataclass
class Done:
    """One process's exit code and what it printed."""

    rc: int
    out: str
    err: str


def start(
    run: str,
    overrides: Sequence[str],
    logs: pathlib.Path,
    tag: str,
    cwds: Sequence[pathlib.Path] = (REPO, REPO),
    extra: Sequence[str] = (),
    watch: bool = False,
) -> list[subprocess.Popen]:
    """``python -m qarl_jax.main`` on two processes, process i in ``cwds[i]``; their stdout and
    stderr go to files ``logs/{tag}{i}.out|err`` (files, not pipes: a pipe nobody reads while the
    other process is awaited fills and blocks its writer, and with it both hosts' collectives), but
    with ``watch`` process 0's stderr is a pipe, to read its progress lines as they come."""
    port = free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    procs = []
    for i, cwd in enumerate(cwds):
        argv = [sys.executable, "-c", CHILD, "--config", SMOKE, f"run.output_dir={run}", *overrides]
        argv += [*extra, "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)]
        stdout = open(logs / f"{tag}{i}.out", "wb")  # noqa: SIM115 (the child writes it)
        stderr = subprocess.PIPE if watch and i == 0 else open(logs / f"{tag}{i}.err", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr))
        stdout.close()
        if stderr is not subprocess.PIPE:
            stderr.close()
    return procs


def finish(procs: list[subprocess.Popen], logs: pathlib.Path, tag: str) -> list[Done]:
    """Wait for the processes of :func:`start`; each one's exit code, stdout and whole stderr."""
    done = []
    try:
        for i, p in enumerate(procs):
            piped = p.stderr.read().decode() if p.stderr is not None else None
            p.wait()  # no deadline: a cold compile on a loaded host takes minutes; a hang is pytest-timeout's
            err = piped if piped is not None else (logs / f"{tag}{i}.err").read_text()
            done.append(Done(p.returncode, (logs / f"{tag}{i}.out").read_text(), err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stderr is not None:
                p.stderr.close()
    return done


def summary(stdout: str) -> dict:
    """The summary JSON main prints last (gloo's connection notes may precede it)."""
    return json.JSONDecoder().raw_decode(stdout, stdout.index('{\n  "run_dir"'))[0]


def launch(
    run: pathlib.Path, overrides: Sequence[str], logs: pathlib.Path, extra: Sequence[str] = ()
) -> list[dict]:
    """Both processes run to the end (exit 0 each); their printed summaries."""
    done = finish(start(str(run), overrides, logs, "run", extra=extra), logs, "run")
    for i, d in enumerate(done):
        assert d.rc == 0, f"process {i} exited {d.rc}:\n{d.err[-3000:]}"
    return [summary(d.out) for d in done]


@dataclass(frozen=True)
class Reference:
    """The session's uninterrupted two-host run (:data:`RUN`): its run directory, the HF export
    process 0 wrote (``--export-hf``) and both processes' printed summaries."""

    run: pathlib.Path
    export: pathlib.Path
    summaries: list[dict]


def reference(base: pathlib.Path) -> Reference:
    """Built once per test session (tests/once.py) and read by tests/test_multihost.py (what two
    hosts train, log, checkpoint and export) and tests/test_pod_hosts.py (what a preempted bucket
    run must equal once resumed): one two-process run instead of one per module."""
    import once

    def build(out: pathlib.Path) -> None:
        summaries = launch(out / "run", RUN, out, ["--export-hf", str(out / "hf")])
        (out / "summaries.json").write_text(json.dumps(summaries))

    out = once.built_once(base, "two-host-run", build)
    return Reference(out / "run", out / "hf", json.loads((out / "summaries.json").read_text()))
