"""Row-wise kernels (CPU path): float64 references, bitwise row invariance, gradients, and a
negative control showing the invariance checks can fail."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import slow_but

from kernels_pallas import rowwise

M = 150  # three 64-row blocks for V=128; the prefixes below cover one block, one row, block edges


def rows(m: int = M, n: int = 128, seed: int = 0, scale: float = 3.0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (m, n)) * scale


def assert_row_invariant(f, *args):
    """Every prefix of the rows (1 row, one block, block edges) gives the full call's row bits, and
    so does a permutation of the rows. (One prefix a path: a part block, one short of a block, a
    whole block, one past it; the full call's M = 150 is whole blocks and a part one.)"""
    args = [np.asarray(a) for a in args]  # numpy: slicing compiles nothing (each call is f's program)
    full = np.asarray(f(*args))
    for m in (1, 63, 64, 65):
        np.testing.assert_array_equal(np.asarray(f(*(a[:m] for a in args))), full[:m])
    perm = np.random.default_rng(0).permutation(args[0].shape[0])
    np.testing.assert_array_equal(np.asarray(f(*(a[perm] for a in args))), full[perm])


def test_rms_norm_matches_f64_and_is_row_invariant():
    x, w = rows(n=96), jnp.linspace(0.5, 1.5, 96)
    f = jax.jit(lambda x: rowwise.rms_norm(x, w, 1e-6))
    x64 = np.asarray(x, np.float64)
    ref = np.asarray(w, np.float64) * x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(f(x)), ref, rtol=2e-6, atol=1e-6)
    assert_row_invariant(f, x)


@pytest.mark.parametrize("scaled", slow_but([False, True], True))
def test_rope_matches_f64_and_is_row_invariant(scaled):
    """theta's frequencies, or given ones (a scaled RoPE's: here the lower half divided by 8)."""
    x = rows(n=4 * 32).reshape(M, 4, 32)
    pos = jnp.asarray(np.random.default_rng(1).integers(0, 5000, M), jnp.int32)
    inv = (
        1.0 / 1e4 ** (np.arange(0, 32, 2) / 32) / (np.where(np.arange(16) >= 8, 8.0, 1.0) if scaled else 1.0)
    )
    inv = inv.astype(np.float32).astype(np.float64)  # the f32 frequencies the kernel is given
    given = tuple(inv) if scaled else None
    f = jax.jit(lambda x, p: rowwise.rope(x, p, 1e4, given))
    ang = np.asarray(pos, np.float64)[:, None] * inv
    cos, sin = (
        np.cos(np.concatenate([ang, ang], -1))[:, None],
        np.sin(np.concatenate([ang, ang], -1))[:, None],
    )
    x64 = np.asarray(x, np.float64)
    ref = x64 * cos + np.concatenate([-x64[..., 16:], x64[..., :16]], -1) * sin
    np.testing.assert_allclose(np.asarray(f(x, pos)), ref, atol=5e-3)  # f32 angles of 5000 rad
    assert_row_invariant(f, x, pos)


@pytest.mark.parametrize("temperature", slow_but([1.0, 0.7], 0.7))
@pytest.mark.parametrize("v, block_v", slow_but([(128, None), (1000, 256)], (1000, 256), several=True))
def test_log_softmax_and_token_logprobs(v, block_v, temperature):
    """Chunked vocabulary (V=1000 in chunks of 256, the last one padded) against float64, and
    token_logprobs bitwise equal to log_softmax at the target."""
    x = rows(n=v)
    t = jnp.asarray(np.random.default_rng(2).integers(0, v, M), jnp.int32)
    lsm = jax.jit(lambda x: rowwise.log_softmax(x, temperature, block_v=block_v))
    tok = jax.jit(lambda x, t: rowwise.token_logprobs(x, t, temperature, block_v=block_v))
    z = np.asarray(x, np.float64) / temperature
    ref = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(lsm(x)), ref, atol=2e-5)
    got = np.asarray(tok(x, t))
    np.testing.assert_array_equal(
        got, np.take_along_axis(np.asarray(lsm(x)), np.asarray(t)[:, None], 1)[:, 0]
    )
    assert_row_invariant(tok, x, t)


@pytest.mark.slow
def test_big_vocabulary_chunks():
    """A 151,936-entry row (Qwen3's vocabulary) in 2,048-wide chunks."""
    x = rows(m=3, n=151_936, scale=5.0)
    lse = np.asarray(jax.jit(rowwise.logsumexp)(x))
    np.testing.assert_allclose(lse, np.asarray(jax.nn.logsumexp(np.asarray(x, np.float64), -1)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.jit(rowwise.logsumexp)(x[1:2])), lse[1:2])


@pytest.mark.slow
def test_gradients_match_reference():
    x, w = rows(m=5, n=64), jnp.linspace(0.5, 1.5, 64)
    t = jnp.arange(5) * 7

    def ours(x, w):
        return jnp.sum(rowwise.token_logprobs(rowwise.rms_norm(x, w, 1e-6), t, 0.8) ** 2)

    def ref(x, w):
        z = rowwise.reference_rms_norm(x, w, 1e-6) / 0.8
        return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(z), t[:, None], 1) ** 2)

    grads = lambda f: jax.jit(jax.grad(f, (0, 1)))(x, w)  # one program (op by op: dozens)
    for a, b in zip(grads(ours), grads(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    xr = rows(m=5, n=2 * 16).reshape(5, 2, 16)
    pos = jnp.arange(5) * 3
    g1 = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(rowwise.rope(x, pos, 100.0)))))(xr)
    g2 = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(rowwise.reference_rope(x, pos, 100.0)))))(xr)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_invariance_check_can_fail():
    """Negative control: plain XLA log-sum-exp changes the chunk order -> other bits somewhere."""
    x = rows(m=64, n=151_936 // 16, scale=4.0)
    chunked = np.asarray(jax.jit(lambda x: rowwise.logsumexp(x, block_v=128))(x))
    other = np.asarray(jax.jit(lambda x: rowwise.logsumexp(x, block_v=1024))(x))
    assert not np.array_equal(chunked, other)


def test_errors():
    with pytest.raises(ValueError, match="weight"):
        rowwise.rms_norm(rows(m=2, n=8), jnp.ones(4), 1e-6)
    with pytest.raises(ValueError, match="temperature"):
        rowwise.logsumexp(rows(m=2, n=8), 0.0)
    with pytest.raises(ValueError, match="positions"):
        rowwise.rope(rows(m=2, n=8).reshape(2, 1, 8), jnp.zeros(3, jnp.int32), 1e4)
