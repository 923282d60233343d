"""The work list the GPU and TPU grouped kernels share: (expert, row block) tiles over rows sorted
by expert, a static number of them whatever the group sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._tiling import round_up


def group_tiles(
    group_sizes: jax.Array, m: int, block_m: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Static-shape work list for a grouped (MoE) matmul over rows sorted by expert.

    Each tile is one (expert, row block) pair whose rows overlap; a row block that straddles an
    expert boundary appears once per expert, and each visit writes only its expert's rows. There
    are at most ``m_pad // block_m + E - 1`` such tiles; the rest are empty (lo == hi == 0) and walk
    the row blocks past the last expert row, so that row blocks come in non-decreasing order and
    every block is visited (TPU keeps an output block resident across consecutive visits and zeroes
    it on the first). Returns int32 [T] arrays (expert, row_block, lo, hi): rows [lo, hi) are the
    tile's to write. Rows past ``sum(group_sizes)`` belong to no expert (their output is zero)."""
    num_experts = group_sizes.shape[0]
    m_pad = round_up(max(m, 1), block_m)
    num_tiles = m_pad // block_m + num_experts - 1
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first = starts // block_m
    last = (ends - 1) // block_m
    ntiles = jnp.where(ends > starts, last - first + 1, 0)
    cum = jnp.cumsum(ntiles)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    valid = t < cum[-1]
    e = jnp.minimum(jnp.searchsorted(cum, t, side="right").astype(jnp.int32), num_experts - 1)
    row_block = first[e] + t - (cum[e] - ntiles[e])
    lo = jnp.where(valid, jnp.maximum(starts[e], row_block * block_m), 0)
    hi = jnp.where(valid, jnp.minimum(ends[e], (row_block + 1) * block_m), 0)
    covered = jnp.where(ends[-1] > 0, (ends[-1] - 1) // block_m, -1)
    spare = jnp.minimum(covered + 1 + t - cum[-1], m_pad // block_m - 1)
    row_block = jnp.where(valid, row_block, spare)
    return e, row_block.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32)
