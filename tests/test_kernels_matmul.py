"""Dense quantized matmul on the CPU path: accuracy against float64/int64, row invariance, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import slow_but

import kernels_pallas as kp
from kernels_pallas.formats import int_values
from kernels_pallas.matmul import cpu as cpu_matmul

K, N = 256, 48
GROUP = {"bf16": None, "w8a8": None, "w4a16": 64, "w4a8": 64, "fp8": None}
DTYPES = (jnp.float32, jnp.bfloat16)


@functools.cache
def _weight(fmt, seed=0, k=K, n=N):
    """Quantized by one program (op by op, quantize compiled ~10), once per module."""
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    return QUANTIZE(jnp.asarray(w), fmt, GROUP[fmt])


QUANTIZE = jax.jit(kp.quantize, static_argnums=(1, 2))


def _x(m, seed, dtype=jnp.float32, k=K):
    """Activations, numpy (casting and slicing them compiles nothing)."""
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32).astype(dtype)


def _abs_bound(x, w):
    """|x| @ |w| in float64: the scale of a dot product's rounding error."""
    deq = np.abs(np.asarray(kp.dequantize(w), np.float64))
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    if kp.formats.ACT_BITS[w.fmt] == 8:
        q, s = kp.quantize_activations(x, w.fmt)
        xs = np.asarray(q, np.float64) * np.asarray(s, np.float64)
    return np.abs(xs) @ deq


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", slow_but(kp.FORMATS, "w4a16"))
def test_float_formats_within_k_ulp_of_float64(fmt, dtype):
    w = _weight(fmt, seed=1)
    x = _x(29, seed=2, dtype=dtype)
    y = np.asarray(kp.quantized_matmul(x, w, out_dtype=jnp.float32), np.float64)
    ref = kp.reference_matmul(np.asarray(x.astype(jnp.float32)), w)
    err = np.abs(y - ref)
    bound = K * 2.0**-23 * _abs_bound(x, w)
    assert np.all(err <= bound), float(np.max(err / bound))
    assert np.max(err) > 0 or fmt == "w8a8"  # the comparison is not vacuous


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_equals_int64_numpy_exactly(dtype):
    w = _weight("w8a8", seed=3)
    x = _x(21, seed=4, dtype=dtype)
    y = np.asarray(kp.quantized_matmul(x, w, out_dtype=jnp.float32))
    qx, sx = (np.asarray(a) for a in kp.quantize_activations(x))
    acc = qx.astype(np.int64) @ np.asarray(int_values(w), np.int64)
    assert np.abs(acc).max() < 2**31
    want = (acc.astype(np.float32) * sx.astype(np.float32)) * np.asarray(w.scales, np.float32)[0]
    np.testing.assert_array_equal(y, want)


def test_fp8_quantization_is_e4m3_per_channel_and_per_token():
    """fp8 weights: e4m3 values, one scale per column mapping its abs-max to 448 exactly (scale 1
    for an all-zero column); activations likewise per row. Dequantized, each is within e4m3's
    half step (2^-4 relative; 2^-10 absolute below the normal range) of the input."""
    w = np.random.default_rng(21).standard_normal((K, N)).astype(np.float32)
    w[:, 0] = 0.0
    wq = kp.quantize(jnp.asarray(w), "fp8")
    assert wq.values.dtype == jnp.float8_e4m3fn and wq.scales.shape == (1, N)
    q = np.asarray(wq.values, np.float32)
    np.testing.assert_array_equal(np.abs(q[:, 1:]).max(0), np.full(N - 1, 448.0, np.float32))
    assert wq.scales[0, 0] == 1.0 and not q[:, 0].any()
    scaled = w / np.asarray(wq.scales)
    assert np.all(np.abs(q - scaled) <= np.maximum(np.abs(scaled) * 2.0**-4, 2.0**-10))
    x = _x(7, seed=22) * 1e-3
    qx, sx = kp.quantize_activations(x, "fp8")
    assert qx.dtype == jnp.float8_e4m3fn and sx.shape == (7, 1)
    np.testing.assert_array_equal(np.abs(np.asarray(qx, np.float32)).max(1), np.full(7, 448.0, np.float32))


def test_w4a8_integer_partials_are_exact():
    w = _weight("w4a8", seed=5)
    x = _x(9, seed=6)
    y = np.asarray(kp.quantized_matmul(x, w), np.float64)
    ref = kp.reference_matmul(np.asarray(x), w)
    np.testing.assert_allclose(y, ref, rtol=0, atol=float(np.max(K * 2.0**-23 * _abs_bound(x, w))))


@pytest.mark.parametrize("fmt", slow_but(kp.FORMATS, "w4a16"))
def test_leading_dims_and_out_dtype(fmt):
    w = _weight(fmt, seed=7)
    x = _x(12, seed=8, dtype=jnp.bfloat16)
    y = kp.quantized_matmul(x.reshape(3, 4, K), w)
    assert y.shape == (3, 4, N) and y.dtype == jnp.bfloat16
    flat = kp.quantized_matmul(x, w)
    np.testing.assert_array_equal(np.asarray(y.reshape(12, N), np.float32), np.asarray(flat, np.float32))


def test_default_block_rows_depends_on_k_n_only():
    assert cpu_matmul.default_block_rows(256, 48) == 64
    assert cpu_matmul.default_block_rows(4096, 4096) == 16
    assert cpu_matmul.default_block_rows(1 << 16, 8) == 8


def test_one_block_loop_is_a_real_while_loop():
    """XLA straight-lines a loop it knows runs once; the opaque trip count must prevent it."""
    w = _weight("w4a16")
    hlo = jax.jit(lambda x: kp.quantized_matmul(x, w, block_rows=8)).lower(_x(3, 0)).compile().as_text()
    assert any(" while(" in line for line in hlo.splitlines())


M_BUCKETS = (1, 5, 16, 33)


@pytest.mark.parametrize("fmt", slow_but(kp.FORMATS, "w4a16"))
@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    m=st.sampled_from(M_BUCKETS),
    pos=st.integers(0, 32),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from((1e-3, 1.0, 1e3)),
    bf16=st.booleans(),
)
def test_rows_bitwise_invariant(fmt, m, pos, seed, scale, bf16):
    """A row's output is the same bits alone, at any position among any neighbours, for any M."""
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    w = _weight(fmt, seed=11)
    row = _x(1, seed, dtype)
    pos = pos % m
    batch = (_x(m, seed + 1, jnp.float32) * np.float32(scale)).astype(dtype)
    batch[pos] = row[0]
    alone = kp.quantized_matmul(row, w, block_rows=8)
    inside = kp.quantized_matmul(batch, w, block_rows=8)
    np.testing.assert_array_equal(np.asarray(inside, np.float32)[pos], np.asarray(alone, np.float32)[0])


@pytest.mark.parametrize("fmt", slow_but(kp.FORMATS, "w4a16"))
def test_rows_invariant_at_default_block(fmt):
    w = _weight(fmt, seed=12)
    x = _x(130, seed=13)
    many = np.asarray(kp.quantized_matmul(x, w))
    for r in (0, 63, 64, 129):
        np.testing.assert_array_equal(np.asarray(kp.quantized_matmul(x[r : r + 1], w))[0], many[r])


def test_error_unknown_format():
    with pytest.raises(ValueError, match="unknown quantization format 'w2a2'"):
        kp.quantize(jnp.ones((8, 8)), "w2a2")
    w = kp.QuantizedWeight(
        values=jnp.ones((8, 8), jnp.int8), scales=jnp.ones((1, 8)), fmt="int8", group_size=8
    )
    with pytest.raises(ValueError, match="'int8'"):
        kp.quantized_matmul(jnp.ones((2, 8)), w)


def test_error_group_size_and_odd_k():
    with pytest.raises(ValueError, match="not a multiple of the group size 64"):
        kp.quantize(jnp.ones((96, 8)), "w4a16", 64)
    with pytest.raises(ValueError, match="K=7 is odd"):
        kp.quantize(jnp.ones((7, 8)), "w4a16", 7)
    with pytest.raises(ValueError, match="per output channel"):
        kp.quantize(jnp.ones((64, 8)), "w8a8", 32)


def test_error_dtypes():
    w = _weight("w8a8")
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32, got int32"):
        kp.quantized_matmul(jnp.ones((2, K), jnp.int32), w)
    with pytest.raises(TypeError, match="floating-point weights"):
        kp.quantize(jnp.ones((8, 8), jnp.int32), "w8a8")
    with pytest.raises(TypeError, match="expected a QuantizedWeight, got ArrayImpl"):
        kp.quantized_matmul(jnp.ones((2, K)), jnp.ones((K, N)))
    bad = kp.QuantizedWeight(values=w.values.astype(jnp.int32), scales=w.scales, fmt="w8a8", group_size=K)
    with pytest.raises(TypeError, match="must be int8, got int32"):
        kp.quantized_matmul(jnp.ones((2, K)), bad)
    int8_as_fp8 = kp.QuantizedWeight(values=w.values, scales=w.scales, fmt="fp8", group_size=K)
    with pytest.raises(TypeError, match="fp8 weight values must be float8_e4m3fn, got int8"):
        kp.quantized_matmul(jnp.ones((2, K)), int8_as_fp8)


def test_error_shapes_and_backend():
    w = _weight("w4a16")
    with pytest.raises(ValueError, match="last dimension must be K=256"):
        kp.quantized_matmul(jnp.ones((2, K + 2)), w)
    bad = kp.QuantizedWeight(values=w.values, scales=w.scales[:1], fmt="w4a16", group_size=64)
    with pytest.raises(ValueError, match=r"scales must have shape \(4, 48\)"):
        kp.quantized_matmul(jnp.ones((2, K)), bad)
    with pytest.raises(ValueError, match="rank 2"):
        kp.quantized_matmul(jnp.ones((2, K)), kp.quantize(jnp.ones((2, K, N)), "w4a16"))
    with pytest.raises(ValueError, match="unknown backend 'metal'"):
        kp.quantized_matmul(jnp.ones((2, K)), w, backend="metal")


def test_error_options():
    """The keyword options are checked: unknown names, a knob the backend's kernel lacks, the
    interpreter without a Pallas kernel."""
    w, x = _weight("w8a8"), jnp.ones((2, K))
    with pytest.raises(TypeError, match="unknown option 'bogus'"):
        kp.quantized_matmul(x, w, bogus=1)
    with pytest.raises(TypeError, match="no tiling knob 'block_n'"):
        kp.quantized_matmul(x, w, backend="cpu", block_n=32)
    with pytest.raises(ValueError, match="interpret=True"):
        kp.quantized_matmul(x, w, backend="cpu", interpret=True)
    with pytest.raises(TypeError, match="no tiling knob 'num_warps'"):
        kp.quantized_matmul(x, w, backend="tpu", interpret=True, num_warps=4)
