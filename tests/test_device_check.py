"""benchmarks/device_check.sh in its CPU mode, smallest run: the one-call device check's plumbing
(stage under a time limit -> JSON in $OUT -> summary table) works before it spends device time.
The dense cell: the plumbing is the claim here, the MoE bits are test_tools_check_alignment's."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_mode_aligned_cell_is_bitwise_in_the_summary(tmp_path):
    cmd = ["bash", "benchmarks/device_check.sh", "--cpu", "--stages", "alignment"]
    cmd += ["--cells", "qwen3-tiny:w4a16", "--naive-budget-s", "0"]
    env = os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    row = next(r for r in summary.splitlines() if r.startswith("aligned bitwise qwen3-tiny w4a16"))
    assert "frac 1.0000" in row and row.split()[-1] == "yes", summary
    assert "naive qwen3-tiny w4a16: not started (time budget)" in summary
    cells = json.loads((tmp_path / "b_alignment.json").read_text())["cells"]
    assert [c["mode"] for c in cells] == ["aligned", "naive"] and cells[0]["frac_bitwise_equal"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b_alignment.json", "log.txt", "summary.txt"]
