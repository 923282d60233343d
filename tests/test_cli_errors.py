"""Every command over a table of bad inputs: each ends with the exit code of its kind of fault
(:data:`qarl_jax.cli.EXIT_CODES`, the same in every command) and one stderr line naming the key,
file or value at fault, before any work (no traceback, nothing trained, nothing written where it
should not be). In process (each command's ``main(argv)``), except two that go through the real
``python -m`` exit path."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import REPO

SMOKE = str(REPO / "configs" / "loop_smoke.yaml")
# status lines a command may print before it fails (progress, not the fault)
STATUS = ("qarl: starting", "sft: writing")


def unwritable(t: pathlib.Path) -> pathlib.Path:
    """A directory no file can be created in, also for root (permission bits do not stop root)."""
    if os.geteuid() == 0:
        return pathlib.Path("/sys/qarl-test-unwritable")  # sysfs refuses new entries to everyone
    d = t / "read-only"
    d.mkdir()
    d.chmod(0o500)
    return d


def a_file(t: pathlib.Path) -> pathlib.Path:
    f = t / "a-file"
    f.write_text("not a directory\n")
    return f


def bad_yaml(t: pathlib.Path) -> pathlib.Path:
    f = t / "bad.yaml"
    f.write_text("run:\n  steps: [1, 2\n  keep: 3\n")
    return f


def mistral(t: pathlib.Path) -> pathlib.Path:
    d = t / "mistral"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"], "vocab_size": 8}))
    return d


def hidden_192(t: pathlib.Path) -> pathlib.Path:
    """A Qwen2 config.json of hidden size 192 (6 heads of 32): 128 does not divide its K."""
    from qarl_jax.models import preset
    from qarl_jax.models.hf_io import config_to_hf

    arch = preset("qwen3-tiny").replace(
        family="qwen2", hidden_size=192, num_attention_heads=6, num_key_value_heads=2
    )
    d = t / "hidden192"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_to_hf(arch)))
    return d


def no_valid_rows(t: pathlib.Path) -> pathlib.Path:
    f = t / "bad.jsonl"
    f.write_bytes(b"{\n\xff\n")
    return f


def a_run(t: pathlib.Path) -> pathlib.Path:
    d = t / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n{"step": 1, "reward_mean": 0.5}\n')
    return d


MAIN, SFT, ALIGN, PLAN = (
    "qarl_jax.main",
    "qarl_jax.sft",
    "qarl_jax.tools.check_alignment",
    "qarl_jax.tools.memory_plan",
)
PLOT, VERIFY, SERVE = "qarl_jax.tools.plot_runs", "qarl_jax.tools.verify_checkpoint", "qarl_jax.serve"
REPLICATE, REGIME = "qarl_jax.experiments.replicate", "qarl_jax.experiments.regime"
RUN = lambda t: f"run.output_dir={t}/out"  # noqa: E731

# name -> (module, argv given tmp_path, exit code, words the one line must hold)
CASES = {
    "main: --config a directory": (
        MAIN,
        lambda t: ["--config", str(t)],
        2,
        ["config file", "is a directory"],
    ),
    "main: malformed YAML": (
        MAIN,
        lambda t: ["--config", str(bad_yaml(t))],
        2,
        ["bad.yaml", "invalid YAML", "line 3"],
    ),
    "main: output_dir a file": (
        MAIN,
        lambda t: ["--config", SMOKE, f"run.output_dir={a_file(t)}"],
        5,
        ["a-file", "not a directory"],
    ),
    "main: output_dir under a file": (
        MAIN,
        lambda t: ["--config", SMOKE, f"run.output_dir={a_file(t)}/run"],
        5,
        ["a-file", "is a file"],
    ),
    "main: output_dir unwritable": (
        MAIN,
        lambda t: ["--config", SMOKE, f"run.output_dir={unwritable(t)}/run"],
        5,
        ["qarl-test-unwritable" if os.geteuid() == 0 else "read-only"],
    ),
    "main: --export-hf under a file": (
        MAIN,
        lambda t: ["--config", SMOKE, RUN(t), "--export-hf", f"{a_file(t)}/hf"],
        5,
        ["--export-hf", "a-file"],
    ),
    # issue 48: an export no server runs is refused before training (vLLM's compressed-tensors
    # schemes and Marlin's MARLIN_SUPPORTED_GROUP_SIZES), and nothing is written
    "main: --export-compressed-tensors w4a8": (
        MAIN,
        lambda t: ["--config", SMOKE, RUN(t), "quant.fmt=w4a8", "--export-compressed-tensors", f"{t}/ct"],
        2,
        ["quant.fmt='w4a8'", "no GPU server runs", "w4a16, w8a8, fp8"],
    ),
    "main: --export-compressed-tensors group 96": (
        MAIN,
        lambda t: [
            *("--config", SMOKE, RUN(t)),
            "quant.group_size=96",
            "--export-compressed-tensors",
            f"{t}/ct",
        ],
        2,
        ["quant.group_size=96", "Marlin", "32, 64, 128"],
    ),
    # a URL this project cannot write is refused, never made into a local folder named "s3:"
    "main: output_dir s3://": (
        MAIN,
        lambda t: ["--config", SMOKE, "run.output_dir=s3://b/run"],
        2,
        ["s3://"],
    ),
    "main: --export-hf http://": (
        MAIN,
        lambda t: ["--config", SMOKE, RUN(t), "--export-hf", "http://host/hf"],
        2,
        ["--export-hf", "http:// is not a storage"],
    ),
    "verify_checkpoint: gs:/ (a URL through pathlib)": (VERIFY, lambda t: ["gs:/b/run"], 2, ["gs:/b/run"]),
    "main: --config swallows an override": (
        MAIN,
        lambda t: ["--config", "run.steps=3"],
        2,
        ["--config", "'run.steps=3'", "override"],
    ),
    "main: --num-processes 0": (
        MAIN,
        lambda t: ["--num-processes", "0"],
        2,
        ["--num-processes", "must be >= 1"],
    ),
    "main: empty model.path": (
        MAIN,
        lambda t: ["--config", SMOKE, RUN(t), "model.path="],
        2,
        ["model.path is empty"],
    ),
    "main: unsupported architecture": (
        MAIN,
        lambda t: ["--config", SMOKE, RUN(t), f"model.path={mistral(t)}"],
        3,
        ["MistralForCausalLM"],
    ),
    "main: JSONL with no valid rows": (
        MAIN,
        lambda t: ["--config", SMOKE, RUN(t), "data.source=jsonl", f"data.path={no_valid_rows(t)}"],
        4,
        ["bad.jsonl", "no valid rows"],
    ),
    "sft: empty model.path": (
        SFT,
        lambda t: [f"output_dir={t}/sft", "model.path="],
        2,
        ["model.path is empty"],
    ),
    "sft: unsupported architecture": (
        SFT,
        lambda t: [f"output_dir={t}/sft", f"model.path={mistral(t)}"],
        3,
        ["MistralForCausalLM"],
    ),
    "sft: output_dir a file": (
        SFT,
        lambda t: [f"output_dir={a_file(t)}"],
        5,
        ["output_dir", "not a directory"],
    ),
    "sft: output_dir unwritable": (
        SFT,
        lambda t: [f"output_dir={unwritable(t)}/sft"],
        5,
        ["output_dir", "cannot create" if os.geteuid() == 0 else "not writable"],
    ),
    "sft: malformed YAML": (SFT, lambda t: ["--config", str(bad_yaml(t))], 2, ["bad.yaml", "invalid YAML"]),
    "sft: unknown key": (SFT, lambda t: ["stepz=3"], 2, ["unknown config key stepz"]),
    "check_alignment: --config a directory": (ALIGN, lambda t: ["--config", str(t)], 2, ["is a directory"]),
    "check_alignment: malformed YAML": (ALIGN, lambda t: ["--config", str(bad_yaml(t))], 2, ["invalid YAML"]),
    "check_alignment: unsupported architecture": (
        ALIGN,
        lambda t: [f"model.path={mistral(t)}", "--json"],
        3,
        ["MistralForCausalLM"],
    ),
    "memory_plan: --hbm-gb 0": (
        PLAN,
        lambda t: ["--config", SMOKE, "--hbm-gb", "0"],
        2,
        ["--hbm-gb", "must be > 0"],
    ),
    "memory_plan: --devices 0": (
        PLAN,
        lambda t: ["--config", SMOKE, "--devices", "0"],
        2,
        ["--devices", "must be >= 1"],
    ),
    "memory_plan: --per-host 0": (PLAN, lambda t: ["--config", SMOKE, "--per-host", "0"], 2, ["--per-host"]),
    "memory_plan: --preset swallows an override": (
        PLAN,
        lambda t: ["--preset", "quant.fmt=w8a8"],
        2,
        ["--preset", "override"],
    ),
    "memory_plan: malformed YAML": (PLAN, lambda t: ["--config", str(bad_yaml(t))], 2, ["invalid YAML"]),
    "plot_runs: --smooth 0": (
        PLOT,
        lambda t: [str(a_run(t)), "--out", f"{t}/f.png", "--smooth", "0"],
        2,
        ["--smooth", "must be >= 1"],
    ),
    "plot_runs: --out x.xyz": (PLOT, lambda t: [str(a_run(t)), "--out", f"{t}/x.xyz"], 5, ["x.xyz", ".png"]),
    "plot_runs: --out unwritable": (
        PLOT,
        lambda t: [str(a_run(t)), "--out", f"{unwritable(t)}/f.png"],
        5,
        ["--out"],
    ),
    "plot_runs: --out under a file": (
        PLOT,
        lambda t: [str(a_run(t)), "--out", f"{a_file(t)}/f.png"],
        5,
        ["a-file"],
    ),
    "plot_runs: no such run": (
        PLOT,
        lambda t: [f"{t}/nope", "--out", f"{t}/f.png"],
        4,
        ["nope", "no such run directory"],
    ),
    "verify_checkpoint: no such directory": (
        VERIFY,
        lambda t: [f"{t}/nope"],
        3,
        ["nope", "no such directory"],
    ),
    "verify_checkpoint: no checkpoints": (VERIFY, lambda t: [str(t)], 3, ["no checkpoint steps"]),
    "serve: --port -1": (
        SERVE,
        lambda t: ["--checkpoint", str(t), "--port", "-1"],
        2,
        ["--port", "must be >= 0"],
    ),
    "serve: --port 70000": (
        SERVE,
        lambda t: ["--checkpoint", str(t), "--port", "70000"],
        2,
        ["--port", "0..65535"],
    ),
    "serve: --slots 0": (SERVE, lambda t: ["--checkpoint", str(t), "--slots", "0"], 2, ["--slots"]),
    "serve: no such checkpoint": (
        SERVE,
        lambda t: ["--checkpoint", f"{t}/nope", "--port", "0"],
        3,
        ["nope", "no such file"],
    ),
    "serve: not a model": (
        SERVE,
        lambda t: ["--checkpoint", str(t), "--port", "0"],
        3,
        ["neither a Hugging Face model directory"],
    ),
    "main: a group size a projection's K cannot take": (  # refused before the run directory
        MAIN,
        lambda t: ["--config", SMOKE, RUN(t), f"model.path={hidden_192(t)}", "quant.group_size=128"],
        2,
        ["q_proj (attention projection, K=192)", "quant.group_size=128", "divides 192"],
    ),
    "replicate: --out a file": (
        REPLICATE,
        lambda t: ["--out", str(a_file(t)), "--quick"],
        5,
        ["--out", "a-file"],
    ),
    "replicate: the default --out lacks a run": (  # the committed study is never trained into
        REPLICATE,
        lambda t: ["--arms", "bf16", "--seeds", "7"],
        2,
        ["results/replication", "no bf16 seed 7 run", "--out DIR"],
    ),
    "regime: the default --out lacks a cell": (
        REGIME,
        lambda t: ["--lengths", "steps12", "--formats", "w8a8"],
        2,
        ["results/replication_long", "no steps12-w8a8 run", "--out DIR"],
    ),
    "replicate: unknown arm": (REPLICATE, lambda t: ["--arms", "fp8"], 2, ["unknown arm 'fp8'"]),
    "replicate: --seeds x": (REPLICATE, lambda t: ["--seeds", "x"], 2, ["--seeds"]),
    "replicate: unknown key": (
        REPLICATE,
        lambda t: ["--out", f"{t}/r", "run.stepz=1"],
        2,
        ["unknown config key run.stepz"],
    ),
    "replicate: malformed YAML": (
        REPLICATE,
        lambda t: ["--config", str(bad_yaml(t)), "--out", f"{t}/r"],
        2,
        ["invalid YAML"],
    ),
    "replicate: JSONL with no valid rows": (
        REPLICATE,
        lambda t: [
            "--config",
            SMOKE,
            "--out",
            f"{t}/r",
            "--arms",
            "bf16",
            "--seeds",
            "0",
            "data.source=jsonl",
            f"data.path={no_valid_rows(t)}",
        ],
        4,
        ["no valid rows"],
    ),
    "regime: --out a file": (REGIME, lambda t: ["--out", str(a_file(t))], 5, ["--out", "a-file"]),
    "regime: unknown format": (REGIME, lambda t: ["--formats", "fp3"], 2, ["--formats", "'fp3'"]),
    "regime: --config a directory": (
        REGIME,
        lambda t: ["--config", str(t), "--out", f"{t}/r"],
        2,
        ["is a directory"],
    ),
    "regime: unsupported architecture": (
        REGIME,
        lambda t: ["--out", f"{t}/r", "--lengths", "steps4", "--formats", "bf16", f"model.path={mistral(t)}"],
        3,
        ["MistralForCausalLM"],
    ),
}


def check_one_line(err: str, words: list[str]) -> None:
    """The fault is the last stderr line, the only one besides status lines, and names the culprit."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    assert "Traceback" not in err, err[-3000:]
    others = [line for line in lines[:-1] if not line.startswith(STATUS)]
    assert not others, f"more than one line: {lines}"
    assert all(w in lines[-1] for w in words), (words, lines[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_its_kinds_exit_code(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default output path lands here, never in the repo
    module, make, code, words = CASES[name]
    argv = make(tmp_path)
    main = importlib.import_module(module).main
    try:
        got = main(argv)
    except SystemExit as e:  # a usage error leaves through argparse
        got = e.code
    out, err = capsys.readouterr()
    assert got == code, f"{name}: exit {got}, expected {code}; stderr: {err[-2000:]}"
    check_one_line(err, words)
    assert (
        not (tmp_path / "out" / "metrics.jsonl").exists() and not (tmp_path / "sft" / "config.json").exists()
    )


@pytest.mark.parametrize(
    "argv, code, words",
    [
        (["qarl_jax.main", "--config", "{t}"], 2, ["is a directory"]),
        (["qarl_jax.tools.memory_plan", "--config", SMOKE, "--hbm-gb", "0"], 2, ["--hbm-gb"]),
    ],
)
def test_the_real_exit_path(argv, code, words, tmp_path):
    """``python -m`` as a user runs it (the heap re-exec, ``sys.exit``), not only ``main()``."""
    command = [sys.executable, "-m", *(a.format(t=tmp_path) for a in argv)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == code, done.stderr[-2000:]
    check_one_line(done.stderr, words)


def test_the_exit_code_table_is_the_one_in_the_docs():
    """docs/usage.md prints :data:`qarl_jax.cli.EXIT_CODES`, row for row."""
    from qarl_jax.cli import EXIT_CODES

    text = (REPO / "docs" / "usage.md").read_text()
    for code, meaning in EXIT_CODES.items():
        assert f"| {code} | {meaning} |" in text, f"docs/usage.md lacks exit code {code}'s row"


def test_every_error_class_exits_with_a_code_of_the_table():
    from qarl_jax import errors
    from qarl_jax.cli import EXIT_CODES

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.QarlError)]
    assert len(classes) > 10
    assert {c.exit_code for c in classes if c is not errors.QarlError} <= set(EXIT_CODES) - {0, 1}
