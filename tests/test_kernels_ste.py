"""Straight-through estimators: forward == frozen-weight kernel bitwise, gradients == dequantized math."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import kernels_pallas as kp

K, N, E = 128, 24, 3
GROUP = {"bf16": None, "w8a8": None, "w4a16": 32, "w4a8": 32, "fp8": None}


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _straight_through(w_master, fmt):
    """The textbook STE: value of the dequantized weight, gradient of the identity."""
    deq = kp.dequantize(kp.quantize(w_master, fmt, GROUP[fmt]))
    return w_master + lax.stop_gradient(deq - w_master)


@pytest.mark.parametrize("fmt", kp.FORMATS)
def test_ste_forward_is_frozen_kernel_bitwise(fmt):
    x, wm = _rand((2, 5, K), 0), _rand((K, N), 1)
    y = jax.jit(lambda x, w: kp.quantized_matmul_ste(x, w, fmt, GROUP[fmt]))(x, wm)
    frozen = kp.quantized_matmul(x, kp.quantize(wm, fmt, GROUP[fmt]))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(frozen))


@pytest.mark.parametrize("fmt", kp.FORMATS)
def test_ste_gradients_match_dequantized_reference(fmt):
    x, wm, c = _rand((7, K), 2), _rand((K, N), 3), _rand((7, N), 4)
    loss = jax.jit(jax.grad(lambda x, w: jnp.sum(kp.quantized_matmul_ste(x, w, fmt, GROUP[fmt]) * c), (0, 1)))
    dx, dw = loss(x, wm)

    def ref_loss(x, w):
        return jnp.sum(jnp.matmul(x, _straight_through(w, fmt), precision="highest") * c)

    rx, rw = jax.grad(ref_loss, (0, 1))(x, wm)
    np.testing.assert_allclose(dx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, rw, rtol=1e-5, atol=1e-5)
    if fmt != "bf16":  # the weight gradient is the identity's, not the dequantized weight's
        assert not np.allclose(dx, c @ wm.T, rtol=1e-3)


def test_ste_gradient_dtypes_follow_inputs():
    x, wm = _rand((3, K), 5).astype(jnp.bfloat16), _rand((K, N), 6)
    dx, dw = jax.grad(
        lambda x, w: jnp.sum(kp.quantized_matmul_ste(x, w, "w4a16", 32).astype(jnp.float32)), (0, 1)
    )(x, wm)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


@pytest.mark.parametrize("fmt", ("bf16", "w4a16"))
def test_ste_finite_differences(fmt):
    """bf16: quantization is the identity, so both gradients are true derivatives. w4a16: x enters
    linearly (no activation quantization), so dx is the true derivative."""
    x, wm = _rand((4, K), 7), _rand((K, N), 8)
    if fmt == "bf16":
        check_grads(
            lambda x, w: kp.quantized_matmul_ste(x, w, fmt), (x, wm), order=1, modes=["rev"], eps=1e-2
        )
    else:
        check_grads(lambda x: kp.quantized_matmul_ste(x, wm, fmt, 32), (x,), order=1, modes=["rev"], eps=1e-2)


@pytest.mark.parametrize("fmt", kp.FORMATS)
def test_grouped_ste_forward_and_gradients(fmt):
    x, wm, c = _rand((11, K), 9), _rand((E, K, N), 10), _rand((11, N), 11)
    sizes = jnp.array([4, 0, 6], jnp.int32)  # the last row belongs to no expert
    y = kp.grouped_matmul_ste(x, wm, sizes, fmt, GROUP[fmt])
    np.testing.assert_array_equal(y, kp.grouped_matmul(x, kp.quantize(wm, fmt, GROUP[fmt]), sizes))
    loss = jax.grad(lambda x, w: jnp.sum(kp.grouped_matmul_ste(x, w, sizes, fmt, GROUP[fmt]) * c), (0, 1))
    dx, dw = jax.jit(loss)(x, wm)  # one program (op by op, the backward compiled dozens)

    def ref_loss(x, w):
        ragged = lax.ragged_dot(x, _straight_through(w, fmt), sizes, precision=lax.Precision.HIGHEST)
        return jnp.sum(ragged * c)

    rx, rw = jax.jit(jax.grad(ref_loss, (0, 1)))(x, wm)
    np.testing.assert_allclose(dx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, rw, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(dx[10]) == 0) and np.all(np.asarray(dw[1]) == 0)


def test_grouped_ste_finite_differences():
    x, wm = _rand((6, K), 12), _rand((E, K, N), 13)
    sizes = jnp.array([2, 3, 1], jnp.int32)
    check_grads(
        lambda x, w: kp.grouped_matmul_ste(x, w, sizes, "bf16"), (x, wm), order=1, modes=["rev"], eps=1e-2
    )


def test_ste_errors():
    with pytest.raises(ValueError, match=r"w_master must be \[K, N\]"):
        kp.quantized_matmul_ste(jnp.ones((2, K)), jnp.ones((E, K, N)), "w8a8")
    with pytest.raises(ValueError, match=r"w_master must be \[E, K, N\]"):
        kp.grouped_matmul_ste(jnp.ones((2, K)), jnp.ones((K, N)), jnp.ones(E, jnp.int32), "w8a8")
    with pytest.raises(ValueError, match="unknown quantization format"):
        kp.quantized_matmul_ste(jnp.ones((2, K)), jnp.ones((K, N)), "fp4")
