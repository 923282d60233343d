"""Row-wise kernels for GPUs (Pallas-Triton): RMSNorm, RoPE and the chunked-vocabulary log-sum-exp.

Same contract as :mod:`kernels_pallas.rowwise`: rows are padded to ``block_rows`` (16) and every
block runs one program whose shape depends on the row width only, so a row's bits do not depend on
the number of rows. Triton loads power-of-two arrays only: the row width is padded (zeros for the
norm, whose mean divides by the true width; -inf for the log-sum-exp, which exp sends to 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import block_sizes
from kernels_pallas.gpu import compiler_params

BLOCK_ROWS = 16


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _rows(x: jax.Array) -> tuple[jax.Array, int]:
    m = x.shape[0]
    return block_sizes.pad_axis(x, 0, block_sizes.round_up(max(m, 1), BLOCK_ROWS)), m


def _call(kernel, out_shape, in_specs, out_specs, grid, args, interpret, name):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        name=name,
    )(*args)


def _rms_kernel(x_ref, w_ref, o_ref, *, eps: float, d: int):
    x = x_ref[...].astype(jnp.float32)
    y = x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / d + eps)
    o_ref[...] = w_ref[...].astype(o_ref.dtype) * y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, interpret: bool = False) -> jax.Array:
    """x [M, D] -> [M, D] (Qwen3 numerics), rows invariant."""
    d = x.shape[1]
    dp = _pow2(d)
    xp, m = _rows(block_sizes.pad_axis(x, 1, dp))
    w = block_sizes.pad_axis(weight.astype(x.dtype), 0, dp)[None]
    out = _call(
        functools.partial(_rms_kernel, eps=eps, d=d),
        jax.ShapeDtypeStruct(xp.shape, x.dtype),
        [pl.BlockSpec((BLOCK_ROWS, dp), lambda i: (i, 0)), pl.BlockSpec((1, dp), lambda i: (0, 0))],
        pl.BlockSpec((BLOCK_ROWS, dp), lambda i: (i, 0)),
        (xp.shape[0] // BLOCK_ROWS,),
        (xp, w),
        interpret,
        "qarl_rms_norm",
    )
    return out[:m, :d]


def _rope_kernel(x_ref, p_ref, f_ref, o_ref, *, heads: int, d: int):
    ang = p_ref[...].astype(jnp.float32) * f_ref[...]  # [rows, D/2]
    cos, sin = jnp.cos(ang).astype(o_ref.dtype), jnp.sin(ang).astype(o_ref.dtype)
    half = d // 2
    for h in range(heads):
        x1 = x_ref[:, pl.ds(h * d, half)]
        x2 = x_ref[:, pl.ds(h * d + half, half)]
        o_ref[:, pl.ds(h * d, half)] = x1 * cos + (-x2) * sin
        o_ref[:, pl.ds(h * d + half, half)] = x2 * cos + x1 * sin


@functools.partial(jax.jit, static_argnames=("theta", "interpret"))
def rope(x: jax.Array, positions: jax.Array, *, theta: float, interpret: bool = False) -> jax.Array:
    """x [M, H, D] rotated at positions [M] (angles in f32, rotate_half), rows invariant."""
    m, h, d = x.shape
    if d // 2 & (d // 2 - 1):
        raise ValueError(f"the GPU RoPE kernel needs a power-of-two head_dim, got {d}")
    inv_freq = jnp.asarray(1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d)), jnp.float32)[None]
    xp, _ = _rows(x.reshape(m, h * d))
    pp, _ = _rows(positions.astype(jnp.int32)[:, None])
    out = _call(
        functools.partial(_rope_kernel, heads=h, d=d),
        jax.ShapeDtypeStruct(xp.shape, x.dtype),
        [
            pl.BlockSpec((BLOCK_ROWS, h * d), lambda i: (i, 0)),
            pl.BlockSpec((BLOCK_ROWS, 1), lambda i: (i, 0)),
            pl.BlockSpec((1, d // 2), lambda i: (0, 0)),
        ],
        pl.BlockSpec((BLOCK_ROWS, h * d), lambda i: (i, 0)),
        (xp.shape[0] // BLOCK_ROWS,),
        (xp, pp, inv_freq),
        interpret,
        "qarl_rope",
    )
    return out[:m].reshape(m, h, d)


def _lse_kernel(x_ref, o_ref, *, chunks: int, block_v: int, temperature: float):
    def step(c, carry):
        mx, s = carry
        z = x_ref[:, pl.ds(c * block_v, block_v)].astype(jnp.float32)
        z = z if temperature == 1.0 else z / temperature
        m_new = jnp.maximum(mx, jnp.max(z, axis=1))
        return m_new, s * jnp.exp(mx - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)

    init = (jnp.full((BLOCK_ROWS,), -jnp.inf, jnp.float32), jnp.zeros((BLOCK_ROWS,), jnp.float32))
    mx, s = lax.fori_loop(0, chunks, step, init)
    o_ref[...] = mx + jnp.log(s)


@functools.partial(jax.jit, static_argnames=("temperature", "block_v", "interpret"))
def logsumexp(x: jax.Array, *, temperature: float, block_v: int, interpret: bool = False) -> jax.Array:
    """log(sum(exp(x / t))) of x [M, V] -> [M] f32, vocabulary in ``block_v`` chunks (power of two)."""
    if block_v & (block_v - 1) or block_v < 16:
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    v = x.shape[1]
    chunks = -(-v // block_v)
    xp = jnp.pad(x, ((0, 0), (0, chunks * block_v - v)), constant_values=-jnp.inf)
    xp, m = _rows(xp)
    out = _call(
        functools.partial(_lse_kernel, chunks=chunks, block_v=block_v, temperature=temperature),
        jax.ShapeDtypeStruct((xp.shape[0],), jnp.float32),
        [pl.BlockSpec((BLOCK_ROWS, chunks * block_v), lambda i: (i, 0))],
        pl.BlockSpec((BLOCK_ROWS,), lambda i: (i,)),
        (xp.shape[0] // BLOCK_ROWS,),
        (xp,),
        interpret,
        "qarl_logsumexp",
    )
    return out[:m]
