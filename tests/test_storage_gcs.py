"""A run directory in a GCS bucket, against a real GCS API server (fake-gcs-server on 127.0.0.1,
the session's ``gcs_bucket`` fixture): every user path parsed into one type (an unsupported URL is
one line), a training run writing its checkpoints, metrics and TensorBoard events to ``gs://`` and
nothing to a local ``gs:`` folder, the saved state restored exactly and the run resumed from the
bucket, ``verify_checkpoint`` and the damaged-checkpoint fallback there, and the run lock without
``flock``: a second holder refused naming the first, a gone one taken over.

One training step serves the whole module: the session's reference run (tests/smoke_run.py, 4 steps,
checkpoints 2 and 4) uploaded to the bucket and resumed there for a fifth step, which reads its
checkpoint from gs:// and writes a checkpoint, metrics and events there. (This module trained a
2-step run of its own and then a third step: the same programs, ~30 s on two loaded cores.)"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import smoke_run
from etils import epath
from tensorboardX.proto.event_pb2 import Event

from qarl_jax import storage
from qarl_jax.config import load_config, to_dict
from qarl_jax.errors import ConfigError, RunDirError
from qarl_jax.main import main
from qarl_jax.run import rundir
from qarl_jax.run.checkpoint import Checkpointer
from qarl_jax.run.train import train
from qarl_jax.tools import verify_checkpoint
from qarl_jax.tools.export import export_checkpoint

SMOKE = smoke_run.SMOKE


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("runs/x", None),
        ("gs://bkt/runs/x", None),
        ("s3://bkt/x", "run.output_dir s3://bkt/x: s3:// is not a storage this project reads or writes"),
        ("http://host/x", "run.output_dir http://host/x: http:// is not a storage"),
        ("gs:/bkt/x", "run.output_dir gs:/bkt/x: gs:/ is not a storage"),  # a URL that went through pathlib
        ("gs:///x", "run.output_dir gs:///x: no bucket name"),
    ],
)
def test_a_path_is_local_or_gs_and_anything_else_is_one_line(value, error):
    if error is None:
        path = storage.parse(value, "run.output_dir")
        assert os.fspath(path) == value and storage.is_remote(path) == value.startswith("gs://")
        return
    with pytest.raises(ConfigError) as caught:
        storage.parse(value, "run.output_dir")
    assert str(caught.value).startswith(error) and "\n" not in str(caught.value)


def objects(prefix: epath.Path) -> list[str]:
    """Every object under ``prefix``, relative to it."""
    fs = storage.fsspec.filesystem("gcs")
    root = os.fspath(prefix)[len("gs://") :]
    return sorted(name[len(root) + 1 :] for name in fs.find(root))


def events(tb: epath.Path) -> list[Event]:
    """The events of the TensorBoard files in ``tb`` (TFRecord: length, CRC, Event, CRC)."""
    out = []
    for f in sorted(tb.iterdir()):
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            n = int.from_bytes(data[pos : pos + 8], "little")
            out.append(Event.FromString(data[pos + 12 : pos + 12 + n]))
            pos += 12 + n + 4
    return out


@pytest.fixture(scope="module")
def bucket_run(gcs_bucket, reference_run, tmp_path_factory):
    """The reference run copied to ``gs://.../run`` (file by file, but its lock file), then its
    command again with ``run.steps=5`` and a checkpoint every step, from a fresh working directory
    (where a URL turned into a local path would land). Returns the run, the resumed run's result,
    that directory and the copied run's metrics."""
    run = epath.Path(f"{gcs_bucket}/run")
    for f in reference_run.run.rglob("*"):  # its (empty) local lock file is no bucket's lock
        if f.is_file() and f.name != rundir.LOCK_FILE:
            (run / f.relative_to(reference_run.run)).write_bytes(f.read_bytes())
    copied = (run / "metrics.jsonl").read_text()
    cwd, here = os.getcwd(), tmp_path_factory.mktemp("cwd")
    os.chdir(here)
    try:
        more = [f"run.steps={smoke_run.STEPS + 1}", "run.checkpoint_every=1"]
        result = train(load_config(SMOKE, [f"run.output_dir={run}", *smoke_run.OVERRIDES, *more]))
    finally:
        os.chdir(cwd)
    return run, result, here, copied


def test_a_run_in_a_bucket_writes_checkpoints_metrics_and_events_there(bucket_run):
    run, result, cwd, copied = bucket_run
    assert result.summary["run_dir"] == os.fspath(run)
    assert result.summary["resumed_from"] == smoke_run.STEPS  # its checkpoint, read from the bucket
    names = objects(run)
    assert "config.json" in names and "run.lock" not in names  # released at the end
    assert "checkpoints/5/state/manifest.ocdbt" in names, names
    assert "checkpoints/5/commit_success.txt" in names  # orbax's commit mark on GCS
    assert "checkpoints/2/state/manifest.ocdbt" not in names  # run.keep=2: the oldest deleted there
    lines = (run / "metrics.jsonl").read_text()
    assert lines.startswith(copied) and [json.loads(x)["step"] for x in lines.splitlines()] == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    scalars = {(e.step, v.tag) for e in events(run / "tb") for v in e.summary.value}
    assert {(4, "reward_mean"), (5, "reward_mean"), (5, "train/loss")} <= scalars
    assert list(cwd.rglob("gs:*")) == [] and list(cwd.iterdir()) == []  # nothing local at all


def test_the_bucket_checkpoint_restores_the_state_exactly(bucket_run):
    """The state the run saved to the bucket at its last step comes back bit for bit (its resume
    from the bucket: the test above)."""
    run, result, _, _ = bucket_run
    config = load_config(SMOKE, [f"run.output_dir={run}", *smoke_run.OVERRIDES])
    ckpt = Checkpointer(run / "checkpoints", config.run.keep, to_dict(config))
    restored = ckpt.restore(result.state)
    ckpt.close()
    assert restored.step == smoke_run.STEPS + 1
    jax.tree.map(np.testing.assert_array_equal, restored.state.params, result.state.params)
    jax.tree.map(np.testing.assert_array_equal, restored.state.opt_state, result.state.opt_state)


def test_a_run_in_a_bucket_exports_to_a_bucket_as_to_a_disk(bucket_run, gcs_bucket, tmp_path):
    """``tools.export`` (the code of ``--export-hf``/``--export-compressed-tensors``) from
    ``gs://`` to ``gs://`` writes the bytes it writes to a local directory."""
    run, _, _, _ = bucket_run
    step = export_checkpoint(f"{run}/checkpoints/5", f"{gcs_bucket}/export")
    assert step == export_checkpoint(f"{run}/checkpoints/5", tmp_path / "export") == 5
    local = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert objects(epath.Path(f"{gcs_bucket}/export")) == local and "model.safetensors" in local
    for name in local:
        remote = epath.Path(f"{gcs_bucket}/export/{name}")
        assert remote.read_bytes() == (tmp_path / "export" / name).read_bytes(), name


def test_verify_checkpoint_and_the_damaged_checkpoint_fallback_in_a_bucket(bucket_run, capsys):
    run, result, _, _ = bucket_run
    assert verify_checkpoint.main([os.fspath(run)]) == 0
    out = capsys.readouterr().out
    steps = sorted(int(line.rsplit("/", 1)[1]) for line in out.splitlines() if line.startswith("ok "))
    assert len(steps) >= 2, out
    newest = run / "checkpoints" / str(steps[-1])
    data = max(
        (n for n in objects(newest / "state") if "/d/" in n),
        key=lambda n: (newest / "state" / n).stat().length,
    )
    blob = bytearray((newest / "state" / data).read_bytes())
    blob[len(blob) // 3 : len(blob) // 3 + 4096] = bytes(4096)
    (newest / "state" / data).write_bytes(bytes(blob))
    assert verify_checkpoint.main([os.fspath(run)]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {newest}" in out and "array run/" not in out  # an array, not the directory
    config = load_config(SMOKE, [f"run.output_dir={run}"])
    ckpt = Checkpointer(run / "checkpoints", 3, to_dict(config))
    assert ckpt.restore(result.state).step == steps[-2]
    assert ckpt.steps() == steps[:-1][::-1]
    ckpt.close()
    assert str(steps[-1]) in [p.name for p in (run / "checkpoints_damaged").iterdir()]
    assert verify_checkpoint.main([f"{run}/checkpoints/{steps[-2]}"]) == 0


def test_the_bucket_lock_refuses_a_second_holder_and_takes_over_from_a_gone_one(
    gcs_bucket, capfd, monkeypatch
):
    run = epath.Path(f"{gcs_bucket}/locked")
    with rundir.BucketLock(run):
        with pytest.raises(RunDirError, match=rf"in use by another run \(pid {os.getpid()} on host "):
            rundir.BucketLock(run).__enter__()
        # the command: one line, exit 5, before any training
        assert main(["--config", str(SMOKE), f"run.output_dir={run}"]) == 5
        err = capfd.readouterr().err.strip().splitlines()
        assert f"{run} is in use by another run (pid {os.getpid()} on host" in err[-1]
        assert "Traceback" not in "\n".join(err) and objects(run) == [rundir.LOCK_FILE]
    assert not (run / rundir.LOCK_FILE).exists()  # released: deleted
    # a holder killed (SIGKILL) on this host: its pid is not running
    holder = "from qarl_jax import storage; from qarl_jax.run import rundir; import time\n"
    holder += f"rundir.BucketLock(storage.parse('{run}', 'run')).__enter__()\n"
    holder += "print('held', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    proc.kill()
    proc.wait()
    proc.stdout.close()
    with rundir.BucketLock(run):
        assert f"taking over the lock of a run that is gone (pid {proc.pid} on host" in capfd.readouterr().err
    # another host's lock: in use until it goes unrenewed for GONE_AFTER_S
    (run / rundir.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "another-host"}))
    with pytest.raises(
        RunDirError, match=r"in use by another run \(pid 1 on host another-host, its lock renewed"
    ):
        rundir.BucketLock(run).__enter__()
    monkeypatch.setattr(rundir, "GONE_AFTER_S", 0.0)
    with rundir.BucketLock(run):
        assert "gone (pid 1 on host another-host)" in capfd.readouterr().err
