"""The grouped matmul's straight-through backward in O(rows) memory, never dense over experts.

For y = grouped(x, W, group_sizes) (rows of x sorted by expert) and the cotangent g:

    dx[r] = g[r] @ W_e^T           for row r of expert e (the grouped matmul, weights transposed)
    dW_e  = sum_r x[r]^T g[r]       over expert e's rows (a transposed grouped matmul, "tgmm")

Both walk the rows in fixed blocks; a block spans the few experts whose groups it overlaps (a
contiguous range), and for each it masks the rows of that expert: nb + E (block, expert) steps in
all, each one [block, K] x [K, N] product. Expert e's float weight is dequantized when a step
needs it (the integers stay the only copy), dx is written block by block, dW accumulates in f32.
What ``lax.ragged_dot``'s transpose does instead on CPU (and on GPU without cuDNN's grouped GEMM)
is a masked product over every expert: temporaries of experts x rows x width.

Plain JAX (a loop over row blocks, an inner loop over their experts), so it lowers on every
backend; gradients need not be invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.formats import QuantizedWeight, dequantize

_HIGHEST = lax.Precision.HIGHEST


def _expert(w: QuantizedWeight, e: jax.Array) -> jax.Array:
    """Expert ``e``'s weight [K, N] in f32, dequantized from its own integers and scales only."""
    values = lax.dynamic_index_in_dim(w.values, e, keepdims=False)
    scales = None if w.scales is None else lax.dynamic_index_in_dim(w.scales, e, keepdims=False)
    return dequantize(QuantizedWeight(values, scales, w.fmt, w.group_size), jnp.float32)


def grouped_backward(
    x: jax.Array, g: jax.Array, w: QuantizedWeight, group_sizes: jax.Array, *, block_rows: int = 256
) -> tuple[jax.Array, jax.Array]:
    """(dx [M, K], dW [E, K, N]) in f32 of ``grouped_matmul(x, w, group_sizes)`` for the cotangent
    ``g`` [M, N], with the quantized weight treated as its dequantized value (straight-through)."""
    m, k = x.shape
    n, e = g.shape[1], w.values.shape[0]
    bm = min(block_rows, m)
    nb = -(-m // bm)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    x32, g32 = x.astype(jnp.float32), g.astype(jnp.float32)

    def block(i, acc):
        dx, dw = acc
        # the last block is moved back to end at row m; its rows already done are masked out
        lo = jnp.minimum(i * bm, m - bm)
        rows = lo + jnp.arange(bm)
        fresh = rows >= i * bm
        row_expert = jnp.searchsorted(ends, rows, side="right")  # E past the last group: no expert
        live = fresh & (row_expert < e)
        first = jnp.min(jnp.where(live, row_expert, e))
        last = jnp.max(jnp.where(live, row_expert, -1))
        xb = lax.dynamic_slice_in_dim(x32, lo, bm, 0)
        gb = lax.dynamic_slice_in_dim(g32, lo, bm, 0)

        def expert_step(ex, acc):
            dxb, dw = acc
            mine = (live & (row_expert == ex))[:, None]
            wt = _expert(w, ex)
            dxb = dxb + jnp.where(mine, jnp.matmul(gb, wt.T, precision=_HIGHEST), 0.0)
            dwe = jnp.matmul(jnp.where(mine, xb, 0.0).T, gb, precision=_HIGHEST)
            dw = lax.dynamic_update_index_in_dim(dw, lax.dynamic_index_in_dim(dw, ex, 0, False) + dwe, ex, 0)
            return dxb, dw

        dxb, dw = lax.fori_loop(first, last + 1, expert_step, (jnp.zeros((bm, k), jnp.float32), dw))
        old = lax.dynamic_slice_in_dim(dx, lo, bm, 0)
        return lax.dynamic_update_slice_in_dim(dx, jnp.where(fresh[:, None], dxb, old), lo, 0), dw

    init = (jnp.zeros((m, k), jnp.float32), jnp.zeros((e, k, n), jnp.float32))
    return lax.fori_loop(0, nb, block, init)
