"""Mesh construction, logical-axis sharding of init/load/forward, and the shard_map kernel helper.
The models have two layers (the MoE's second one sparse): a layer is sharded as any other, and
XLA's compiles, most of this module's time, grow with the layers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from qarl_jax import sharding as sh
from qarl_jax.models import (
    Qwen3ForCausalLM,
    from_pretrained,
    init_params,
    init_sharded,
    ops,
    preset,
    save_pretrained,
)

MESHES = {
    "qwen3-tiny": sh.MeshConfig(data=2, fsdp=2, tensor=2),
    "qwen3-moe-tiny": sh.MeshConfig(data=1, fsdp=2, tensor=2, expert=2),
}
# the MoE cells (8-16 s) are the full suite's; the fast tier keeps the dense ones
MESH_NAMES = [n if n == "qwen3-tiny" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(MESHES)]


def test_eight_fake_devices():
    assert jax.device_count() == 8


def test_mesh_from_config_fills_free_axis():
    mesh = sh.make_mesh(sh.MeshConfig(data=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2, "expert": 1}


@pytest.mark.parametrize(
    "cfg, match",
    [
        (sh.MeshConfig(data=3, fsdp=1), "needs 3 devices"),
        (sh.MeshConfig(data=-1, fsdp=-1), "at most one -1"),
        (sh.MeshConfig(data=-1, tensor=3), "cannot fill"),
        (sh.MeshConfig(rules=(("embed", "model"),)), "unknown mesh axis 'model'"),
    ],
)
def test_bad_mesh_configs(cfg, match):
    with pytest.raises(ValueError, match=match):
        sh.make_mesh(cfg)


@pytest.mark.parametrize("name", MESH_NAMES)
def test_sharded_init_equals_single_device(name):
    model = Qwen3ForCausalLM(preset(name, num_hidden_layers=2))
    mesh = sh.make_mesh(MESHES[name])
    sharded = init_sharded(model, jax.random.key(3), mesh)
    jax.tree.map(np.testing.assert_array_equal, sharded, init_params(model, jax.random.key(3)))
    q = sharded["layers_1"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P("fsdp", "tensor")
    assert q.addressable_shards[0].data.shape == (q.shape[0] // 2, q.shape[1] // 2)
    if name == "qwen3-moe-tiny":
        experts = sharded["layers_1"]["mlp"]["experts"]["gate_proj"]["kernel"]
        assert experts.sharding.spec == P("expert", "fsdp", "tensor")


@pytest.mark.parametrize("name", MESH_NAMES)
def test_sharded_load_and_forward(tmp_path, name):
    config = preset(name, num_hidden_layers=2)
    model = Qwen3ForCausalLM(config)
    params = init_params(model, jax.random.key(4))
    save_pretrained(tmp_path, config, params)
    mesh = sh.make_mesh(MESHES[name])
    _, loaded, _ = from_pretrained(tmp_path, shardings=sh.param_shardings(model, mesh))
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    assert loaded["embed_tokens"]["embedding"].sharding.spec == P("tensor", "fsdp")
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (8, 16)))
    with sh.activate(mesh):
        out = jax.jit(model.apply)({"params": loaded}, tokens)
    batch_ways = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    assert out.addressable_shards[0].data.shape[0] == 8 // batch_ways  # activations stay batch-sharded
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(jax.jit(model.apply)({"params": params}, tokens)), atol=2e-5
    )


def test_kernels_run_per_device_on_local_rows_hlo():
    """ops.per_device (the helper every model kernel runs under): each device computes its own
    [M/4, N] rows with no collective on them; the same kernel under plain jit is partitioned by
    XLA instead (the row-block loop then runs on a layout of the partitioner's choosing)."""
    mesh = sh.make_mesh(sh.MeshConfig(data=2, fsdp=2, tensor=2))

    def kernel(x, w):  # stands for a row-block kernel or a pallas_call
        return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)

    x = jax.device_put(jnp.ones((64, 32)), jax.NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    w = jax.device_put(jnp.ones((32, 48)), jax.NamedSharding(mesh, P()))
    with sh.activate(mesh):
        f = jax.jit(lambda x, w: ops.per_device(kernel, x, w, batched=(True, False)))
        lowered = f.lower(x, w)
        hlo = lowered.compile().as_text()
        out = f(x, w)
        plain = jax.jit(kernel).lower(x, w).as_text()
    # a manual (per-device) region wraps the kernel; plain jit leaves it to the partitioner
    assert "manual_computation" in lowered.as_text() and "manual_computation" not in plain
    assert re.search(r"f32\[16,32\]", hlo) and re.search(r"f32\[16,48\]", hlo), "per-device shapes"
    assert "all-gather" not in hlo and "all-reduce" not in hlo
    assert out.addressable_shards[0].data.shape == (16, 48)
    np.testing.assert_array_equal(np.asarray(out), np.full((64, 48), 32.0))
