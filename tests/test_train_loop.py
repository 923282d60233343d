"""The training loop on the smoke config: metrics per step, eval, weight sync to the engine."""

import json
import pathlib

import jax
import numpy as np
import pytest

from qarl_jax.config import load_config
from qarl_jax.train import PACKAGE_DIR, model_dir, step_seed, train

SMOKE = pathlib.Path(__file__).parents[1] / "configs" / "loop_smoke.yaml"


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """Runs in one session recompile the same programs: share them through the persistent cache."""
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.getbasetemp() / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def test_loop_logs_every_step_and_keeps_the_engine_in_sync(tmp_path):
    # assert_aligned: the trainer raises unless its old log-probs equal the rollout's bit for bit,
    # which after the first update holds only if the engine got the updated weights
    config = load_config(SMOKE, [f"run.output_dir={tmp_path}", "run.steps=3", "run.eval_every=2",
                                 "train.assert_aligned=true"])  # fmt: skip
    result = train(config)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    assert "eval/accuracy" in lines[0] and "eval/accuracy" in lines[2] and "eval/accuracy" in lines[3]
    assert "eval/accuracy" not in lines[1]
    for m in lines[1:]:
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["train/skipped"] == 0.0
        assert m["train/is_weight_mean"] == 1.0 and m["response_length"] > 0
        assert all(np.isfinite(v) for v in m.values())
    assert any(m["train/grad_norm"] > 0 for m in lines[1:])
    assert int(result.state.step) == 3  # one optimizer update per step with the default train config
    assert json.loads((tmp_path / "config.json").read_text())["run"]["steps"] == 3


def test_step_seeds_differ_and_repeat():
    seeds = {step_seed(0, s) for s in range(100)} | {step_seed(1, s) for s in range(100)}
    assert len(seeds) == 200 and step_seed(3, 7) == step_seed(3, 7) and max(seeds) < 2**31


def test_package_paths_resolve_inside_the_package():
    assert model_dir("package:assets/policy") == PACKAGE_DIR / "assets" / "policy"
    assert model_dir("/ckpt/qwen") == pathlib.Path("/ckpt/qwen")
