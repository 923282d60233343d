"""Nothing lost, nothing silent: checkpoint fingerprints, damaged checkpoints, the run-directory
lock and resume decision, counted data loss, graders held to [0, 1], dtype objects, and one-line
errors (exit code, message, files left) from the CLI for every bad input it can check up front."""

import dataclasses
import json
import pathlib
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qarl_jax.data import DataConfig, SyntheticConfig, build_arithmetic_tokenizer, build_pipeline
from qarl_jax.data.jsonl import JsonlSource
from qarl_jax.errors import CheckpointError, DataError, GraderError, RunDirError
from qarl_jax.main import main
from qarl_jax.models import (
    Qwen3ForCausalLM,
    from_pretrained,
    init_params,
    preset,
    save_pretrained,
)
from qarl_jax.rewards import Grader
from qarl_jax.rl.train_step import TrainState
from qarl_jax.run import rundir
from qarl_jax.run.checkpoint import Checkpointer, fingerprints
from qarl_jax.run.runlog import MetricsLog
from qarl_jax.tools import verify_checkpoint

SMOKE = str(pathlib.Path(__file__).parents[1] / "configs" / "loop_smoke.yaml")


def _state(seed: int) -> TrainState:
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((128, 512)), jnp.float32)
    return TrainState(params={"w": w, "b": jnp.ones(3)}, opt_state={"nu": w * w}, step=jnp.asarray(seed))


def data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """The step's array data files, largest first (orbax's OCDBT chunk files)."""
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    return sorted(files, key=lambda f: f.stat().st_size, reverse=True)


def damage(step_dir: pathlib.Path) -> None:
    """4 KB zeroed inside the largest data file, 24 bytes XOR-flipped further on."""
    f = data_files(step_dir)[0]
    data = bytearray(f.read_bytes())
    mid = len(data) // 3
    data[mid : mid + 4096] = bytes(4096)
    for i in range(2 * len(data) // 3, 2 * len(data) // 3 + 24):
        data[i] ^= 0x5A
    f.write_bytes(bytes(data))


def test_fingerprints_catch_flips_zeros_and_swaps_whatever_the_sharding():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 64)), jnp.float32)
    base = fingerprints({"x": x})["x"]["fingerprint"]
    flipped = x.view(jnp.uint32).at[3, 5].set(x.view(jnp.uint32)[3, 5] ^ 1).view(jnp.float32)
    changed = [flipped, x.at[2, 8:24].set(0.0), x.at[jnp.array([0, 1])].set(x[jnp.array([1, 0])])]
    assert all(fingerprints({"x": c})["x"]["fingerprint"] != base for c in changed)
    mesh = jax.make_mesh((8,), ("d",))
    sharded = jax.device_put(x, NamedSharding(mesh, P("d", None)))
    assert fingerprints({"x": sharded})["x"]["fingerprint"] == base
    bf16 = fingerprints({"y": x.astype(jnp.bfloat16), "i": jnp.arange(3, dtype=jnp.int8)})
    assert {v["dtype"] for v in bf16.values()} == {"bfloat16", "int8"}


def test_damaged_latest_checkpoint_is_named_and_the_previous_one_restored(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3, config={"seed": 0})
    for step in (1, 2):
        ckpt.save(step, _state(step), {"grain": step}, seed=0)
    ckpt.close()
    assert verify_checkpoint.main([str(tmp_path)]) == 0
    damage(tmp_path / "checkpoints" / "2")
    assert verify_checkpoint.main([str(tmp_path / "checkpoints" / "2")]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {tmp_path}/checkpoints/2/state: array " in out and "cannot be read back" in out
    restored = Checkpointer(tmp_path / "checkpoints", keep=3, config={"seed": 0}).restore(_state(0))
    assert restored.step == 1 and restored.data_state == {"grain": 1}
    jax.tree.map(np.testing.assert_array_equal, restored.state, _state(1))
    err = capsys.readouterr().err
    assert f"damaged checkpoint: {tmp_path}/checkpoints/2" in err and "resuming from" in err
    assert (tmp_path / "checkpoints_damaged" / "2").is_dir() and not (tmp_path / "checkpoints" / "2").exists()
    # the last one's metadata garbage (the other way a checkpoint breaks): none left to restore
    manifests = [f for f in (tmp_path / "checkpoints" / "1" / "state").rglob("*manifest*") if f.is_file()]
    assert manifests
    for f in manifests:
        f.write_bytes(b"garbage")
    with pytest.raises(
        CheckpointError, match=rf"every checkpoint is damaged \({tmp_path}/checkpoints/1: cannot restore"
    ):
        Checkpointer(tmp_path / "checkpoints", keep=3, config={"seed": 0}).restore(_state(0))


def test_a_checkpoint_that_decodes_to_other_values_is_caught_by_its_fingerprints(tmp_path, capsys):
    """A bad copy: step 1's array files in place of step 2's decode without error (same shapes) but
    are not what step 2 saved."""
    import shutil

    ckpt = Checkpointer(tmp_path, keep=3, config={})
    for step in (1, 2):
        ckpt.save(step, _state(step), {}, seed=0)
    ckpt.close()
    shutil.rmtree(tmp_path / "2" / "state")
    shutil.copytree(tmp_path / "1" / "state", tmp_path / "2" / "state")
    assert verify_checkpoint.main([str(tmp_path / "2")]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path}/2/state: 3 of 4 arrays differ from what was saved" in out
    assert all(name in out for name in ("params.w", "opt_state.nu", "step")) and "params.b" not in out


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path, capsys):
    with rundir.RunLock(tmp_path):
        with pytest.raises(
            RunDirError, match=rf"in use by another run \(pid \d+ on host {socket.gethostname()}\)"
        ):
            rundir.RunLock(tmp_path).__enter__()
    assert (tmp_path / rundir.LOCK_FILE).read_text() == ""  # released: empty
    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "gone"}))  # a killed run's
    with rundir.RunLock(tmp_path):
        pass
    assert "taking over the lock of a run that is gone (pid 999999 on host gone)" in capsys.readouterr().err


def test_torn_last_metrics_line_is_cut_on_resume(tmp_path, capsys):
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "lo')
    MetricsLog(tmp_path, 2, tensorboard=False).close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines
    assert "metrics.jsonl:4: cutting a torn last line" in capsys.readouterr().err


def test_wandb_sink_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(tmp_path, 0, tensorboard=False, wandb={"project": "qarl-test", "name": None})
    log.write({"step": 1, "reward_mean": 0.5, "note": "text"})
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_wandb_is_not_imported_unless_asked():
    import subprocess
    import sys

    code = "import sys, qarl_jax.run.train, qarl_jax.run.runlog; print('wandb' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    )


def write_jsonl(path: pathlib.Path, rows: list) -> pathlib.Path:
    path.write_bytes(b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows) + b"\n")
    return path


def test_data_loss_is_counted_by_reason_and_a_threshold_stops_naming_file_and_limit(tmp_path, caplog):
    good = [{"question": "1+1=", "answer": "#### 2"}, {"question": "2+2=", "answer": "#### 4"}]
    bad = [b"{broken", b"\xff\xfe", {"question": " ", "answer": "#### 1"}, {"q": 1}, [1], b"nope"]
    path = write_jsonl(tmp_path / "rows.jsonl", good + bad)
    tok = build_arithmetic_tokenizer()
    it = build_pipeline(DataConfig(source="jsonl", path=str(path), batch_size=2), tok)
    next(it)
    assert it.skipped_by_category() == {"malformed": 4, "too_long": 0, "empty": 1, "undecodable": 1}
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert f"{path}:3" in caplog.records[0].message
    with pytest.raises(
        DataError, match=rf"{path}: only 2 of 8 rows are valid, below data.min_valid_fraction=0.5"
    ):
        build_pipeline(DataConfig(source="jsonl", path=str(path), min_valid_fraction=0.5), tok)
    few = DataConfig(max_prompt_tokens=25, min_valid_fraction=0.99, synthetic=SyntheticConfig(size=40))
    with pytest.raises(DataError, match=r"synthetic: \d+ of the \d+ rows drawn were skipped.*=0.99"):
        rows = build_pipeline(few, tok)
        for _ in range(40):
            next(rows)  # over-long rows only show while iterating
    long = DataConfig(source="jsonl", path=str(path), max_prompt_tokens=3)
    with pytest.raises(DataError, match=rf"{path}: a whole epoch of rows was rejected.*max_prompt_tokens=3"):
        build_pipeline(long, tok)


def test_evals_never_see_training_rows(tmp_path):
    from qarl_jax.run.build import eval_set, training_data

    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a in range(10) for b in range(10)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    data = DataConfig(source="jsonl", path=str(path), batch_size=4)
    tok = build_arithmetic_tokenizer()
    train_src = JsonlSource(path, hash_split=training_data(data).hash_split)
    held_out = eval_set(data, 4, tok)
    assert not set(held_out["prompt"]) & {train_src[i]["prompt"] for i in range(len(train_src))}
    one = write_jsonl(tmp_path / "one.jsonl", rows[:1])
    with pytest.raises(DataError, match="data.eval_path"):
        for d in (
            training_data(DataConfig(source="jsonl", path=str(one))),
            DataConfig(source="jsonl", path=str(one)),
        ):
            build_pipeline(d, tok) if d.hash_split else eval_set(d, 4, tok)
    separate = write_jsonl(tmp_path / "eval.jsonl", [{"question": "9*9=", "answer": "#### 81"}])
    held_out = eval_set(DataConfig(source="jsonl", path=str(one), eval_path=str(separate)), 2, tok)
    assert set(held_out["prompt"]) == {"9*9="}


def _nan(response, answer, timeout_s):
    return float("nan")


def _five(response, answer, timeout_s):
    return 5.0


@pytest.mark.parametrize("fn", [_nan, _five])
def test_grader_scores_outside_0_1_name_the_grader(fn):
    with (
        Grader(1, graders={"synthetic": fn}) as grader,
        pytest.raises(GraderError, match=rf"grader 'synthetic' \(.*{fn.__name__}\)"),
    ):
        grader.grade(["x"], ["1"], "synthetic")


def test_dtype_objects_are_accepted(tmp_path):
    config = preset("qwen3-tiny", param_dtype=jnp.bfloat16, dtype=np.float32)
    assert (config.param_dtype, config.dtype) == ("bfloat16", "float32")
    save_pretrained(
        tmp_path, preset("qwen3-tiny"), init_params(Qwen3ForCausalLM(preset("qwen3-tiny")), jax.random.key(0))
    )
    model, params, _ = from_pretrained(tmp_path, dtype=jnp.float32, compute_dtype=jnp.dtype("bfloat16"))
    assert model.config.dtype == "bfloat16" and jax.tree.leaves(params)[0].dtype == jnp.float32
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        dataclasses.replace(config, param_dtype=jnp.int8)


def _bad_model_dir(tmp_path):
    d = tmp_path / "mistral"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"], "vocab_size": 8}))
    return d


def _bad_jsonl(tmp_path):
    return write_jsonl(tmp_path / "bad.jsonl", [b"{", b"\xff"])


CASES = {  # name -> (overrides given tmp_path, exit code, words of the message)
    "unknown architecture": (
        lambda t: [f"model.path={_bad_model_dir(t)}"],
        3,
        ["unsupported architecture", "MistralForCausalLM"],
    ),
    "model.path missing": (lambda t: [f"model.path={t}/nope"], 2, ["model.path", "no such directory"]),
    "negative seed": (lambda t: ["seed=-1"], 2, ["seed must be >= 0"]),
    "run=5": (lambda t: ["run=5", "run.steps=2"], 2, ["run was given a value"]),
    "bad YAML": (lambda t: ["run.steps=[1,"], 2, ["run.steps=[1,", "not valid YAML"]),
    "mesh too big": (lambda t: ["mesh.fsdp=16"], 2, ["mesh:", "device(s) here"]),
    "missing JSONL": (
        lambda t: ["data.source=jsonl", f"data.path={t}/none.jsonl"],
        4,
        ["none.jsonl does not exist"],
    ),
    "JSONL is a directory": (lambda t: ["data.source=jsonl", f"data.path={t}"], 4, ["is a directory"]),
    "all-bad JSONL": (
        lambda t: ["data.source=jsonl", f"data.path={_bad_jsonl(t)}"],
        4,
        ["bad.jsonl", "no valid rows"],
    ),
    "output_dir a file": (
        lambda t: [f"run.output_dir={_bad_jsonl(t)}"],
        5,
        ["exists and is not a directory"],
    ),
    "output_dir empty": (lambda t: ["run.output_dir="], 2, ["output_dir is empty"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cli_bad_input_is_one_line_before_any_work(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make, code, words = CASES[name]
    overrides = make(tmp_path)
    if not any(o.startswith("run.output_dir") for o in overrides):
        overrides.append(f"run.output_dir={tmp_path}/run")
    assert main(["--config", SMOKE, *overrides]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and all(w in err[-1] for w in words), err[-1]
    assert not (tmp_path / "run").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_print_config_and_help(capsys):
    import yaml

    assert main(["--config", SMOKE, "--print-config", "run.steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (
        printed["run"]["steps"] == 7
        and printed["data"]["batch_size"] == 4
        and "learning_rate" in printed["optimizer"]
    )
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--print-config" in capsys.readouterr().out
