"""The CLI: trains on the smoke config and exports, rejects bad configuration (exit 2) and refuses a
checkpoint from another config (exit 3), naming the key or the directory."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import smoke_run

from qarl_jax.config import load_config, to_dict
from qarl_jax.main import main
from qarl_jax.models import from_pretrained
from qarl_jax.rl.train_step import TrainState
from qarl_jax.run.checkpoint import Checkpointer
from qarl_jax.tools.export import export_checkpoint

SMOKE = str(pathlib.Path(__file__).parents[1] / "configs" / "loop_smoke.yaml")


def test_main_refuses_to_replace_an_earlier_runs_logs_unless_asked(tmp_path, capsys):
    """An earlier run's logs without a checkpoint are not replaced unless asked (exit 5, before any
    work); with run.overwrite=true they are: the session's reference run was started that way."""
    (tmp_path / "run" / "tb").mkdir(parents=True)
    (tmp_path / "run" / "tb" / "events.out.tfevents.old").write_text("old")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    again = ["--config", SMOKE, f"run.output_dir={tmp_path / 'run'}", "run.steps=1"]
    assert main(again) == 5
    err = capsys.readouterr().err
    assert "holds an earlier run (metrics.jsonl, tb) but no checkpoint" in err and "run.overwrite=true" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert not (tmp_path / "run" / "config.json").exists()


def test_main_trains_and_exports(reference_run, tmp_path):
    """The session's reference run (tests/smoke_run.py): ``main`` with run.overwrite=true over an
    earlier run's logs, --export-hf and --export-compressed-tensors; what it printed and wrote."""
    run, summary = reference_run.run, reference_run.summary
    assert summary["resumed_from"] == 0 and summary["final"]["step"] == smoke_run.STEPS
    assert 0.0 <= summary["final"]["eval/accuracy"] <= 1.0
    assert (run / "checkpoints" / str(smoke_run.STEPS)).is_dir()
    assert not (run / "tb" / smoke_run.STALE_EVENTS).exists()  # the earlier run's logs replaced
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(smoke_run.STEPS + 1)) and "eval/accuracy" in logged[0]
    model, params, tokenizer = from_pretrained(reference_run.hf)
    assert tokenizer.get_vocab_size() == model.config.vocab_size == 128
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    # the deployed w4a16 weights beside it (tests/test_export_compressed_tensors.py: their bits)
    ct = reference_run.ct
    qconfig = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qconfig["format"] == "pack-quantized" and (ct / "tokenizer.json").exists()
    assert jax.tree.structure(from_pretrained(ct)[1]) == jax.tree.structure(params)
    # the same export, after the run, from its checkpoint: the same bytes
    assert export_checkpoint(run / "checkpoints" / str(smoke_run.STEPS), tmp_path / "ct2") == smoke_run.STEPS
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "ct2" / name).read_bytes() == (ct / name).read_bytes(), name


def test_main_imports_no_heavy_optional_framework():
    # TFDS sources import TensorFlow, the JetStream server JetStream, and the TensorBoard writer
    # (tensorboardX, which imports torch where installed) only when a run uses them
    code = "import sys, qarl_jax.main; print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert not set(json.loads(out.replace("'", '"'))) & {"tensorflow", "jetstream", "tensorboardX", "torch"}


def test_run_compilation_cache_dir_keeps_the_programs_for_the_next_process(tmp_path):
    """run.compilation_cache_dir (when $JAX_COMPILATION_CACHE_DIR names none) is where the CLI's
    compiled programs go: a second process loads them from there instead of compiling (a rerun after
    a kill starts with the killed run's programs)."""
    code = (
        "import sys, jax; from jax import monitoring; from qarl_jax.main import _compilation_cache\n"
        "seen = []; monitoring.register_event_listener(lambda event, **_: seen.append(event))\n"
        "_compilation_cache(sys.argv[1]); jax.jit(lambda x: x * 3 + 1)(2.0)\n"
        "print(sum(e.endswith('/cache_hits') for e in seen), sum(e.endswith('/cache_misses') for e in seen))"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    cmd = [sys.executable, "-c", code, str(tmp_path / "xla")]
    counts = [subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout for _ in "12"]
    assert counts[0].split()[0] == "0" and int(counts[0].split()[1]) > 0, counts  # compiled, stored
    assert counts[1] == f"{counts[0].split()[1]} 0\n", counts  # every one loaded, none compiled
    assert any(p.name.endswith("-cache") for p in (tmp_path / "xla").iterdir())


def test_main_rejects_unknown_key(capsys):
    assert main(["quant.fmtt=w8a8"]) == 2
    assert "unknown config key quant.fmtt" in capsys.readouterr().err


def test_main_refuses_a_foreign_checkpoint(tmp_path, capsys):
    other = to_dict(load_config(SMOKE, ["seed=123"]))
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=1, config=other)
    w = jnp.zeros((2, 2))
    ckpt.save(1, TrainState(params={"w": w}, opt_state={}, step=jnp.asarray(1)), {}, seed=123)
    ckpt.close()
    assert main(["--config", SMOKE, f"run.output_dir={tmp_path}"]) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "run.lock"]  # no config.json
    err = capsys.readouterr().err
    assert (
        f"{tmp_path}/checkpoints/1 was written by a different config" in err
        and "seed: checkpoint 123, now 0 (use" in err
    )


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_naming_the_checkpoint_to_resume(tmp_path, capsys, monkeypatch):
    """SIGINT (what Ctrl-C sends) once the first checkpoint's save has started: exit 130, one line
    naming it. The signal is sent on that event (step 1's save returning), never on a clock: a
    watcher thread polling for the checkpoint directory raced the run, which could finish its steps
    first on a busy host; here 49 steps remain when it arrives."""
    real_save = Checkpointer.save

    def save_then_interrupt(self, step, *args, **kwargs):
        real_save(self, step, *args, **kwargs)
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt here, in the loop

    monkeypatch.setattr(Checkpointer, "save", save_then_interrupt)
    # Ctrl-C's handler as an interactive process has it: a process started in the background (`cmd &`
    # from a script) inherits SIGINT ignored, Python then installs no handler, and the signal was lost
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = ["--config", SMOKE, f"run.output_dir={tmp_path}", "run.steps=50", "run.checkpoint_every=1"]
    try:
        assert main(argv) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"qarl: interrupted; rerun the same command to resume from {tmp_path / 'checkpoints' / '1'}"
    assert (tmp_path / "checkpoints" / "1").is_dir()
    assert (tmp_path / "run.lock").read_text() == ""
