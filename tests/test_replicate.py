"""The replication experiment: ``--quick`` runs every arm end to end, resumes, and summarises; the
summary's figures come from the runs' metrics; the committed results are internally consistent."""

import json
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from qarl_jax.config import load_config
from qarl_jax.experiments import replicate, summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "replication"


# the verdict's three arms: enough for the whole pipeline (runs, resume, summary, verdict, notebook);
# the other two arms differ from these only in their overrides, checked without training below
VERDICT_ARMS = ["bf16", "quantized-rollout", "qarl-tbpo"]
# the smallest batches that still give each arm rollouts, an update, a final eval of both weights and
# a verdict to check: the pipeline, the verdict and the resume do not depend on the size (the
# committed studies are the full-size ones). Their accuracy is 0 (8 tokens are too few for a 4-step
# answer); the mismatch is not: quantized-rollout's KL is > 0, the aligned arms' exactly 0. What the
# arms cost is compiling their programs (each arm's update program is its own: format, mode and
# objective differ; the bf16 evals and the two w4a16 arms' rollout programs hit the run's cache):
# this module takes 132 s of CPU against 185 s at the study's own shape (8 prompts x 8 samples, 48
# tokens, 4 minibatches). An earlier try of this shape was reverted after timing out under load: no
# hang (a faulthandler dump never fired), only compiles at load average 30: the three arms took
# 550-860 s wall for 100-110 s of CPU. The policy's 4 layers run as one scanned layer
# (model.scan_layers=true, the real-run configs' layout; the aligned arms' bits are still
# checked at every step): 117 s of CPU for the module against 126 s unrolled (load ~35).
TINY = [
    "data.batch_size=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "rollout.max_len=40",
    "train.num_minibatches=1", "run.eval_prompts=8", "model.scan_layers=true",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~2 min of CPU, compiles mostly: far more wall time on a loaded host
def test_quick_runs_the_verdicts_arms_and_resumes(tmp_path, monkeypatch):
    argv = ["--quick", "--arms", ",".join(VERDICT_ARMS), "--out", str(tmp_path), *TINY]
    assert replicate.main(argv) == 0
    result = json.loads((tmp_path / "summary.json").read_text())
    assert list(result["arms"]) == VERDICT_ARMS
    for run in result["runs"]:
        assert run["steps"] == 3 and 0.0 <= run["final_accuracy"] <= 1.0
        aligned = not run["arm"].startswith("quantized-rollout")
        metrics = (replicate.run_dir(tmp_path, run["arm"], 0) / "metrics.jsonl").read_text().splitlines()
        key = "train/mismatch_frac_bitwise_equal"
        bitwise = [row[key] for row in map(json.loads, metrics) if key in row]
        assert len(bitwise) == 3, metrics  # every step's, bitwise (not only the summary's KL)
        if aligned:  # rollout and training log-probs bitwise equal: the mismatch is exactly 0
            assert run["mismatch_kl"] == 0.0 and bitwise == [1.0] * 3, (run, bitwise)
        else:
            assert run["mismatch_kl"] > 0.0 and max(bitwise) < 1.0, (run, bitwise)
        assert run["final_accuracy_bf16"] is not None
    assert result["verdict"]["complete"]
    assert "| qarl-tbpo |" in (tmp_path / "summary.md").read_text()
    assert result["verdict"]["text"] in _execute_notebook(tmp_path, monkeypatch)
    # a second call finds every run finished and trains nothing
    before = {p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/seed0/metrics.jsonl")}
    assert replicate.main(argv) == 0
    assert before == {p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/seed0/metrics.jsonl")}


@pytest.mark.parametrize("base", ["replication.yaml", "replication_long.yaml"])
def test_every_arm_is_the_documented_format_mode_and_objective(base):
    study = load_config(ROOT / "configs" / base).quant.fmt  # the study's quantized format
    assert study != "bf16"
    expected = {  # arm: (rollout format, aligned training forward, objective, importance correction)
        "bf16": ("bf16", True, "grpo", "auto"),
        "quantized-rollout": (study, False, "grpo", "auto"),  # auto: none for grpo
        "quantized-rollout+tis": (study, False, "grpo", "tis"),
        "quantized-rollout+mis": (study, False, "grpo", "mis"),
        "qarl-grpo": (study, True, "grpo", "auto"),
        "qarl-tbpo": (study, True, "tbpo", "auto"),  # auto: tis for tbpo
    }
    assert list(expected) == list(replicate.ARMS)
    for arm, want in expected.items():
        config = load_config(ROOT / "configs" / base, [*replicate.ARMS[arm], *replicate.QUICK])
        got = (config.quant.fmt, config.quant.mode == "aligned", config.objective.name)
        assert (*got, config.objective.correction) == want, arm
    tis = load_config(ROOT / "configs" / base, replicate.ARMS["quantized-rollout+tis"])
    assert tis.objective.correction_level == "token"  # FlashRL's token-level TIS
    mis = load_config(ROOT / "configs" / base, replicate.ARMS["quantized-rollout+mis"]).objective
    assert (mis.correction_level, mis.correction_cap, mis.correction_low) == ("token", 2.0, 0.0)  # > C only


def test_intervals_and_paired_differences_by_hand():
    # mean 2, sample std 1, t(0.975, 2 dof) = 4.302653: half-width 4.302653 / sqrt(3)
    assert summary.interval95([1.0, 2.0, 3.0]) == pytest.approx(4.302653 / 3**0.5, rel=1e-6)
    assert summary.interval95([0.5]) is None
    runs = [
        {"arm": arm, "seed": seed, "final_accuracy": acc, "mean_accuracy": acc / 2}
        for arm, seed, acc in [
            ("quantized-rollout", 0, 0.50), ("quantized-rollout", 1, 0.60), ("quantized-rollout", 2, 0.70),
            ("qarl-tbpo", 0, 0.55), ("qarl-tbpo", 1, 0.70), ("qarl-tbpo", 2, 0.70), ("qarl-tbpo", 3, 0.90),
        ]
    ]  # fmt: skip
    pairs = summary.paired(runs, ["quantized-rollout", "qarl-tbpo"])
    row = pairs["qarl-tbpo"]  # seed 3 has no quantized-rollout partner: left out
    assert row["seeds"] == [0, 1, 2] and row["final_accuracy"]["wins"] == 2
    assert row["final_accuracy"]["mean"] == pytest.approx((0.05 + 0.10 + 0.0) / 3)
    assert row["final_accuracy"]["ci95"] == pytest.approx(4.302653 * 0.05 / 3**0.5, rel=1e-5)
    assert list(pairs) == ["qarl-tbpo"]


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
    for step in range(1, 11):  # one update five times the median gradient norm and more: a spike
        rows[step]["train/grad_norm"] = 11.0 if step == 7 else 2.0
    rows[5]["eval/accuracy"] = 0.8
    rows[10].update({"eval/accuracy": 0.3, "eval_bf16/accuracy": 0.6})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summary.run_summary(tmp_path, "qarl-tbpo", 0)
    assert (s["initial_accuracy"], s["best_accuracy"], s["final_accuracy"]) == (0.4, 0.8, 0.3)
    assert s["final_accuracy_bf16"] == 0.6 and s["collapsed"]  # 0.3 < half of the 0.8 peak
    assert s["reward_gain"] == pytest.approx(0.95 - 0.15) and s["step_s"] == 2.0
    assert s["grad_spikes"] == 1 and s["reward_drawdown"] == 0.0  # the reward only rose
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        summary.run_summary(tmp_path, "bf16", 0)


@pytest.mark.parametrize("study", ["replication", "replication_long"])
def test_committed_summary_matches_its_runs(study):
    """The committed summary is what write_summary makes of the committed run directories, and the
    README quotes its verdict's final accuracies."""
    out = ROOT / "results" / study
    committed = json.loads((out / "summary.json").read_text())
    for run in committed["runs"]:
        directory = replicate.run_dir(out, run["arm"], run["seed"])
        fresh = summary.run_summary(directory, run["arm"], run["seed"])
        assert {k: run[k] for k in fresh} == json.loads(json.dumps(fresh))
    table = summary.arm_table(committed["runs"], list(replicate.ARMS))
    assert json.loads(json.dumps(table)) == committed["arms"]
    pairs = summary.paired(committed["runs"], list(replicate.ARMS))
    assert json.loads(json.dumps(summary.verdict(table, pairs))) == committed["verdict"]
    readme = (ROOT / "README.md").read_text()
    for arm in ("bf16", "quantized-rollout", "qarl-tbpo"):
        assert f"{table[arm]['final_accuracy']['mean']:.3f}" in readme, (study, arm)


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


@pytest.mark.slow
def test_notebook_executes_on_committed_results(monkeypatch):
    """Both studies: their verdicts, the long one's sweep, and the paper's numbers beside them."""
    text = _execute_notebook(COMMITTED, monkeypatch)
    for name, study in (("short answers", "replication"), ("long answers", "replication_long")):
        verdict = json.loads((ROOT / "results" / study / "summary.json").read_text())["verdict"]["text"]
        assert f"{name}: {verdict}" in text  # the verdict cell's line (summary.md carries the bare text)
    assert "qarl-jax, tiny Qwen3, 24-step sums (~200 tok)" in text and "steps24 w4a16-g128" in text
    assert "Qwen3-30B-A3B-Base (GSPO)" in text


def test_regime_pick_takes_the_strong_learnable_cell_that_loses_the_most_accuracy():
    from qarl_jax.experiments import regime

    def cell(length, fmt, kl, errors, acc, implausible=None):
        return {"length": length, "format": fmt, "mismatch_kl": kl, "error_seq_frac": errors,
                "implausible_seq_frac": errors if implausible is None else implausible,
                "accuracy_quantized": acc, "accuracy_bf16": 0.9, "accuracy_drop": 0.9 - acc}  # fmt: skip

    cells = [
        cell("steps4", "bf16", 0.0, 0.05, 0.9),  # sampling noise: 5% of responses hold a rare token
        # the short study's own regime: the reference, never the pick, however strong
        cell("steps4", "w4a16-g128", 2.4e-3, 0.30, 0.85),
        cell("steps24", "w4a16-g128", 3.0e-2, 0.0, 0.40),  # 12.5x the reference's mismatch
        cell("steps24", "w4a8-g128", 9.0e-2, 0.20, 0.10),  # harsher, but too little left to learn from
        cell("steps12", "bf16", 0.0, 0.02, 0.9),
        cell("steps12", "w8a8", 1.0e-3, 0.035, 0.60),  # mild mismatch, 1.5% more error sequences
        # as mild, 2% more implausible sequences (the full-precision forward's verdict)
        cell("steps12", "w4a16-g32", 1.0e-3, 0.02, 0.55, implausible=0.04),
        cell("steps12", "w4a16-g128", 1.0e-3, 0.025, 0.20),  # 0.5% more: not strong
    ]
    chosen = regime.pick(cells)
    assert chosen["found"] and (chosen["length"], chosen["format"]) == ("steps24", "w4a16-g128")
    assert "4 of 5 quantized cells beyond steps4 w4a16-g128" in chosen["why"]
    assert "3 with quantized accuracy >= 0.3" in chosen["why"] and "(0.400, bf16 0.900)" in chosen["why"]
    assert "reach KL >= 2.4e-02" in chosen["why"]  # 10x the steps4 w4a16-g128 cell's 2.4e-3
    assert not regime.pick(cells[:1])["found"]  # the bf16 cell alone: nothing to pick yet
    none = regime.pick(cells[:2])  # the reference alone: never the pick
    assert not none["found"] and "largest mismatch is steps4 w4a16-g128" in none["why"]
    weaker = regime.pick([c for c in cells if c["format"] != "w4a16-g128" or c["length"] != "steps24"])
    assert (weaker["length"], weaker["format"]) == ("steps12", "w4a16-g32")  # loses 0.35 to w8a8's 0.30
