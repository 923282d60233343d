"""fused_rows: a chain of row-wise kernels as one row-block program. Its rows are bitwise
independent of the batch (prefixes, permutations, other programs around it), it is ONE loop in the
compiled program, it stays within the float64 reference's tolerance, and its gradient is the
chain's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import slow_but

from kernels_pallas import fused_rows, quantize, rowwise
from kernels_pallas.fused import default_block_rows
from kernels_pallas.matmul import quantized_matmul, quantized_matmul_ste

K, N, HEADS, D = 64, 96, 3, 32  # N = HEADS * D
BLOCK = 16


def _weights(fmt: str):
    w = jax.random.normal(jax.random.key(1), (K, N), jnp.float32) * 0.1
    group = 32 if fmt.startswith("w4") else None
    return {"scale": jnp.linspace(0.5, 1.5, K), "w": w if fmt == "bf16" else QUANTIZE(w, fmt, group)}


QUANTIZE = jax.jit(quantize, static_argnums=(1, 2))  # one program, not one per op


def _chain(x, pos, p):
    """RMSNorm -> projection -> per-head RoPE -> residual-style add: a layer's per-token shape."""
    h = rowwise.rms_norm(x, p["scale"], 1e-6)
    w = p["w"]
    y = quantized_matmul(h, w) if not isinstance(w, jax.Array) else quantized_matmul_ste(h, w, "bf16", None)
    y = rowwise.rope(y.reshape(-1, HEADS, D), pos, 1e4).reshape(-1, N)
    return (y + h[:, :1],)


def _inputs(m: int = 70):
    """Rows and their positions, numpy (slicing them compiles nothing; each program is the test's)."""
    x = np.random.default_rng(0).standard_normal((m, K), np.float32)
    return x, np.random.default_rng(2).integers(0, 3000, m).astype(np.int32)


@pytest.mark.parametrize("fmt", slow_but(["bf16", "w8a8", "w4a16"], "w4a16"))
def test_fused_chain_rows_are_invariant_and_match_the_unfused_chain(fmt):
    x, pos = _inputs()
    p = _weights(fmt)
    fused = jax.jit(lambda x, pos: fused_rows(_chain, (x, pos), p, block_rows=BLOCK)[0])
    full = np.asarray(fused(x, pos))
    for m in (1, 16, 17):  # one row, a whole block, one past it (the full 70: several and a part)
        np.testing.assert_array_equal(np.asarray(fused(x[:m], pos[:m])), full[:m])
    perm = np.random.default_rng(0).permutation(x.shape[0])
    np.testing.assert_array_equal(np.asarray(fused(x[perm], pos[perm])), full[perm])
    # inside a bigger program (a producer and a consumer XLA could fuse with): the same bits
    around = jax.jit(lambda x, pos: 2.0 * fused_rows(_chain, (x * 1.0 + 0.0, pos), p, block_rows=BLOCK)[0])
    np.testing.assert_array_equal(np.asarray(around(x, pos)), 2.0 * full)
    # the unfused kernels compute the same chain (their own loops): equal up to fusion rounding
    np.testing.assert_allclose(full, np.asarray(jax.jit(_chain)(x, pos, p)[0]), rtol=2e-5, atol=2e-5)


def test_fused_chain_is_one_loop():
    """The whole chain compiles to one while loop, with RoPE's loop nested in its body (the CPU
    RoPE is never fused: see its kernel); the unfused chain: one loop per kernel."""
    x, pos = _inputs()
    p = _weights("bf16")
    fused = jax.jit(lambda x, pos: fused_rows(_chain, (x, pos), p, block_rows=BLOCK))
    unfused = jax.jit(lambda x, pos: _chain(x, pos, p))
    assert fused.lower(x, pos).compile().as_text().count(" while(") == 2
    assert unfused.lower(x, pos).compile().as_text().count(" while(") == 3


def _grads(f, x, pos, p):
    """The gradient of sum(sin(f(x, pos, p))) in x and p, one jitted program (op by op, the
    backward compiled dozens of small ones)."""
    return jax.jit(jax.grad(lambda x, p: jnp.sum(jnp.sin(f(x, pos, p)[0])), argnums=(0, 1)))(x, p)


@pytest.mark.parametrize("backward_rows", slow_but([None, 8, 20, 64], 8, 20, 64))
def test_fused_gradient_is_the_chains(backward_rows):
    """The backward differentiates the chain itself (straight-through for the matmul), over chunks
    of ``backward_rows`` rows (8: two chunks and a 4-row tail; 20: one chunk; 64: fewer rows than a
    chunk), the weights' cotangents summed over the chunks."""
    x, pos = _inputs(20)
    p = _weights("bf16")
    fused = lambda x, pos, p: fused_rows(_chain, (x, pos), p, block_rows=BLOCK, backward_rows=backward_rows)
    gx, gp = _grads(fused, x, pos, p)
    rx, rp = _grads(_chain, x, pos, p)
    # a chunk's forward runs its block programs on the chunk's rows, not on all 20: an f32 ulp in a
    # normed row can flip its bf16 rounding at the matmul's input (2^-8 of one term of dw's sums)
    atol = 1e-5 if backward_rows in (None, 20, 64) else 2e-4
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gp["w"], rp["w"], rtol=1e-4, atol=atol)
    np.testing.assert_allclose(gp["scale"], rp["scale"], rtol=1e-4, atol=atol)


@pytest.mark.slow
def test_chunked_gradient_matches_finite_differences():
    """A chunked backward (3 chunks and a tail) against central differences of the fused forward
    along random directions (the kernels normalise in f32, so single elements' differences drown
    in rounding; a direction through every input sums thousands of them). Float64 inputs; the
    chain is norm -> dense matmul -> RoPE -> tanh, smooth everywhere."""
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (27, K), jnp.float64)
        pos = jnp.arange(27, dtype=jnp.int32) * 7
        scale = jnp.linspace(0.5, 1.5, K, dtype=jnp.float64)
        w = jax.random.normal(jax.random.key(1), (K, N), jnp.float64) * 0.1

        def chain(x, pos, p):
            h = rowwise.rms_norm(x, p["scale"], 1e-6)
            y = rowwise.rope((h @ p["w"]).reshape(-1, HEADS, D), pos, 1e4).reshape(-1, N)
            return (jnp.tanh(y),)

        @jax.jit
        def f(x, w):
            out = fused_rows(chain, (x, pos), {"scale": scale, "w": w}, block_rows=4, backward_rows=8)[0]
            return jnp.sum(jnp.cos(jnp.arange(out.size).reshape(out.shape)) * out.astype(jnp.float64))

        gx, gw = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
        eps_x, eps_w = 1e-2, 1e-4  # the norm runs in f32: x's differences need the larger step
        for seed in range(3):
            vx = jax.random.normal(jax.random.key(10 + seed), x.shape, jnp.float64)
            vw = jax.random.normal(jax.random.key(20 + seed), w.shape, jnp.float64)
            fd_x = (f(x + eps_x * vx, w) - f(x - eps_x * vx, w)) / (2 * eps_x)
            fd_w = (f(x, w + eps_w * vw) - f(x, w - eps_w * vw)) / (2 * eps_w)
            np.testing.assert_allclose(jnp.vdot(gx, vx), fd_x, rtol=2e-3)
            np.testing.assert_allclose(jnp.vdot(gw, vw), fd_w, rtol=1e-4)


def test_chunked_backward_memory_does_not_grow_with_the_rows():
    """The backward keeps one chunk's intermediates, not every row's: XLA's temp bytes of the
    gradient grow with M only by the O(M) inputs and cotangents, not by the chain's widest
    intermediate (here 8x the row width)."""
    wide = 8 * N

    def chain(x, p):
        return (jnp.tanh(rowwise.rms_norm(x, p["scale"], 1e-6) @ p["up"]) @ p["down"],)

    p = {"scale": jnp.ones(K), "up": jnp.ones((K, wide)) * 0.01, "down": jnp.ones((wide, K)) * 0.01}

    def temp(m: int, backward_rows: int) -> int:
        x = jax.ShapeDtypeStruct((m, K), jnp.float32)
        f = lambda x: jnp.sum(fused_rows(chain, (x,), p, block_rows=BLOCK, backward_rows=backward_rows)[0])
        return jax.jit(jax.grad(f)).lower(x).compile().memory_analysis().temp_size_in_bytes

    m = 8192
    chunked, whole = temp(m, 256), temp(m, m)
    assert whole > m * wide * 4  # all rows at once: at least one [M, wide] f32 intermediate alive
    assert chunked < whole / 4 and chunked < 6 * m * K * 4 + 16 * 256 * wide * 4, (chunked, whole)


def test_prepare_runs_before_the_loop_and_other_backends_call_fn():
    x, pos = _inputs(8)
    p = _weights("bf16")
    double = lambda q: {**q, "scale": 2.0 * q["scale"]}
    got = fused_rows(_chain, (x, pos), p, block_rows=BLOCK, prepare=double)[0]
    np.testing.assert_allclose(got, _chain(x, pos, double(p))[0], rtol=2e-5, atol=2e-5)
    with_xla = fused_rows(_chain, (x, pos), p, block_rows=BLOCK, backend="xla")[0]
    assert with_xla.shape == (8, N)


def test_bad_inputs_are_named():
    x, pos = _inputs(8)
    with pytest.raises(ValueError, match="one leading size"):
        fused_rows(_chain, (x, pos[:4]), _weights("bf16"), block_rows=BLOCK)
    with pytest.raises(ValueError, match="block_rows must be positive"):
        fused_rows(_chain, (x, pos), _weights("bf16"), block_rows=0)
    with pytest.raises(ValueError, match="backward_rows must be positive"):
        fused_rows(_chain, (x, pos), _weights("bf16"), block_rows=BLOCK, backward_rows=0)
    assert (
        default_block_rows(256) == 64 and default_block_rows(768) == 32 and default_block_rows(1 << 14) == 8
    )
