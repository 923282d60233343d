"""backend="xla" (XLA's own ops, not batch-invariant): the same values as the invariant CPU
kernels up to f32 rounding, selectable per call or for a whole traced region."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import attention, rowwise


@pytest.mark.parametrize("fmt", ["bf16", "w8a8", "w4a16", "w4a8", "fp8"])
def test_matmuls_match_the_invariant_kernels(fmt):
    x = jax.random.normal(jax.random.key(0), (5, 256), jnp.bfloat16)
    w, we = (
        jax.random.normal(jax.random.key(1), (256, 96)),
        jax.random.normal(jax.random.key(2), (2, 256, 96)),
    )
    qw, qe, gs = kp.quantize(w, fmt), kp.quantize(we, fmt), jnp.array([2, 3], jnp.int32)
    cpu = kp.quantized_matmul(x, qw, out_dtype=jnp.float32)
    f = lambda x, w: kp.quantized_matmul(x, w, out_dtype=jnp.float32)
    with kp.default_backend("xla"):  # read at trace time
        xla = jax.jit(f)(x, qw)
        xla_program = jax.jit(f).lower(x, qw).as_text()
    np.testing.assert_allclose(xla, cpu, rtol=2e-6, atol=2e-5)
    # the region really ran XLA's ops: no row-block loop (the invariant kernel's is a while loop;
    # a new function: jit's trace cache would hand back the xla trace of ``f``)
    invariant = jax.jit(lambda x, w: kp.quantized_matmul(x, w, out_dtype=jnp.float32))
    assert "while" not in xla_program and "while" in invariant.lower(x, qw).as_text()
    g_cpu = kp.grouped_matmul(x, qe, gs, out_dtype=jnp.float32)
    g_xla = kp.grouped_matmul(x, qe, gs, out_dtype=jnp.float32, backend="xla")
    np.testing.assert_allclose(g_xla, g_cpu, rtol=2e-6, atol=2e-5)


def test_rowwise_and_attention_match_the_invariant_kernels():
    rs = np.random.RandomState(0)
    q = jnp.asarray(rs.randn(2, 5, 4, 16), jnp.float32)
    k, v = (jnp.asarray(rs.randn(2, 40, 2, 16), jnp.float32) for _ in range(2))
    pos = jnp.asarray([[3, 10, 20, 30, 39], [0, 1, 2, 3, 4]], jnp.int32)
    np.testing.assert_allclose(
        attention.attention(q, k, v, pos, backend="xla"), attention.attention(q, k, v, pos), atol=1e-5
    )
    x, w = jnp.asarray(rs.randn(6, 64), jnp.float32), jnp.asarray(rs.randn(64), jnp.float32)
    np.testing.assert_allclose(
        rowwise.rms_norm(x, w, 1e-6, backend="xla"), rowwise.rms_norm(x, w, 1e-6), atol=1e-6
    )
    lg = jnp.asarray(rs.randn(4, 1000), jnp.float32)
    np.testing.assert_allclose(
        rowwise.log_softmax(lg, 0.7, backend="xla"), rowwise.log_softmax(lg, 0.7), rtol=1e-6, atol=1e-5
    )
    with pytest.raises(ValueError, match="unknown backend 'XLA'"):
        with kp.default_backend("XLA"):
            pass
