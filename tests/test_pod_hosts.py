"""A Cloud TPU pod's hosts, played by two JAX processes on this machine (CPU devices, as
tests/test_multihost.py): hosts that do not share the run directory are refused before any work;
a SIGTERM on one host stops both at one step, saved with each host's batch rolled out a step
ahead, and the same command resumes exactly; the slice detection reads what a TPU VM states
(environment variables, the metadata server).
"""

import http.server
import json
import os
import signal
import socket
import sys
import threading

import pytest
from etils import epath
from hosts import RUN, SMOKE, STEPS, finish, rows, start

from qarl_jax.config import load_config
from qarl_jax.errors import Preempted, one_line
from qarl_jax.run import distributed
from qarl_jax.run.preemption import Watch
from qarl_jax.run.train import train

# the session's two-host run (tests/hosts.py): 4 steps, so a step to be preempted after and steps
# left to resume; one-step-off rollouts, so a batch waits in every host at the preemption; no
# regular checkpoint, so only the preemption's save can resume it; progress lines on stderr are
# the event the test waits for
OVERRIDES = RUN
PREEMPTED, HOSTS = 75, 7


def test_hosts_without_a_shared_run_directory_are_refused(tmp_path):
    """One relative run.output_dir in two working directories (two hosts' own disks): both
    processes stop before any work with one line naming the host that does not see process 0's
    token, and exit 7."""
    cwds = [tmp_path / "host0", tmp_path / "host1"]
    for cwd in cwds:
        cwd.mkdir()
    done = finish(start("runs/pod", OVERRIDES, tmp_path, "apart", cwds), tmp_path, "apart")
    for d in done:
        assert d.rc == HOSTS, d.err[-3000:]
        assert "Traceback" not in d.err
        (line,) = [x for x in d.err.splitlines() if x.startswith("hosts error:")]
        assert f"process 1 ({socket.gethostname()}: {cwds[1].resolve() / 'runs' / 'pod'}) cannot read" in line
        assert "set run.output_dir to a directory every host reaches" in line
        assert "gs://BUCKET/RUN" in line
    for cwd in cwds:  # nothing trained, nothing logged
        assert not (cwd / "runs" / "pod" / "metrics.jsonl").exists()
    assert not list((cwds[0] / "runs" / "pod").iterdir())  # the token file is gone too


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two two-process runs (and the session's), on a shared 2-core machine
def test_sigterm_on_one_host_stops_both_at_one_step_and_the_rerun_resumes_exactly(
    tmp_path, gcs_bucket, two_host_run
):
    """The pod case whole: two hosts that share no disk (two empty working directories), the run
    directory in a bucket (a real GCS API server); SIGTERM to the non-primary host once step 1 is
    logged; both stop at one step, saved in the bucket with the batch each host rolled out a step
    ahead; the same command resumes exactly (metrics step by step equal to the session's
    uninterrupted two-host run, the same command on a local disk); nothing is written to either
    host's disk."""
    run = epath.Path(f"{gcs_bucket}/pod-{tmp_path.name}")
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for host in hosts:
        host.mkdir()
    procs = start(str(run), OVERRIDES, tmp_path, "cut", hosts, watch=True)
    for line in procs[0].stderr:  # process 0's progress: SIGTERM to the other host after step 1
        if line.startswith(f"qarl: step 1/{STEPS}".encode()):
            procs[1].send_signal(signal.SIGTERM)
            break
    done = finish(procs, tmp_path, "cut")
    stopped = []
    for d in done:
        assert d.rc == PREEMPTED, d.err[-3000:]
        assert "Traceback" not in d.err
        (line,) = [x for x in d.err.splitlines() if x.startswith("qarl: preempted")]
        stopped.append(line)
    assert stopped[0] == stopped[1]  # one step, one checkpoint, one line on both hosts
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert 1 <= step < STEPS
    assert stopped[0] == (
        f"qarl: preempted: every process stopped after step {step} and saved it in "
        f"{run / 'checkpoints' / str(step)}; run the same command again to resume from there"
    )
    assert [m["step"] for m in rows(run)] == list(range(step + 1))
    # each host's waiting batch (rolled out with step's weights, for step + 1) is in the checkpoint
    saved = json.loads((run / "checkpoints" / str(step) / "data" / "metadata").read_text())
    assert [len(p["pending"]) for p in saved["processes"]] == [1, 1]

    done = finish(start(str(run), OVERRIDES, tmp_path, "again", hosts), tmp_path, "again")
    assert [d.rc for d in done] == [0, 0], done[0].err[-3000:] + done[1].err[-3000:]
    assert f"resuming from {run / 'checkpoints' / str(step)}" in done[0].err
    assert rows(run) == rows(two_host_run.run)
    assert [list(host.iterdir()) for host in hosts] == [[], []]  # no local "gs:" folder, nothing


def test_one_process_notes_sigterm_and_restores_the_handler():
    """Without jax.distributed there is no sync manager: the watch's own handler notes a real
    SIGTERM (the process lives on) and the previous handler comes back after the run."""
    before = signal.getsignal(signal.SIGTERM)
    with Watch() as watch:
        assert not watch.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.reached(2)
    assert signal.getsignal(signal.SIGTERM) is before


# What a Cloud TPU VM states about its slice. GKE sets these variables on every host of a slice
# (JAX's GKE detection reads them); a GCE TPU VM states the same in its metadata server's
# worker-network-endpoints (JAX's GCE detection reads it), either as hostnames or as the older
# name:id:ip triples; multislice adds MEGASCALE_NUM_SLICES.
def no_metadata(key: str) -> None:
    return None


@pytest.mark.parametrize(
    "environ, hosts",
    [
        ({}, 1),  # not a slice (or a GCE VM whose metadata lists no workers)
        ({"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "t1v-n-0"}, 1),  # one host: as before
        ({"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "t1v-n-0,t1v-n-1"}, 2),  # v5p-16
        ({"TPU_PROCESS_ADDRESSES": "10.0.0.2:8476,10.0.0.3:8476,10.0.0.4:8476,10.0.0.5:8476"}, 4),
        ({"TPU_WORKER_HOSTNAMES": "a,b", "MEGASCALE_NUM_SLICES": "2"}, 4),  # two slices of two hosts
    ],
)
def test_slice_hosts_from_the_environment(environ, hosts):
    assert distributed.tpu_slice_hosts(environ, no_metadata) == hosts


class Metadata(http.server.BaseHTTPRequestHandler):
    """The GCE metadata server's instance attributes, as a v5p-16 VM's (two workers)."""

    attributes = {"worker-network-endpoints": "t1v-n-0:0:10.130.0.2,t1v-n-1:1:10.130.0.3"}

    def do_GET(self):
        key = self.path.rsplit("/", 1)[-1]
        known = self.path.startswith("/computeMetadata/v1/instance/attributes/") and key in self.attributes
        if self.headers.get("Metadata-Flavor") != "Google" or not known:
            self.send_error(404)
            return
        body = self.attributes[key].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_slice_hosts_from_the_metadata_server(monkeypatch):
    """An HTTP server on 127.0.0.1 answers as the metadata server does ($GCE_METADATA_IP points
    JAX and this package at it): the two workers count; an attribute it lacks is None. This machine
    is no TPU VM, so the detection itself asks nothing and a run stays on one process, whatever the
    variables say."""
    server = http.server.HTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{server.server_port}")
        assert distributed.tpu_slice_hosts({}, distributed.gce_metadata) == 2
        assert distributed.gce_metadata("agent-worker-number") is None
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1v-n-0,t1v-n-1")
    assert not distributed.on_cloud_tpu_vm() and distributed.slice_hosts() == 1
    distributed.maybe_initialize()
    import jax

    assert not jax.distributed.is_initialized()


class SigtermAfter:
    """stderr that sends this process a SIGTERM once a line starting with ``line`` is written (the
    loop's progress line of a step: the event the test waits for)."""

    def __init__(self, stream, line: str):
        self.stream, self.line, self.sent = stream, line, False

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        if not self.sent and text.startswith(self.line):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return written

    def __getattr__(self, name):
        return getattr(self.stream, name)


@pytest.mark.slow
def test_one_process_stops_at_sigterm_saves_that_step_and_the_rerun_resumes(tmp_path, monkeypatch):
    """One process, no jax.distributed: a SIGTERM as step 1's progress line is written stops the
    loop at the end of that step, with checkpoint 1 saved (run.checkpoint_every=0: no other) and
    the one line; the same config again resumes there and finishes (step 2, the last)."""
    # the smoke config's shapes otherwise: the programs the session's other smoke runs compiled
    overrides = [f"run.output_dir={tmp_path}", "run.steps=2", "run.checkpoint_every=0"]
    config = load_config(SMOKE, [*overrides, "run.progress=true", "run.log_every=1"])
    monkeypatch.setattr(sys, "stderr", SigtermAfter(sys.stderr, "qarl: step 1/2"))
    with pytest.raises(Preempted) as stopped:
        train(config)
    monkeypatch.undo()
    assert stopped.value.exit_code == PREEMPTED
    assert one_line(stopped.value) == (
        f"qarl: preempted: every process stopped after step 1 and saved it in "
        f"{tmp_path / 'checkpoints' / '1'}; run the same command again to resume from there"
    )
    assert [m["step"] for m in rows(tmp_path)] == [0, 1]
    result = train(config)
    assert result.summary["resumed_from"] == 1
    assert [m["step"] for m in rows(tmp_path)] == [0, 1, 2]
