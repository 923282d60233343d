"""The tensor-parallel rollout engine's arithmetic on 8 fake CPU devices: a projection computed in
column blocks on one device is bitwise the same projection split over 2 / 4 / 8 devices, per
kernel backend (the GPU and TPU kernels in Pallas' interpreter), and layouts the arithmetic cannot
keep bitwise are refused in one line. (The engine against the training forward:
test_tools_check_alignment, tensor 2 x expert 2; that its compiled decode step gathers activations,
never a weight: test_real_run_configs' engine-layout test.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import FORMATS, quantize, quantized_matmul
from qarl_jax import quant
from qarl_jax.errors import ConfigError
from qarl_jax.models import preset
from qarl_jax.quant import QuantSpec
from qarl_jax.rollout import layout

K, N = 256, 512


def _split(x, w, t: int, **options):
    """x @ w with w's columns over ``t`` devices, each device one block (the engine's layout)."""
    mesh = jax.make_mesh((t,), ("tensor",), devices=jax.devices()[:t])
    cols = NamedSharding(mesh, P(None, "tensor"))
    local = jax.tree.map(lambda a: jax.device_put(a, cols), w)
    fn = jax.shard_map(
        lambda x, w: quantized_matmul(x, w, **options),
        mesh=mesh,
        in_specs=(P(), P(None, "tensor")),
        out_specs=P(None, "tensor"),
        check_vma=False,
    )
    return np.asarray(jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, P())), local))


def _blocks(x, w, ts: tuple[int, ...], **options) -> list:
    """The same product in ``t`` column blocks for each ``t`` of ``ts``, each block its own call,
    on whole weights per device (the training forward: ``per_device`` runs it in a ``shard_map``
    over the devices' rows); one program for every ``t``."""

    def blocks(x, w):
        out = []
        for t in ts:
            n = w.n // t
            parts = [quantized_matmul(x, quant.column_slice(w, i * n, n), **options) for i in range(t)]
            out.append(jnp.concatenate(parts, axis=-1))
        return out

    mesh = jax.make_mesh((max(ts),), ("data",), devices=jax.devices()[: max(ts)])
    fn = jax.shard_map(blocks, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return [np.asarray(y) for y in jax.jit(fn)(x, w)]


@pytest.mark.parametrize(  # 4-9 s each: the fast tier keeps w4a16 (the default format)
    "fmt", [f if f == "w4a16" else pytest.param(f, marks=pytest.mark.slow) for f in FORMATS]
)
def test_column_blocks_on_one_device_equal_the_split_over_2_4_8_devices_cpu(fmt):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((12, K)), jnp.bfloat16)
    w = quantize(jnp.asarray(rng.standard_normal((K, N)), jnp.float32), fmt)
    for t, blocks in zip((2, 4, 8), _blocks(x, w, (2, 4, 8)), strict=True):
        np.testing.assert_array_equal(_split(x, w, t), blocks, err_msg=f"{fmt} tensor={t}")


@pytest.mark.parametrize("backend", ["gpu", pytest.param("tpu", marks=pytest.mark.slow)])  # tpu: 4 s each
@pytest.mark.parametrize("fmt", ["w4a16", "w8a8"])
def test_column_blocks_equal_the_split_in_the_pallas_interpreter(backend, fmt):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, K)), jnp.bfloat16)
    w = quantize(jnp.asarray(rng.standard_normal((K, N)), jnp.float32), fmt, 128 if fmt == "w4a16" else None)
    options = dict(backend=backend, interpret=True)
    np.testing.assert_array_equal(_split(x, w, 2, **options), _blocks(x, w, (2,), **options)[0])


def test_quant_dot_blocks_are_the_per_block_calls():
    """``quant.dot(..., blocks)`` on a frozen weight and on the float master (quantized on the fly,
    per column slice) both give the per-block calls' bits: quantization scales are per column."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.bfloat16)
    master = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
    spec = QuantSpec("w4a16")
    frozen = jax.jit(quant.quantize_params, static_argnums=1)({"q_proj": {"kernel": master}}, spec)
    frozen = frozen["q_proj"]["kernel"]
    (want,) = _blocks(x, frozen, (4,))
    dot = jax.jit(lambda x, w: quant.dot(x, w, spec, "attention", 4))  # one program each, as in a forward
    np.testing.assert_array_equal(np.asarray(dot(x, frozen)), want)
    np.testing.assert_array_equal(np.asarray(dot(x, master)), want)


BF16_MOE = preset("qwen3-moe-tiny", dtype="bfloat16")  # 4 heads, 2 kv heads, 8 experts


def test_layouts_that_cannot_stay_bitwise_are_refused():
    # more devices than kv heads replicates them (tests/test_rollout_matrix.py); a degree that neither
    # divides nor is a multiple of them cannot give each device whole kv heads or whole copies
    assert layout.check_layout(layout.RolloutMesh(data=2, tensor=4), BF16_MOE, 8)["tensor"] == 4
    odd = preset(
        "qwen3-tiny", hidden_size=192, num_attention_heads=12, num_key_value_heads=4, dtype="bfloat16"
    )
    with pytest.raises(
        ConfigError, match=r"rollout.mesh.tensor=6 and the model's 4 kv heads: one must divide"
    ):
        layout.check_layout(layout.RolloutMesh(data=1, tensor=6), odd, 6)
    # f32 compute too, where the degree divides the kv heads and where it replicates them
    # (tests/test_rollout_matrix.py's f32 cells)
    assert layout.check_layout(layout.RolloutMesh(data=4, tensor=2), preset("qwen3-tiny"), 8)["tensor"] == 2
    f32_moe = preset("qwen3-moe-tiny")  # 2 kv heads, float32 compute
    assert layout.check_layout(layout.RolloutMesh(data=2, tensor=4), f32_moe, 8)["tensor"] == 4
    with pytest.raises(ConfigError, match=r"rollout.mesh.tensor=3 does not divide the model's 4 attention"):
        layout.check_layout(layout.RolloutMesh(data=1, tensor=3), BF16_MOE, 3)
