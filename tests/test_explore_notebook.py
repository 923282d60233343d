"""qarl_jax.run.runlog reads run directories (and says clearly what it cannot read);
notebooks/explore_run.ipynb runs top to bottom on a real smoke run beside an older-style run that
lacks some keys."""

import json
import math
import pathlib

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from qarl_jax.run.runlog import RunLogError, load_run, load_runs, rolling_mean, summary

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "explore_run.ipynb"


@pytest.fixture
def smoke_run(reference_run) -> pathlib.Path:
    """A real run directory named "aligned": the session's reference smoke run (tests/smoke_run.py:
    4 steps, evals at steps 0, 2 and 4)."""
    return reference_run.run


def write_run(run_dir: pathlib.Path, rows: list[dict], config: dict | None = None) -> pathlib.Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if config is not None:
        (run_dir / "config.json").write_text(json.dumps(config))
    return run_dir


@pytest.mark.slow
def test_notebook_executes_on_a_smoke_run_and_an_older_one(smoke_run, tmp_path, monkeypatch):
    # an older run, same directory name: no config.json, no mismatch or timing keys
    rows = [json.loads(line) for line in (smoke_run / "metrics.jsonl").read_text().splitlines()]
    old = [{k: v for k, v in row.items() if not k.startswith(("train/mismatch_", "time/"))} for row in rows]
    older = write_run(tmp_path / "old" / "aligned", old)
    monkeypatch.setenv("QARL_RUN_DIRS", f"{smoke_run}:{older}")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o["output_type"] == "error"]
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(figures) == 7  # reward, accuracy, mismatch, entropy, error tokens, objective, speed
    text = "".join(o.get("text", "") for o in outputs)
    smoke_name, older_name = f"{smoke_run.parent.name}/aligned", "old/aligned"
    assert f"{smoke_name} (aligned): largest |Δ log-prob| over the run 0: exactly 0" in text
    assert f"{older_name} (?): largest |Δ log-prob| over the run nan: not logged" in text
    summary_lines = [line for line in text.splitlines() if line.startswith((smoke_name, older_name))]
    assert [line.split()[1:3] for line in summary_lines[-2:]] == [["w4a16", "aligned"], ["?", "?"]]


@pytest.mark.slow
def test_smoke_run_loads(smoke_run):
    run = load_run(smoke_run)
    assert run.name == "aligned" and run.config["run"]["steps"] == 4
    assert run.metrics["step"].tolist() == [1, 2, 3, 4] and run.evals["step"].tolist() == [0, 2, 4]
    steps, acc = run.series("eval/accuracy")
    assert steps.tolist() == [0, 2, 4] and np.all((acc >= 0) & (acc <= 1))
    assert np.all(run.series("train/mismatch_max_abs_diff")[1] == 0)
    assert summary(run)["mismatch_max"] == 0 and summary(run)["quant"] == "w4a16 aligned"


def test_missing_keys_read_as_nan_and_empty_series(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "reward_mean": 0.25}, {"step": 2, "accuracy": 1}]
    run = load_run(write_run(tmp_path / "r", rows))
    assert run.config == {} and list(run.metrics) == ["step", "reward_mean", "accuracy"]
    np.testing.assert_array_equal(run.metrics["reward_mean"], [0.25, np.nan])
    assert run.series("reward_mean")[0].tolist() == [1] and run.series("accuracy")[1].tolist() == [1.0]
    steps, values = run.series("train/clip_frac")
    assert len(steps) == len(values) == 0 and not run.has("train/clip_frac") and run.has("eval/accuracy")
    s = summary(run)
    assert s["steps"] == 2 and s["reward_first"] == s["reward_last"] == 0.25
    assert s["eval_before"] == s["eval_final"] == 0.5 and math.isnan(s["eval_bf16_final"])
    assert math.isnan(s["mismatch_max"]) and s["quant"] == "? ?"


def test_summary_compares_first_and_last_fifth_of_the_steps(tmp_path):
    rows = [{"step": s, "reward_mean": float(s)} for s in range(1, 11)]
    s = summary(load_run(write_run(tmp_path / "r", rows)))
    assert s["reward_first"] == 1.5 and s["reward_last"] == 9.5 and math.isnan(s["eval_before"])


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"step": 2, "reward_mean": 0.', "metrics.jsonl:2: not valid JSON"),
        ("[1, 2]", "metrics.jsonl:2: expected a JSON object, got list"),
        ('{"reward_mean": 0.5}', "metrics.jsonl:2: no integer 'step' key"),
        ('{"step": 2, "reward_mean": "high"}', "metrics.jsonl:2: 'reward_mean' is 'high', not a number"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    run_dir = write_run(tmp_path / "r", [{"step": 1}])
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(line + "\n")
    with pytest.raises(RunLogError, match=message) as e:
        load_run(run_dir)
    assert str(run_dir / "metrics.jsonl") in str(e.value)


def test_missing_run_dir_metrics_and_bad_config(tmp_path):
    with pytest.raises(RunLogError, match="no such run directory"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunLogError, match="no metrics.jsonl"):
        load_run(tmp_path / "empty")
    run_dir = write_run(tmp_path / "r", [{"step": 1}])
    (run_dir / "config.json").write_text("{\n  oops")
    with pytest.raises(RunLogError, match=r"config.json:2: not valid JSON"):
        load_run(run_dir)


def test_colliding_names_take_parent_directories(tmp_path):
    dirs = [write_run(tmp_path / p / "default", [{"step": 1}]) for p in ("a", "b")]
    dirs.append(write_run(tmp_path / "solo", [{"step": 1}]))
    assert [r.name for r in load_runs(dirs)] == ["a/default", "b/default", "solo"]


def test_rolling_mean_is_trailing():
    np.testing.assert_allclose(rolling_mean(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1.0, 2.0, 4.0, 6.0])
    np.testing.assert_allclose(rolling_mean(np.array([2.0, 4.0]), 10), [2.0, 3.0])
    with pytest.raises(ValueError, match="window"):
        rolling_mean(np.ones(3), 0)
