"""CPU path of the row-wise operations: plain JAX over fixed row blocks
(:func:`kernels_pallas._rowblocks.map_row_blocks`). Block rows default to a function of the row
width only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._rowblocks import in_fused_block, map_row_blocks, row_kernel
from kernels_pallas._tiling import pad_axis, round_up, rows_per_block
from kernels_pallas.rowwise.common import lse_step
from kernels_pallas.rowwise.reference import reference_rms_norm, reference_rope


@row_kernel(static_argnames=("eps", "block_rows"))
def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, block_rows: int | None = None) -> jax.Array:
    """x [M, D] -> [M, D] (Qwen3 numerics)."""
    w = weight.astype(x.dtype)

    def block(xb):
        return (reference_rms_norm(xb, w, eps),)

    out = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return map_row_blocks(block, (x,), block_rows or rows_per_block(x.shape[1]), (out,), fusable=True)[0]


@row_kernel(static_argnames=("theta", "inv_freq", "block_rows"))
def rope(
    x: jax.Array,
    positions: jax.Array,
    *,
    theta: float,
    inv_freq: tuple[float, ...] | None = None,
    block_rows: int | None = None,
) -> jax.Array:
    """x [M, H, D] rotated at positions [M] (``inv_freq``: a scaled RoPE's frequencies). A loop of
    its own even inside a fused chain (not ``fusable``): XLA:CPU computes the f32 cos / sin and the
    products' sum with other bits depending on what they are fused with (measured 2026-12-04: a
    tensor-parallel engine's one-block chain against the training forward's blocked one, 76% of
    f32 q / k values equal, 100% with this loop); a nested loop's body is the same program in both."""

    def block(xb, pb):
        return (reference_rope(xb, pb, theta, inv_freq),)

    out = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    # nested in a chain: one block of the chain's rows (already a fixed size), no padding beyond it
    rows = block_rows or (x.shape[0] if in_fused_block() else rows_per_block(x.shape[1] * x.shape[2]))
    return map_row_blocks(block, (x, positions), rows, (out,))[0]


@row_kernel(static_argnames=("block_v", "block_rows"))
def logsumexp(x: jax.Array, *, block_v: int, block_rows: int | None = None) -> jax.Array:
    """log(sum(exp(x))) of x [M, V] -> [M] f32, the vocabulary in ascending chunks of ``block_v``."""
    v = x.shape[1]
    chunks = -(-v // block_v)
    xp = pad_axis(x.astype(jnp.float32), 1, round_up(v, block_v), float("-inf"))
    block_rows = block_rows or rows_per_block(block_v)

    def block(xb):
        rows = xb.shape[0]  # block_rows, or every row inside a fused block
        xc = xb.reshape(rows, chunks, block_v)

        def step(c, carry):
            return lse_step(*carry, lax.dynamic_index_in_dim(xc, c, axis=1, keepdims=False))

        init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
        m, s = lax.fori_loop(0, chunks, step, init)
        return (m + jnp.log(s),)

    out = jax.ShapeDtypeStruct((), jnp.float32)
    return map_row_blocks(block, (xp,), block_rows, (out,), fusable=True)[0]


def scale_rows(x: jax.Array, inv: jax.Array, *, block_rows: int | None = None) -> jax.Array:
    """x [M, V] * inv [M] per row, materialised by the row-block loop so that no consumer can fuse
    (and contract into an FMA) the multiply: the same product bits in every program."""

    def block(xb, ib):
        return (xb * ib[:, None],)

    out = jax.ShapeDtypeStruct(x.shape[1:], jnp.float32)
    return map_row_blocks(block, (x, inv), block_rows or rows_per_block(x.shape[1]), (out,), fusable=True)[0]
