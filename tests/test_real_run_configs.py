"""The shipped real-run configs (Qwen3-8B / Qwen3-30B-A3B on a v5p slice and on 8 GPUs) load, shard
evenly on their stated mesh and fit their chips' HBM, planned by shape alone (no weights)."""

import pathlib

import jax
import pytest

from qarl_jax import sharding
from qarl_jax.config import MeshConfig, load_config
from qarl_jax.models import Qwen3ForCausalLM, preset
from qarl_jax.quant import QuantSpec, quantize_params
from qarl_jax.rollout import EngineConfig
from qarl_jax.tools import compiled_memory
from qarl_jax.tools.memory_plan import HBM_GB, PlanError, compiled_json, format_compiled, main, plan

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


def test_the_decode_step_moves_the_sharded_frozen_weights_under_fsdp_only():
    """What the engine's compiled decode step moves per call (collectives of its optimized HLO):
    under FSDP it gathers every sharded frozen weight whole, each step (so at least their full
    bytes arrive); on the data-parallel layout the weights are replicated and it moves next to
    nothing. The text table and --json carry the same figure."""
    model = Qwen3ForCausalLM(preset("qwen3-tiny"), QuantSpec("w4a16"))
    engine = EngineConfig(slots=8, max_len=64)
    moved = {}
    for name, layout in (("fsdp", MeshConfig(data=1, fsdp=8)), ("data", MeshConfig(data=8, fsdp=1))):
        mesh = sharding.make_mesh(layout, jax.devices()[:8])
        programs, _ = compiled_memory.engine_programs(model, model.quant, engine, 16, mesh)
        moved[name] = {p.name: p.collective for p in programs}
        if name == "fsdp":
            with sharding.activate(mesh, sharding.DEFAULT_RULES):
                params = compiled_memory.abstract_params(model, mesh, sharding.DEFAULT_RULES)
                frozen = compiled_memory.jitted_outputs(lambda p: quantize_params(p, model.quant), params)
            sharded = [x for x in jax.tree.leaves(frozen) if not x.sharding.is_fully_replicated]
            assert sharded, "nothing of the tiny model is sharded: the test would prove nothing"
            gathered = sum(x.size * x.dtype.itemsize for x in sharded)
    assert moved["fsdp"]["decode_step"] >= gathered
    assert moved["data"]["decode_step"] < moved["fsdp"]["decode_step"] / 10  # per-slot vectors only
    run = {p.name: p.peak for p in programs}
    cp = dict(programs=programs, run=run, kv_cache=0, peak_program="prefill", total_bytes=1, fits=None)
    p = dict(hbm_bytes=None, total_bytes=1, peak_phase="update")
    assert compiled_json(cp, p)["programs"]["decode_step"]["collective_bytes"] == moved["data"]["decode_step"]
    assert "moved" in format_compiled(cp, p)
