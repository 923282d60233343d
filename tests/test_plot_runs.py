"""``python -m qarl_jax.tools.plot_runs``: a PNG from run directories; a clear error for a bad one."""

import json

from qarl_jax.tools import plot_runs


def _run(directory, rewards):
    directory.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.3}]
    rows += [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]
    rows[-1]["eval/accuracy"] = 0.6
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(directory)


def test_plot_writes_a_png(tmp_path, capsys):
    dirs = [_run(tmp_path / "seed0", [0.1, 0.2, 0.4]), _run(tmp_path / "seed1", [0.2, 0.3, 0.3])]
    out = tmp_path / "fig" / "runs.png"
    assert plot_runs.main([*dirs, "--out", str(out), "--smooth", "2"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_run_is_a_clear_error(tmp_path, capsys):
    assert plot_runs.main([str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")]) == 4
    assert "no such run directory" in capsys.readouterr().err
