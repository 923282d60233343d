"""The CLI: runs the job on small overrides and rejects bad configuration with exit code 2."""

import json

from qarl_jax.main import main


def test_main_runs_and_reports(capsys):
    assert main(["demo.batch=2", "demo.new_tokens=4", "quant.fmt=w8a8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "w8a8" and report["devices"] == 8
    assert report["rollout_tokens_per_s"] > 0
    assert 0.0 <= report["aligned_frac_bitwise_equal"] <= 1.0
    assert report["naive_max_abs_logprob_diff"] > 0.0  # full precision vs int8 rollout differ


def test_main_rejects_unknown_key(capsys):
    assert main(["quant.fmtt=w8a8"]) == 2
    assert "unknown config key quant.fmtt" in capsys.readouterr().err
