"""Long rollouts: chunked prefill (same bits as one whole-prompt call), the engine's KV-cache bytes
per device, and the optimizer state's placement (``memory_plan --compiled`` found it replicated;
that command's compile of the run's programs is tests/test_memory_guard.py's real-run check)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tiers import slow_but

from qarl_jax import sharding
from qarl_jax.models import Qwen3ForCausalLM, init_params, init_sharded, preset
from qarl_jax.quant import QuantSpec, quantize_params
from qarl_jax.rl.objectives import ObjectiveConfig
from qarl_jax.rl.train_step import OptimizerConfig, TrainConfig, Trainer
from qarl_jax.rollout import EngineConfig, RolloutEngine

REPO = pathlib.Path(__file__).parents[1]


@pytest.mark.slow
def test_chunked_prefill_is_bitwise_the_whole_prompt_prefill():
    """A 16-token bucket prefilled 5 tokens at a time (4 chunks, the last one padded past the cache)
    gives the whole-prompt prefill's K/V and last logits bit for bit, for prompts ending in the
    first, a middle and the last chunk."""
    model = Qwen3ForCausalLM(preset("qwen3-tiny", num_hidden_layers=2, scan_layers=True), QuantSpec("w8a8"))
    frozen = jax.jit(quantize_params, static_argnums=1)(init_params(model, jax.random.key(0)), model.quant)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, 128, n).tolist() for n in (3, 12, 16)]
    whole = RolloutEngine(model, frozen, EngineConfig(slots=4, max_len=32)).prefill(frozen, prompts)
    chunked = RolloutEngine(model, frozen, EngineConfig(slots=4, max_len=32, prefill_chunk=5))
    got = chunked.prefill(frozen, prompts)
    assert got.cache.k.shape[2] == 16
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)


def test_kv_cache_bytes_per_device():
    config = preset("qwen3-tiny")  # 4 layers, 2 kv heads of 32, f32
    model = Qwen3ForCausalLM(config)
    frozen = init_params(model, jax.random.key(0))
    full = 2 * 4 * 8 * 64 * 2 * 32 * 4
    assert RolloutEngine(model, frozen, EngineConfig(slots=8, max_len=64)).kv_cache_bytes_per_device() == full
    mesh_cfg = sharding.MeshConfig(data=2, fsdp=2, tensor=2)  # slots over data x fsdp, kv heads over tensor
    mesh = sharding.make_mesh(mesh_cfg)
    with sharding.activate(mesh, mesh_cfg.rules):
        placed = jax.device_put(frozen, sharding.param_shardings(model, mesh, mesh_cfg.rules))
        engine = RolloutEngine(model, placed, EngineConfig(slots=8, max_len=64), mesh=mesh)
    assert engine.kv_cache_bytes_per_device() == full // 8
    assert engine.init_decode_state().cache.k.addressable_shards[0].data.nbytes == full // 8 // 2


@pytest.mark.parametrize("optimizer", slow_but(["adamw", "muon"], "adamw"))
def test_optimizer_state_is_sharded_like_the_parameters(optimizer):
    """jit(tx.init) alone replicated the moments on every device (their zeros read no input);
    Trainer.init_state places each like its parameter."""
    mesh_cfg = sharding.MeshConfig(data=1, fsdp=8)
    mesh = sharding.make_mesh(mesh_cfg)
    model = Qwen3ForCausalLM(preset("qwen3-tiny", num_hidden_layers=1))
    with sharding.activate(mesh, mesh_cfg.rules):
        params = init_sharded(model, jax.random.key(0), mesh, mesh_cfg.rules)
    trainer = Trainer(model, ObjectiveConfig(), TrainConfig(), OptimizerConfig(name=optimizer), mesh=mesh)
    state = trainer.init_state(params)

    def names(path):
        return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))

    like = {names(path): p for path, p in jax.tree_util.tree_leaves_with_path(params)}
    moments = []
    for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state):
        n = names(path)
        p = next((like[n[i:]] for i in range(len(n)) if n[i:] in like), None)
        if p is not None and p.shape == x.shape and x.ndim:
            moments.append((x, p))
    assert len(moments) >= len(like)  # at least one moment per parameter
    assert all(x.sharding == p.sharding for x, p in moments)
    assert any(x.sharding.spec != P() for x, _ in moments)


@pytest.mark.slow
def test_long_context_benchmark_runs_at_a_tiny_shape(tmp_path):
    """benchmarks/long_context.py's memory section at toy shapes (the real ones are minutes of
    compiles): it writes its JSON with one row per length and the growth beside it."""
    out = tmp_path / "lc.json"
    cmd = [sys.executable, "benchmarks/long_context.py", "--tiny", "--sections", "memory", "--json", str(out)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())["memory"]
    assert [r["length"] for r in rows] == [64, 256]
    assert rows[0]["temp_gb"] > 0 and rows[1]["growth_per_4x"] == rows[1]["temp_gb"] / rows[0]["temp_gb"]
