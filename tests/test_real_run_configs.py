"""The shipped real-run configs (Qwen3-8B / Qwen3-30B-A3B on a v5p slice and on 8 GPUs) load, shard
evenly on their stated mesh and fit their chips' HBM, planned by shape alone (no weights)."""

import pathlib

import pytest

from qarl_jax.config import load_config
from qarl_jax.tools.memory_plan import HBM_GB, PlanError, main, plan

CONFIGS = pathlib.Path(__file__).parents[1] / "configs"
# config -> (the platform its header names, the published parameter count)
REAL_RUNS = {
    "qwen3_8b_v5p64.yaml": ("v5p", 8.19e9),
    "qwen3_8b_8gpu.yaml": ("h100", 8.19e9),
    "qwen3_30b_a3b_v5p64.yaml": ("v5p", 30.5e9),
    "qwen3_30b_a3b_8gpu.yaml": ("h200", 30.5e9),
    # 16k-token responses on math (scanned layers; their compiled plans are in the headers)
    "qwen3_8b_16k_v5p64.yaml": ("v5p", 8.19e9),
    "qwen3_8b_16k_8gpu.yaml": ("h200", 8.19e9),
    "qwen3_30b_a3b_16k_8gpu.yaml": ("h200", 30.5e9),
}


@pytest.mark.parametrize("name", sorted(REAL_RUNS))
def test_real_run_config_shards_and_fits(name):
    platform, params = REAL_RUNS[name]
    config = load_config(CONFIGS / name)
    assert (config.quant.fmt, config.quant.mode, config.objective.name) == ("w4a16", "aligned", "tbpo")
    p = plan(config, hbm_gb=HBM_GB[platform])  # raises PlanError on any dimension that does not divide
    m = config.mesh
    assert p["devices"] == m.data * m.fsdp * m.tensor * m.expert
    assert p["param_count"] == pytest.approx(params, rel=0.01)
    assert p["notes"] == []  # nothing falls back to replication (the KV cache splits too)
    assert p["fits"], f"{name}: {p['total_bytes'] / 1e9:.1f} GB > {HBM_GB[platform]} GB"


def test_mesh_that_does_not_divide_names_param_dim_and_axes():
    config = load_config(CONFIGS / "qwen3_8b_v5p64.yaml", ["mesh.tensor=3"])
    with pytest.raises(PlanError, match=r"embed_tokens/embedding \(151936, 4096\): dim 0 \(151936\) does not "
                       r"divide by mesh axes 'tensor' = 3"):  # fmt: skip
        plan(config)


def test_absent_checkpoint_needs_a_stated_preset():
    config = load_config(CONFIGS / "qwen3_8b_8gpu.yaml", ["model.preset=qwen3-tiny"])
    with pytest.raises(PlanError, match="name the checkpoint's architecture with model.preset or --preset"):
        plan(config)


def test_cli_prints_the_table_and_fails_what_does_not_fit(capsys):
    path = str(CONFIGS / "qwen3_8b_8gpu.yaml")
    assert main(["--config", path, "--platform", "h100"]) == 0
    out = capsys.readouterr().out
    assert "8.191B parameters" in out and "fits" in out and "<- peak" in out
    assert main(["--config", path, "--hbm-gb", "16"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["--config", path, "--devices", "16"]) == 2
    assert "plan error: mesh {'data': 1, 'fsdp': 8" in capsys.readouterr().err
