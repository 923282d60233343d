"""Row-wise kernels for TPUs (Pallas Mosaic): RMSNorm, RoPE and the chunked-vocabulary log-sum-exp.
Lowering- and interpreter-checked only (no TPU has run them).

Same contract as :mod:`kernels_pallas.rowwise` and the GPU kernels: rows are padded to
``BLOCK_ROWS`` (16, a bf16 sublane tile) and every row block runs one program whose shape depends on
the row width only, so a row's bits never depend on the number of rows or its neighbours. Mosaic
tiles are (8, 128): the row width is padded to a multiple of 128 lanes (zeros for the norm, whose
mean divides by the true width; -inf for the log-sum-exp, which exp sends to 0). The vocabulary is
the grid's last, 'arbitrary' axis (ascending chunks, online max in VMEM scratch), so a 151,936-entry
row is never resident in VMEM at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import block_sizes
from kernels_pallas.tpu import ARBITRARY, PARALLEL, compiler_params, interpret_params

BLOCK_ROWS = 16
LANES = 128


def _rows(x: jax.Array) -> tuple[jax.Array, int]:
    m = x.shape[0]
    return block_sizes.pad_axis(x, 0, block_sizes.round_up(max(m, 1), BLOCK_ROWS)), m


def _interpret(interpret: bool):
    return interpret_params() if interpret else False


def _rms_kernel(x_ref, w_ref, o_ref, *, eps: float, d: int):
    x = x_ref[...].astype(jnp.float32)
    y = x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / d + eps)
    o_ref[...] = w_ref[...].astype(o_ref.dtype) * y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, interpret: bool = False) -> jax.Array:
    """x [M, D] -> [M, D] (Qwen3 numerics), rows invariant."""
    d = x.shape[1]
    dp = block_sizes.round_up(d, LANES)
    xp, m = _rows(block_sizes.pad_axis(x, 1, dp))
    w = block_sizes.pad_axis(weight.astype(x.dtype), 0, dp)[None]
    out = pl.pallas_call(
        functools.partial(_rms_kernel, eps=eps, d=d),
        out_shape=jax.ShapeDtypeStruct(xp.shape, x.dtype),
        grid=(xp.shape[0] // BLOCK_ROWS,),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, dp), lambda i: (i, 0)), pl.BlockSpec((1, dp), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((BLOCK_ROWS, dp), lambda i: (i, 0)),
        interpret=_interpret(interpret),
        compiler_params=compiler_params(PARALLEL),
        name="qarl_rms_norm_tpu",
    )(xp, w)
    return out[:m, :d]


def _rope_kernel(x_ref, p_ref, f_ref, o_ref, *, half: int):
    """One row is one (token, head): out = x * cos + rotate_half(x) * sin, rotate_half by two lane
    rolls (x[i + half] for the first half, negated; x[i - half] for the second)."""
    x = x_ref[...]
    width = x.shape[1]
    ang = p_ref[...].astype(jnp.float32) * f_ref[...]  # [rows, Dp]
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    ahead = pltpu.roll(x, width - half, 1)  # ahead[i] = x[i + half]
    behind = pltpu.roll(x, half, 1)  # behind[i] = x[i - half]
    rot = jnp.where(lane < half, -ahead, behind)
    o_ref[...] = x * cos + rot * sin


@functools.partial(jax.jit, static_argnames=("theta", "interpret"))
def rope(x: jax.Array, positions: jax.Array, *, theta: float, interpret: bool = False) -> jax.Array:
    """x [M, H, D] rotated at positions [M] (angles in f32, rotate_half), rows invariant."""
    m, h, d = x.shape
    if d % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {d}")
    dp = block_sizes.round_up(d, LANES)
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    freq = block_sizes.pad_axis(jnp.asarray(np.concatenate([inv, inv]), jnp.float32), 0, dp)[None]
    xp, _ = _rows(block_sizes.pad_axis(x.reshape(m * h, d), 1, dp))
    pp, _ = _rows(jnp.repeat(positions.astype(jnp.int32), h)[:, None])
    out = pl.pallas_call(
        functools.partial(_rope_kernel, half=d // 2),
        out_shape=jax.ShapeDtypeStruct(xp.shape, x.dtype),
        grid=(xp.shape[0] // BLOCK_ROWS,),
        in_specs=[
            pl.BlockSpec((BLOCK_ROWS, dp), lambda i: (i, 0)),
            pl.BlockSpec((BLOCK_ROWS, 1), lambda i: (i, 0)),
            pl.BlockSpec((1, dp), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((BLOCK_ROWS, dp), lambda i: (i, 0)),
        interpret=_interpret(interpret),
        compiler_params=compiler_params(PARALLEL),
        name="qarl_rope_tpu",
    )(xp, pp, freq)
    return out[: m * h, :d].reshape(m, h, d)


def _lse_kernel(x_ref, o_ref, m_ref, s_ref, *, temperature: float):
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)

    z = x_ref[...].astype(jnp.float32)
    z = z if temperature == 1.0 else z / temperature
    mx = m_ref[...]
    m_new = jnp.maximum(mx, jnp.max(z, axis=1, keepdims=True))
    s_ref[...] = s_ref[...] * jnp.exp(mx - m_new) + jnp.sum(jnp.exp(z - m_new), axis=1, keepdims=True)
    m_ref[...] = m_new

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = m_ref[...] + jnp.log(s_ref[...])


def chunk_width(block_v: int) -> int:
    """The TPU chunk: ``block_v`` rounded up to whole 128-lane tiles (a function of block_v only)."""
    return block_sizes.round_up(block_v, LANES)


@functools.partial(jax.jit, static_argnames=("temperature", "block_v", "interpret"))
def logsumexp(x: jax.Array, *, temperature: float, block_v: int, interpret: bool = False) -> jax.Array:
    """log(sum(exp(x / t))) of x [M, V] -> [M] f32, vocabulary in chunks of ``chunk_width(block_v)``."""
    if block_v < 1:
        raise ValueError(f"block_v must be positive, got {block_v}")
    bv = chunk_width(block_v)
    v = x.shape[1]
    chunks = -(-v // bv)
    xp = jnp.pad(x, ((0, 0), (0, chunks * bv - v)), constant_values=-jnp.inf)
    xp, m = _rows(xp)
    out = pl.pallas_call(
        functools.partial(_lse_kernel, temperature=temperature),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], 1), jnp.float32),
        grid=(xp.shape[0] // BLOCK_ROWS, chunks),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, bv), lambda i, c: (i, c))],
        out_specs=pl.BlockSpec((BLOCK_ROWS, 1), lambda i, c: (i, 0)),
        scratch_shapes=[pltpu.VMEM((BLOCK_ROWS, 1), jnp.float32)] * 2,
        interpret=_interpret(interpret),
        compiler_params=compiler_params(PARALLEL, ARBITRARY),
        name="qarl_logsumexp_tpu",
    )(xp)
    return out[:m, 0]
