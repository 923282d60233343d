"""Row-wise kernels for GPUs (Pallas-Triton): RMSNorm, RoPE and the chunked-vocabulary log-sum-exp.

Rows are padded to ``BLOCK_ROWS`` and every block runs one program whose shape depends on the row
width only, so a row's bits do not depend on the number of rows. Triton loads power-of-two arrays
only: the row width is padded (zeros for the norm, whose mean divides by the true width; -inf for
the log-sum-exp, which exp sends to 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._tiling import is_pow2, next_pow2, pad_axis, pad_to_block, round_up
from kernels_pallas._triton import MIN_TILE, compiler_params
from kernels_pallas.rowwise.common import BLOCK_ROWS, lse_step, pallas_rope, rms_rows
from kernels_pallas.rowwise.common import scale_rows as scale_rows


def _row_call(kernel, x: jax.Array, out_shape, in_specs, out_spec, *args, interpret: bool, name: str):
    """``kernel`` over row blocks of ``x`` (rows already padded), one program per block."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(x.shape[0] // BLOCK_ROWS,),
        in_specs=in_specs,
        out_specs=out_spec,
        interpret=interpret,
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        name=name,
    )(x, *args)


def _rows(width: int) -> pl.BlockSpec:
    return pl.BlockSpec((BLOCK_ROWS, width), lambda i: (i, 0))


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda i: (0,) * len(shape))


def _rms_kernel(x_ref, w_ref, o_ref, *, eps: float, d: int):
    o_ref[...] = rms_rows(x_ref[...], w_ref[...], eps, d, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, interpret: bool = False) -> jax.Array:
    """x [M, D] -> [M, D] (Qwen3 numerics), rows invariant."""
    m, d = x.shape
    dp = next_pow2(d)
    xp = pad_to_block(pad_axis(x, 1, dp), BLOCK_ROWS)
    w = pad_axis(weight.astype(x.dtype), 0, dp)[None]
    kernel = functools.partial(_rms_kernel, eps=eps, d=d)
    out_shape = jax.ShapeDtypeStruct(xp.shape, x.dtype)
    out = _row_call(
        kernel,
        xp,
        out_shape,
        [_rows(dp), _whole((1, dp))],
        _rows(dp),
        w,
        interpret=interpret,
        name="qarl_rms_norm",
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


def _rope(x: jax.Array, positions: jax.Array, inv: np.ndarray, interpret: bool) -> jax.Array:
    m, h, d = x.shape
    if not is_pow2(d // 2):
        raise ValueError(f"the GPU RoPE kernel needs a power-of-two head_dim, got {d}")
    freq = jnp.asarray(inv, jnp.float32)[None]
    xp = pad_to_block(x.reshape(m, h * d), BLOCK_ROWS)
    pp = pad_to_block(positions.astype(jnp.int32)[:, None], BLOCK_ROWS)
    specs = [_rows(h * d), _rows(1), _whole((1, d // 2))]
    kernel = functools.partial(_rope_kernel, heads=h, d=d)
    out_shape = jax.ShapeDtypeStruct(xp.shape, x.dtype)
    out = _row_call(
        kernel, xp, out_shape, specs, _rows(h * d), pp, freq, interpret=interpret, name="qarl_rope"
    )
    return out[:m].reshape(m, h, d)


rope = pallas_rope(_rope)


def _lse_kernel(x_ref, o_ref, *, chunks: int, block_v: int):
    def step(c, carry):
        return lse_step(*carry, x_ref[:, pl.ds(c * block_v, block_v)].astype(jnp.float32))

    init = (jnp.full((BLOCK_ROWS,), -jnp.inf, jnp.float32), jnp.zeros((BLOCK_ROWS,), jnp.float32))
    mx, s = lax.fori_loop(0, chunks, step, init)
    o_ref[...] = mx + jnp.log(s)


@functools.partial(jax.jit, static_argnames=("block_v", "interpret"))
def logsumexp(x: jax.Array, *, block_v: int, interpret: bool = False) -> jax.Array:
    """log(sum(exp(x))) of x [M, V] -> [M] f32, vocabulary in ``block_v`` chunks (power of two)."""
    if not is_pow2(block_v) or block_v < MIN_TILE:
        raise ValueError(f"block_v must be a power of two >= {MIN_TILE}, got {block_v}")
    m, v = x.shape
    width = round_up(v, block_v)
    xp = pad_to_block(pad_axis(x, 1, width, float("-inf")), BLOCK_ROWS)
    kernel = functools.partial(_lse_kernel, chunks=width // block_v, block_v=block_v)
    out_shape = jax.ShapeDtypeStruct((xp.shape[0],), jnp.float32)
    out_spec = pl.BlockSpec((BLOCK_ROWS,), lambda i: (i,))
    out = _row_call(
        kernel, xp, out_shape, [_rows(width)], out_spec, interpret=interpret, name="qarl_logsumexp"
    )
    return out[:m]
