"""The replication experiment: ``--quick`` runs every arm end to end, resumes, and summarises; the
summary's figures come from the runs' metrics; the committed results are internally consistent."""

import json
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from qarl_jax.experiments import replicate, summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "replication"


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(module_compilation_cache):
    """The arms share programs (the same rollout format, the bf16 eval of the master weights): each
    later arm loads them from the persistent cache instead of compiling them again."""


@pytest.mark.slow
@pytest.mark.timeout(1200)  # five arms, each compiling its own step program: minutes beside another worker
def test_quick_runs_every_arm_and_resumes(tmp_path, monkeypatch):
    assert replicate.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "summary.json").read_text())
    assert list(result["arms"]) == list(replicate.ARMS)
    for run in result["runs"]:
        assert run["steps"] == 3 and 0.0 <= run["final_accuracy"] <= 1.0
        aligned = not run["arm"].startswith("quantized-rollout")
        if aligned:  # rollout and training log-probs bitwise equal: the mismatch is exactly 0
            assert run["mismatch_kl"] == 0.0, run
        else:
            assert run["mismatch_kl"] > 0.0, run
        assert run["final_accuracy_bf16"] is not None
    assert result["verdict"]["complete"]
    assert "| qarl-tbpo |" in (tmp_path / "summary.md").read_text()
    assert result["verdict"]["text"] in _execute_notebook(tmp_path, monkeypatch)
    # a second call finds every run finished and trains nothing
    before = {p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/seed0/metrics.jsonl")}
    assert replicate.main(["--quick", "--out", str(tmp_path)]) == 0
    assert before == {p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/seed0/metrics.jsonl")}


def test_bad_arm_is_rejected(capsys):
    with pytest.raises(SystemExit):
        replicate.main(["--arms", "bf16,fp8-rollout"])
    assert "unknown arm 'fp8-rollout'" in capsys.readouterr().err


def test_run_summary_figures(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.4, "eval_bf16/accuracy": 0.5}]
    for step in range(1, 11):
        rows.append(
            {"step": step, "reward_mean": step / 10, "train/mismatch_kl_k3": 0.01, "time/step_s": 2.0}
        )
    rows[5]["eval/accuracy"] = 0.8
    rows[10].update({"eval/accuracy": 0.3, "eval_bf16/accuracy": 0.6})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summary.run_summary(tmp_path, "qarl-tbpo", 0)
    assert (s["initial_accuracy"], s["best_accuracy"], s["final_accuracy"]) == (0.4, 0.8, 0.3)
    assert s["final_accuracy_bf16"] == 0.6 and s["collapsed"]  # 0.3 < half of the 0.8 peak
    assert s["reward_gain"] == pytest.approx(0.95 - 0.15) and s["step_s"] == 2.0
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        summary.run_summary(tmp_path, "bf16", 0)


@pytest.mark.skipif(not (COMMITTED / "summary.json").exists(), reason="no committed replication results")
def test_committed_summary_matches_its_runs():
    """The committed summary is what write_summary makes of the committed run directories."""
    committed = json.loads((COMMITTED / "summary.json").read_text())
    for run in committed["runs"]:
        directory = replicate.run_dir(COMMITTED, run["arm"], run["seed"])
        fresh = summary.run_summary(directory, run["arm"], run["seed"])
        assert {k: run[k] for k in fresh} == json.loads(json.dumps(fresh))
    table = summary.arm_table(committed["runs"], list(replicate.ARMS))
    assert json.loads(json.dumps(table)) == committed["arms"]


def _execute_notebook(results: pathlib.Path, monkeypatch) -> str:
    notebook = ROOT / "notebooks" / "qarl_replication.ipynb"
    nb = nbformat.read(notebook, as_version=4)
    monkeypatch.setenv("QARL_REPLICATION_DIR", str(results))
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    return "".join(o.get("text", "") for o in outputs)


@pytest.mark.skipif(not (COMMITTED / "summary.json").exists(), reason="no committed replication results")
def test_notebook_executes_on_committed_results(monkeypatch):
    text = _execute_notebook(COMMITTED, monkeypatch)
    committed = json.loads((COMMITTED / "summary.json").read_text())
    assert committed["verdict"]["text"] in text
    assert "Qwen3-30B-A3B-Base (GSPO)" in text
