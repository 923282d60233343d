"""Checkpoints: exact resume (after SIGKILL, past a damaged latest checkpoint), keep-N, and clear
errors for corrupt or incompatible checkpoints."""

import dataclasses
import json
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import smoke_run
import stopped_cli

from qarl_jax.config import load_config
from qarl_jax.main import main
from qarl_jax.models import from_pretrained
from qarl_jax.rl.train_step import TrainState
from qarl_jax.run.build import run_checkpoint
from qarl_jax.run.checkpoint import Checkpointer, CheckpointError
from qarl_jax.run.train import train
from qarl_jax.tools import verify_checkpoint

STEPS = smoke_run.STEPS
SMOKE = smoke_run.SMOKE
# evals every 2 steps, as the session's reference run (tests/smoke_run.py) these runs are held to
COMMON = ["run.eval_every=2"]


def run_config(out, overrides=()):
    return load_config(SMOKE, [f"run.output_dir={out}", *COMMON, *overrides])


def metrics_without_timing(run_dir) -> list[dict]:
    lines = pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "grader/"))}
        for line in lines
    ]


def damage(step_dir: pathlib.Path) -> None:
    """4 KB zeroed and 24 bytes flipped in the largest array file of a checkpoint's state."""
    f = max(
        (p for p in (step_dir / "state").rglob("*") if p.parent.name == "d"), key=lambda p: p.stat().st_size
    )
    data = bytearray(f.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 4096] = bytes(4096)
    for i in range(2 * len(data) // 3, 2 * len(data) // 3 + 24):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_resumes_exactly(reference_run, tmp_path, tmp_path_factory, capfd):
    """The CLI run is killed mid-run (frozen as it starts checkpoint 3's save: 1 and 2 committed),
    and its latest committed checkpoint is then damaged (4 KB zeroed, 24 bytes flipped in a data
    file): verify_checkpoint names it, and the same command again (``main``, in this process) takes
    over the lock, names it, resumes from the one before and redoes the steps since: the
    uninterrupted run's metrics, exported weights, parameters and optimizer state, bit for bit (the
    session's reference run). Both runs load the reference run's compiled programs from the
    session's compilation cache ($JAX_COMPILATION_CACHE_DIR wins over run.compilation_cache_dir;
    that setting's own check is tests/test_main.py's)."""
    ref_dir = reference_run.run
    assert any(m["train/grad_norm"] > 0 for m in metrics_without_timing(ref_dir)[1:])  # it learned
    export = tmp_path / "hf"
    args = ["--config", str(SMOKE), f"run.output_dir={tmp_path}", *COMMON]
    args += [f"run.steps={STEPS}", "run.checkpoint_every=1", f"--export-hf={export}"]
    proc = stopped_cli.start_and_stop(args, 3, tmp_path_factory.mktemp("log") / "stderr")
    metrics = tmp_path / "metrics.jsonl"
    # a second run on the same directory refuses, naming the first, and leaves its metrics alone
    before = metrics.read_text()
    assert main([f"--config={SMOKE}", f"run.output_dir={tmp_path}", *COMMON, f"run.steps={STEPS}"]) == 5
    assert f"in use by another run (pid {proc.pid} on host" in capfd.readouterr().err
    assert metrics.read_text().startswith(before)
    stopped_cli.kill(proc)
    assert list(export.iterdir()) == []  # checked writable (created) before the run; written only at its end
    checkpoints = tmp_path / "checkpoints"
    committed = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert committed[-2:] in ([1, 2], [2, 3]), committed  # 3 too if its save ended before the stop
    latest, previous = committed[-1], committed[-2]
    damage(checkpoints / str(latest))
    assert verify_checkpoint.main([str(tmp_path)]) == 1
    assert f"DAMAGED {checkpoints}/{latest}" in capfd.readouterr().out
    assert main(args) == 0
    out, err = capfd.readouterr()
    assert f"taking over the lock of a run that is gone (pid {proc.pid} on host" in err
    assert (
        f"damaged checkpoint: {checkpoints}/{latest}" in err
        and f"resuming from {checkpoints}/{previous}" in err
    )
    assert json.loads(out)["resumed_from"] == previous
    assert metrics_without_timing(tmp_path) == metrics_without_timing(ref_dir)
    _, params, _ = from_pretrained(export)
    jax.tree.map(np.testing.assert_array_equal, params, from_pretrained(reference_run.hf)[1])
    resumed, ref = (
        smoke_run.final_state(r) for r in (dataclasses.replace(reference_run, run=tmp_path), reference_run)
    )
    jax.tree.map(np.testing.assert_array_equal, resumed.params, ref.params)
    jax.tree.map(np.testing.assert_array_equal, resumed.opt_state, ref.opt_state)
    assert verify_checkpoint.main([str(tmp_path)]) == 0


def _state(value: float) -> TrainState:
    params = {"w": jnp.full((4, 8), value, jnp.float32)}
    return TrainState(params=params, opt_state={"mu": params["w"] * 0.5}, step=jnp.asarray(3, jnp.int32))


def test_keep_n_and_round_trip(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2, config={"seed": 0, "run": {"steps": 9}})
    for step in (1, 2, 3):
        ckpt.save(step, _state(float(step)), {"grain": step}, seed=0)
    ckpt.close()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 3]
    # a changed run section (more steps) may resume
    restored = Checkpointer(tmp_path, keep=2, config={"seed": 0, "run": {"steps": 20}}).restore(_state(0.0))
    assert restored.step == 3 and restored.data_state == {"grain": 3} and restored.meta["seed"] == 0
    np.testing.assert_array_equal(restored.state.params["w"], np.full((4, 8), 3.0, np.float32))


def test_incompatible_config_is_refused_naming_the_directory(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=1, config={"seed": 0, "optimizer": {"learning_rate": 0.1}})
    ckpt.save(1, _state(1.0), {}, seed=0)
    ckpt.close()
    other = Checkpointer(tmp_path, keep=1, config={"seed": 0, "optimizer": {"learning_rate": 0.2}})
    with pytest.raises(
        CheckpointError, match=rf"{tmp_path}/1 was written by a different config.*learning_rate"
    ):
        other.restore(_state(0.0))


def test_shape_mismatch_is_an_error(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=1, config={})
    ckpt.save(1, _state(1.0), {}, seed=0)
    ckpt.close()
    other = TrainState(
        params={"w": jnp.zeros((2, 2))}, opt_state={"mu": jnp.zeros((2, 2))}, step=jnp.asarray(0)
    )
    with pytest.raises(CheckpointError, match=rf"{tmp_path}/1: cannot restore"):
        Checkpointer(tmp_path, keep=1, config={}).restore(other)


def test_a_training_run_or_one_of_its_steps_exports_for_serving(reference_run, tmp_path):
    """``serve --checkpoint RUN`` (or ``RUN/checkpoints/N``) exports the policy first: the newest
    intact checkpoint's weights, as ``--export-hf`` writes them."""
    from qarl_jax import serve

    ref_dir = reference_run.run
    assert serve.export_run(*run_checkpoint(ref_dir), tmp_path / "latest") == STEPS
    _, params, tokenizer = from_pretrained(tmp_path / "latest")
    jax.tree.map(np.testing.assert_array_equal, params, from_pretrained(reference_run.hf)[1])
    assert tokenizer is not None and run_checkpoint(ref_dir / "checkpoints" / "2") == (ref_dir, 2)


def test_rerun_of_a_finished_run_says_so_and_shows_its_final_metrics(reference_run, tmp_path, capsys):
    """The same command again after the last step: nothing trains, a line says the run had finished,
    and the summary's ``final`` is the last step's logged metrics (it was ``{}``)."""
    ref_dir = reference_run.run
    run = tmp_path / "run"
    shutil.copytree(ref_dir, run)
    again = train(run_config(run, [f"run.steps={STEPS}", "run.checkpoint_every=2"]))
    assert again.summary["resumed_from"] == STEPS
    assert again.summary["final"] == json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert f"{run}: already finished at step {STEPS}" in capsys.readouterr().err
    assert metrics_without_timing(run) == metrics_without_timing(ref_dir)  # nothing appended


def test_late_reads_of_a_failed_restore_are_not_reported(capsys, monkeypatch):
    """A read that completes after orbax closed its event loop raises "Event loop is closed" in
    TensorStore's thread, reported through sys.unraisablehook (700 lines of tracebacks after one
    damaged checkpoint); those reports are dropped, any other still reaches the previous hook."""
    import asyncio
    import types

    from qarl_jax.run.checkpoint import quiet_late_read_callbacks

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    quiet_late_read_callbacks()
    quiet_late_read_callbacks()  # idempotent: one filter, not a chain of them

    def report(error):
        tb = error.__traceback__
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=tb))

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)  # what TensorStore's thread does for a late read
    except RuntimeError as e:
        report(e)
    try:
        raise RuntimeError("Event loop is closed")  # the same words from elsewhere: reported
    except RuntimeError as e:
        report(e)
    assert [str(u.exc_value) for u in seen] == ["Event loop is closed"] and seen[
        0
    ].exc_traceback.tb_next is None
