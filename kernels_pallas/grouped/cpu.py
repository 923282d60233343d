"""CPU path of the grouped (MoE) matmul: each expert's rows padded to whole row blocks, then the
dense CPU per-block program with that block's expert weight.

Rows of x are sorted by expert in contiguous groups (``group_sizes[e]`` rows for expert e). Each
group is padded to a multiple of ``block_rows`` inside a static buffer of
``round_up(M + E * (block_rows - 1), block_rows)`` rows, so every block holds rows of one expert
only. A token's arithmetic is therefore the dense kernel's on its own row, whatever the other
tokens, groups or M. Rows past ``sum(group_sizes)`` give zeros (as ``jax.lax.ragged_dot``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._rowblocks import map_row_blocks
from kernels_pallas._tiling import round_up
from kernels_pallas.formats import QuantizedWeight
from kernels_pallas.matmul.cpu import block_matmul, default_block_rows, prepare_weight


def group_layout(group_sizes: jax.Array, m: int, block_rows: int) -> tuple[jax.Array, jax.Array, int]:
    """(dest [M]: padded row of each input row, out of range for rows past the groups;
    block_expert [P / block_rows]: the expert of each block; P: padded rows, static)."""
    e = group_sizes.shape[0]
    padded_rows = round_up(m + e * (block_rows - 1), block_rows)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    padded = -(-sizes // block_rows) * block_rows
    pends = jnp.cumsum(padded)
    rows = jnp.arange(m, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), e - 1)
    dest = (pends - padded)[expert] + rows - (ends - sizes)[expert]
    dest = jnp.where(rows < ends[-1], dest, padded_rows)
    block_starts = jnp.arange(0, padded_rows, block_rows, dtype=jnp.int32)
    block_expert = jnp.minimum(jnp.searchsorted(pends, block_starts, side="right"), e - 1)
    return dest, block_expert, padded_rows


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_rows"))
def grouped_matmul(
    x: jax.Array, w: QuantizedWeight, group_sizes: jax.Array, *, out_dtype, block_rows: int | None = None
) -> jax.Array:
    """x [M, K] (rows sorted by expert) x w [E, K, N] -> [M, N] (operands already checked)."""
    m, k = x.shape
    block_rows = block_rows or default_block_rows(w.k, w.n)
    dest, block_expert, padded_rows = group_layout(group_sizes, m, block_rows)
    xp = jnp.zeros((padded_rows, k), x.dtype).at[dest].set(x, mode="drop")
    row_expert = jnp.repeat(block_expert, block_rows)  # every row of a block: the block's expert
    wv, scales = prepare_weight(w, x.dtype)

    def block(xb, eb):
        e = eb[0]
        we = lax.dynamic_index_in_dim(wv, e, keepdims=False)
        se = None if scales is None else lax.dynamic_index_in_dim(scales, e, keepdims=False)
        return (block_matmul(w.fmt, w.group_size, xb, we, se),)

    out = jax.ShapeDtypeStruct((w.n,), out_dtype)
    (yp,) = map_row_blocks(block, (xp, row_expert), block_rows, (out,))
    return jnp.take(yp, dest, axis=0, mode="fill", fill_value=0)
