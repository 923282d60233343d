"""AQT path: TRAIN (on-the-fly) and SERVE (frozen) outputs bitwise equal, rows batch-invariant."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qarl_jax.quant import aqt as qaqt

K, N = 128, 40


class Dense(nn.Module):
    fmt: str
    mode: qaqt.QuantMode

    @nn.compact
    def __call__(self, x):
        return nn.Dense(N, use_bias=False, dot_general=qaqt.aqt_dot_general(self.fmt, self.mode), name="d")(x)


def _x(m, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, K)), jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("fmt", qaqt.AQT_FORMATS)
def test_train_and_serve_bitwise_equal(fmt, dtype):
    x = _x(70, 0, dtype)
    train = Dense(fmt, qaqt.QuantMode.TRAIN)
    params = train.init(jax.random.key(1), x)
    y_train = jax.jit(train.apply)(params, x)
    _, frozen = Dense(fmt, qaqt.QuantMode.CONVERT).apply(params, x, mutable=True)
    qvalue = jax.tree.leaves(frozen["aqt"])[0]
    assert jnp.issubdtype(qvalue.dtype, jnp.integer)  # SERVE really reads frozen integers
    serve = Dense(fmt, qaqt.QuantMode.SERVE)
    zeroed = {"params": jax.tree.map(jnp.zeros_like, params["params"]), "aqt": frozen["aqt"]}
    y_serve = jax.jit(serve.apply)(zeroed, x)
    np.testing.assert_array_equal(np.asarray(y_train, np.float32), np.asarray(y_serve, np.float32))
    one = jax.jit(serve.apply)(zeroed, x[37:38])
    np.testing.assert_array_equal(np.asarray(one[0], np.float32), np.asarray(y_serve[37], np.float32))
    ref = np.asarray(x, np.float64) @ np.asarray(params["params"]["d"]["kernel"], np.float64)
    rel = np.abs(np.asarray(y_serve, np.float64) - ref).max() / np.abs(ref).max()
    assert rel < (0.15 if "w4" in fmt else 0.02)  # per-channel int4 is coarse: a sanity bound


def test_injected_raw_dot_is_row_blocked():
    x = _x(3, 1)
    serve = Dense("w8a8", qaqt.QuantMode.TRAIN)
    params = serve.init(jax.random.key(2), x)
    hlo = jax.jit(serve.apply).lower(params, x).compile().as_text()
    assert any(" while(" in line for line in hlo.splitlines())


def test_aqt_gradients_are_straight_through():
    x = _x(8, 3)
    train = Dense("w4a16", qaqt.QuantMode.TRAIN)
    params = train.init(jax.random.key(4), x)
    g = jax.grad(lambda p: jnp.sum(train.apply(p, x)))(params)["params"]["d"]["kernel"]
    np.testing.assert_allclose(
        g, np.broadcast_to(np.asarray(x).sum(0)[:, None], (K, N)), rtol=1e-5, atol=1e-5
    )


def test_invariant_dot_general_falls_back_for_other_contractions():
    a, b = _x(4, 5), _x(6, 6)
    dims = (((1,), (1,)), ((), ()))
    np.testing.assert_array_equal(qaqt.invariant_dot_general(a, b, dims), jax.lax.dot_general(a, b, dims))


def test_aqt_errors():
    with pytest.raises(ValueError, match="bf16 needs no quantizer"):
        qaqt.aqt_config("bf16")
    with pytest.raises(ValueError, match="unknown quantization format 'w3a3'"):
        qaqt.aqt_config("w3a3")
