"""Row-wise kernels for TPUs (Pallas Mosaic): RMSNorm, RoPE and the chunked-vocabulary log-sum-exp.
Compiled by the TPU compiler (no chip here) and interpreter-checked; no TPU has run them.

Rows are padded to ``BLOCK_ROWS`` (16, a bf16 sublane tile) and every row block runs one program
whose shape depends on the row width only, so a row's bits never depend on the number of rows or
its neighbours. Mosaic tiles are (8, 128): the row width is padded to a multiple of 128 lanes
(zeros for the norm, whose mean divides by the true width; -inf for the log-sum-exp, which exp
sends to 0). The vocabulary is the grid's last, 'arbitrary' axis (ascending chunks, online max in
VMEM scratch), so a 151,936-entry row is never resident in VMEM at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._mosaic import ARBITRARY, LANES, PARALLEL, compiler_params, cost, interpret_mode
from kernels_pallas._tiling import pad_axis, pad_to_block, round_up
from kernels_pallas.rowwise.common import BLOCK_ROWS, lse_step, pallas_rope, rms_rows
from kernels_pallas.rowwise.common import scale_rows as scale_rows


def _row_call(kernel, out_shape, in_specs, out_spec, *args, interpret: bool, name: str, per_element=(4, 0)):
    """``kernel`` over the row blocks of ``args[0]`` (rows already padded), one program a block;
    ``per_element``: (flops, transcendentals) an element of ``args[0]`` costs (VPU work)."""
    grid = (args[0].shape[0] // BLOCK_ROWS,)
    n = args[0].size
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        interpret=interpret_mode(interpret),
        compiler_params=compiler_params(PARALLEL),
        name=name,
        cost_estimate=cost(
            per_element[0] * n,
            grid,
            [*in_specs, out_spec],
            [*args, out_shape],
            transcendentals=per_element[1] * n,
        ),
    )(*args)


def _rows(width: int) -> pl.BlockSpec:
    return pl.BlockSpec((BLOCK_ROWS, width), lambda i: (i, 0))


def _rms_kernel(x_ref, w_ref, o_ref, *, eps: float, d: int):
    o_ref[...] = rms_rows(x_ref[...], w_ref[...], eps, d, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, interpret: bool = False) -> jax.Array:
    """x [M, D] -> [M, D] (Qwen3 numerics), rows invariant."""
    m, d = x.shape
    dp = round_up(d, LANES)
    xp = pad_to_block(pad_axis(x, 1, dp), BLOCK_ROWS)
    w = pad_axis(weight.astype(x.dtype), 0, dp)[None]
    specs = [_rows(dp), pl.BlockSpec((1, dp), lambda i: (0, 0))]
    kernel = functools.partial(_rms_kernel, eps=eps, d=d)
    out_shape = jax.ShapeDtypeStruct(xp.shape, x.dtype)
    out = _row_call(kernel, out_shape, specs, _rows(dp), xp, w, interpret=interpret, name="qarl_rms_norm_tpu")
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


def _rope(x: jax.Array, positions: jax.Array, inv: np.ndarray, interpret: bool) -> jax.Array:
    m, h, d = x.shape
    dp = round_up(d, LANES)
    freq = pad_axis(jnp.asarray(np.concatenate([inv, inv]), jnp.float32), 0, dp)[None]
    xp = pad_to_block(pad_axis(x.reshape(m * h, d), 1, dp), BLOCK_ROWS)
    pp = pad_to_block(jnp.repeat(positions.astype(jnp.int32), h)[:, None], BLOCK_ROWS)
    specs = [_rows(dp), _rows(1), pl.BlockSpec((1, dp), lambda i: (0, 0))]
    kernel = functools.partial(_rope_kernel, half=d // 2)
    out_shape = jax.ShapeDtypeStruct(xp.shape, x.dtype)
    out = _row_call(
        kernel,
        out_shape,
        specs,
        _rows(dp),
        xp,
        pp,
        freq,
        interpret=interpret,
        name="qarl_rope_tpu",
        per_element=(6, 2),
    )
    return out[: m * h, :d].reshape(m, h, d)


rope = pallas_rope(_rope)


def _lse_kernel(x_ref, o_ref, m_ref, s_ref):
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)

    m_ref[...], s_ref[...] = lse_step(m_ref[...], s_ref[...], x_ref[...].astype(jnp.float32), keepdims=True)

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = m_ref[...] + jnp.log(s_ref[...])


def chunk_width(block_v: int) -> int:
    """The TPU chunk: ``block_v`` rounded up to whole 128-lane tiles (a function of block_v only)."""
    return round_up(block_v, LANES)


@functools.partial(jax.jit, static_argnames=("block_v", "interpret"))
def logsumexp(x: jax.Array, *, block_v: int, interpret: bool = False) -> jax.Array:
    """log(sum(exp(x))) of x [M, V] -> [M] f32, vocabulary in chunks of ``chunk_width(block_v)``.

    The kernel reads f32 whatever x's dtype (the conversion, exact, runs before it): the trainer's
    untempered log-sum-exp gets the logits in their own dtype (bf16 where the model computes in
    bf16) and the sampler's tempered one gets ``logits * (1 / t)`` in f32, and with a dtype-keyed
    body those were two Mosaic programs (issue 52); one body means the rollout's log-sum-exp is
    the training programs' own kernel in every format. A row's bits are unchanged: the bf16 body
    widened each chunk to f32 in VMEM, the same values, then ran this f32 reduction. The cost is
    an f32 copy of bf16 logits in HBM before the kernel (written once, twice their bytes, and read
    by the kernel in their place)."""
    if block_v < 1:
        raise ValueError(f"block_v must be positive, got {block_v}")
    x = x.astype(jnp.float32)
    bv = chunk_width(block_v)
    m, v = x.shape
    xp = pad_to_block(pad_axis(x, 1, round_up(v, bv), float("-inf")), BLOCK_ROWS)
    grid = (xp.shape[0] // BLOCK_ROWS, xp.shape[1] // bv)
    out_shape = jax.ShapeDtypeStruct((xp.shape[0], 1), jnp.float32)
    specs = [
        pl.BlockSpec((BLOCK_ROWS, bv), lambda i, c: (i, c)),
        pl.BlockSpec((BLOCK_ROWS, 1), lambda i, c: (i, 0)),
    ]
    out = pl.pallas_call(
        _lse_kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=specs[:1],
        out_specs=specs[1],
        scratch_shapes=[pltpu.VMEM((BLOCK_ROWS, 1), jnp.float32)] * 2,
        interpret=interpret_mode(interpret),
        compiler_params=compiler_params(PARALLEL, ARBITRARY),
        name="qarl_logsumexp_tpu",
        cost_estimate=cost(3 * xp.size, grid, specs, [xp, out_shape], transcendentals=xp.size),
    )(xp)
    return out[:m, 0]
