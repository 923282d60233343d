"""qarl_jax.quant: float master (training) and frozen weights (rollout) give bitwise equal outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import kernels_pallas as kp
from qarl_jax.quant import QuantSpec, dot, grouped_dot, kind_of, quantize_params

K, N, E = 128, 32, 3
SPECS = [
    QuantSpec(fmt="bf16"),
    QuantSpec(fmt="w8a8"),
    QuantSpec(fmt="w4a16", group_size=32),
    QuantSpec(fmt="w4a8"),
    QuantSpec(fmt="fp8"),
]


def _rand(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32).astype(dtype)


def _params(seed=0):
    return {
        "embed_tokens": {"embedding": _rand((50, K), seed)},
        "layers_0": {
            "self_attn": {
                "q_proj": {"kernel": _rand((K, N), seed + 1)},
                "q_norm": {"scale": _rand((N,), seed)},
            },
            "mlp": {"gate_proj": {"kernel": _rand((K, N), seed + 2)}},
            "moe": {
                "gate": {"kernel": _rand((K, E), seed + 3)},
                "experts": {"up_proj": _rand((E, K, N), seed + 4)},
            },
        },
        "lm_head": {"kernel": _rand((K, 50), seed + 5)},
    }


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.fmt)
def test_master_and_frozen_bitwise_equal(spec):
    params = _params()
    frozen = quantize_params(params, spec)
    x = _rand((2, 5, K), 10, jnp.bfloat16)
    layers, flayers = params["layers_0"], frozen["layers_0"]
    pairs = {
        "attention": (layers["self_attn"]["q_proj"]["kernel"], flayers["self_attn"]["q_proj"]["kernel"]),
        "mlp": (layers["mlp"]["gate_proj"]["kernel"], flayers["mlp"]["gate_proj"]["kernel"]),
        "router": (layers["moe"]["gate"]["kernel"], flayers["moe"]["gate"]["kernel"]),
        "lm_head": (params["lm_head"]["kernel"], frozen["lm_head"]["kernel"]),
    }
    for kind, (master, fz) in pairs.items():
        train = np.asarray(jax.jit(lambda x, w, kind=kind: dot(x, w, spec, kind))(x, master), np.float32)
        np.testing.assert_array_equal(train, np.asarray(dot(x, fz, spec, kind), np.float32))
        # AQT quantizes (training and freeze) to kernels_pallas' integers: outputs as without AQT
        fmt, group_size = spec.format_of(kind)
        direct = kp.quantized_matmul(x, kp.quantize(master, fmt, group_size))
        np.testing.assert_array_equal(train, np.asarray(direct, np.float32))
    sizes = jnp.array([3, 0, 6], jnp.int32)
    xe = _rand((10, K), 11)
    master, fz = layers["moe"]["experts"]["up_proj"], flayers["moe"]["experts"]["up_proj"]
    train = grouped_dot(xe, master, sizes, spec)
    np.testing.assert_array_equal(train, grouped_dot(xe, fz, sizes, spec))
    fmt, group_size = spec.format_of("experts")
    np.testing.assert_array_equal(train, kp.grouped_matmul(xe, kp.quantize(master, fmt, group_size), sizes))


def test_quantize_params_kinds():
    frozen = quantize_params(_params(), QuantSpec(fmt="w4a16"))
    layers = frozen["layers_0"]
    assert isinstance(layers["self_attn"]["q_proj"]["kernel"], kp.QuantizedWeight)
    assert isinstance(layers["mlp"]["gate_proj"]["kernel"], kp.QuantizedWeight)
    experts = layers["moe"]["experts"]["up_proj"]
    assert isinstance(experts, kp.QuantizedWeight) and experts.values.shape == (E, K // 2, N)
    for leaf in (
        layers["moe"]["gate"]["kernel"],
        frozen["lm_head"]["kernel"],
        frozen["embed_tokens"]["embedding"],
    ):
        assert not isinstance(leaf, kp.QuantizedWeight)
    head = quantize_params(_params(), QuantSpec(fmt="w8a8", quantized=("lm_head",)))["lm_head"]["kernel"]
    assert isinstance(head, kp.QuantizedWeight) and head.fmt == "w8a8"
    assert jax.tree.structure(quantize_params(_params(), QuantSpec())) == jax.tree.structure(_params())


def test_kind_of_rules():
    assert kind_of(("layers_0", "self_attn", "o_proj", "kernel")) == "attention"
    assert kind_of(("layers_0", "mlp", "down_proj", "kernel")) == "mlp"
    assert kind_of(("layers_0", "mlp", "experts", "gate_proj")) == "experts"
    assert kind_of(("layers_0", "mlp", "gate", "kernel")) == "router"
    assert kind_of(("lm_head", "kernel")) == "lm_head"
    assert kind_of(("layers_0", "mlp", "down_proj", "bias")) is None
    assert kind_of(("embed_tokens", "embedding")) is None


def test_unquantized_kinds_run_bf16_kernel():
    spec = QuantSpec(fmt="w4a16", group_size=32)
    x, w = _rand((4, K), 12), _rand((K, N), 13)
    head = dot(x, w, spec, "lm_head")
    np.testing.assert_array_equal(head, kp.quantized_matmul(x, kp.quantize(w, "bf16")))
    assert not np.array_equal(head, dot(x, w, spec, "mlp"))


def test_spec_none_is_plain_xla():
    x, w = _rand((3, 4, K), 14), _rand((K, N), 15)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(dot(x, w, None, "mlp"), want, rtol=1e-5, atol=1e-4)
    wq = kp.quantize(w, "w8a8")
    np.testing.assert_allclose(
        dot(x, wq, None, "mlp"), np.asarray(x) @ np.asarray(kp.dequantize(wq)), rtol=1e-5, atol=1e-4
    )
    xe, we = _rand((7, K), 16), _rand((E, K, N), 17)
    sizes = jnp.array([2, 2, 3], jnp.int32)
    want = lax.ragged_dot(xe, we, sizes, precision=lax.Precision.HIGHEST)
    np.testing.assert_array_equal(grouped_dot(xe, we, sizes, None), want)


@pytest.mark.parametrize("spec", SPECS[1:3], ids=lambda s: s.fmt)
def test_gradients_flow_to_master_weights(spec):
    """The STE on AQT-quantized weights: the gradients of the kernels_pallas STE, bit for bit."""
    x, w = _rand((6, K), 18), _rand((K, N), 19)
    fmt, group_size = spec.format_of("attention")
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(dot(x, w, spec, "attention") ** 2), (0, 1)))(x, w)
    want = jax.jit(
        jax.grad(lambda x, w: jnp.sum(kp.quantized_matmul_ste(x, w, fmt, group_size) ** 2), (0, 1))
    )(x, w)
    assert float(jnp.abs(grads[1]).max()) > 0
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_array_equal(got, ref)
    xe, we, sizes = _rand((7, K), 20), _rand((E, K, N), 21), jnp.array([2, 4, 1], jnp.int32)
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(grouped_dot(x, w, sizes, spec) ** 2), (0, 1)))(xe, we)
    want = jax.jit(
        jax.grad(lambda x, w: jnp.sum(kp.grouped_matmul_ste(x, w, sizes, fmt, group_size) ** 2), (0, 1))
    )(xe, we)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_array_equal(got, ref)


def test_bridge_errors():
    with pytest.raises(ValueError, match="unknown quantization format 'int3'"):
        QuantSpec(fmt="int3")
    with pytest.raises(ValueError, match=r"unknown layer kinds \['conv'\]"):
        QuantSpec(quantized=("mlp", "conv"))
    x, w = _rand((2, K), 20), _rand((K, N), 21)
    with pytest.raises(ValueError, match="unknown layer kind 'ffn'"):
        dot(x, w, QuantSpec(), "ffn")
    with pytest.raises(
        ValueError, match="mlp weight is frozen as 'w8a8' but the spec runs mlp layers in 'w4a16'"
    ):
        dot(x, kp.quantize(w, "w8a8"), QuantSpec(fmt="w4a16"), "mlp")
    with pytest.raises(ValueError, match="not a multiple of the group size 96"):
        dot(x, w, QuantSpec(fmt="w4a16", group_size=96), "mlp")
