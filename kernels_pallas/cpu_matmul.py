"""CPU path of the quantized matmuls: plain JAX over fixed blocks of rows.

Why this is batch-invariant: rows are padded to a multiple of ``block_rows`` and every block runs
the same fixed-shape program (one loop body), so a row's arithmetic never depends on how many rows
share the call, where the row sits, or what its neighbours hold. The block loop is a real while
loop even for one block: its trip count passes through ``lax.optimization_barrier``, because XLA
compiles a loop it knows runs once as straight-line code and fuses it differently (measured).

The reference is :func:`kernels_pallas.formats.reference_matmul` (float64 / int64 numpy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.formats import ACT_BITS, WEIGHT_BITS, QuantizedWeight, quantize_activations, unpack_int4

BlockFn = Callable[[jax.Array, jax.Array], jax.Array]


def default_block_rows(k: int, n: int) -> int:
    """Rows per block: a power of two in [8, 64] keeping one block of x and of y near 64K elements.
    A function of (K, N) only, never of M."""
    rows = 64
    while rows > 8 and rows * max(k, n) > 1 << 16:
        rows //= 2
    return rows


def row_block_map(block_fn: BlockFn, xp: jax.Array, block_rows: int, n: int, out_dtype) -> jax.Array:
    """Run ``block_fn(block_index, x_block) -> [block_rows, n]`` over the rows of ``xp`` (already a
    multiple of ``block_rows``), one block per iteration of a while loop with an opaque trip count."""
    rows, k = xp.shape
    nb = rows // block_rows
    blocks = xp.reshape(nb, block_rows, k)
    trips = lax.optimization_barrier(jnp.int32(nb))

    def body(i, out):
        y = block_fn(i, lax.dynamic_index_in_dim(blocks, i, keepdims=False))
        return lax.dynamic_update_index_in_dim(out, y.astype(out_dtype), i, 0)

    out = lax.fori_loop(0, trips, body, jnp.zeros((nb, block_rows, n), out_dtype))
    return out.reshape(rows, n)


def prepare_weight(w: QuantizedWeight, x_dtype) -> tuple[jax.Array, jax.Array | None]:
    """Weight-only, exact work hoisted out of the block loop: int4 unpacking, and the cast of int4
    values to the activation dtype for w4a16 (exact: |q| <= 8)."""
    if w.scales is None:
        return w.values, None
    q = unpack_int4(w.values, w.group_size) if WEIGHT_BITS[w.fmt] == 4 else w.values
    if ACT_BITS[w.fmt] is None:
        q = q.astype(x_dtype)
    return q, w.scales


def _dot(a: jax.Array, b: jax.Array, acc_dtype) -> jax.Array:
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=acc_dtype
    )


def _group_dots(a: jax.Array, b: jax.Array, group_size: int, acc_dtype) -> jax.Array:
    """Per-group partial products [K/G, B, N] of a [B, K] block with a [K, N] weight."""
    rows, k = a.shape
    ng = k // group_size
    a3 = a.reshape(rows, ng, group_size)
    b3 = b.reshape(ng, group_size, b.shape[-1])
    return lax.dot_general(
        a3,
        b3,
        (((2,), (1,)), ((1,), (0,))),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=acc_dtype,
    )


def _scaled_sum(parts: jax.Array, scales: jax.Array) -> jax.Array:
    """sum_g parts[g] * scales[g] in f32, one group after another in ascending K order."""

    def body(g, acc):
        part = lax.dynamic_index_in_dim(parts, g, keepdims=False).astype(jnp.float32)
        return acc + part * lax.dynamic_index_in_dim(scales, g, keepdims=True)

    return lax.fori_loop(0, parts.shape[0], body, jnp.zeros(parts.shape[1:], jnp.float32))


def block_matmul(
    fmt: str, group_size: int, x: jax.Array, wv: jax.Array, scales: jax.Array | None
) -> jax.Array:
    """One block [B, K] x prepared weight [K, N] -> f32 [B, N] (the per-block program)."""
    if fmt == "bf16":
        ct = jnp.promote_types(x.dtype, wv.dtype)
        return _dot(x.astype(ct), wv.astype(ct), jnp.float32)
    if fmt == "w8a8":
        qx, sx = quantize_activations(x)
        acc = _dot(qx, wv, jnp.int32)
        return (acc.astype(jnp.float32) * sx) * scales[0]
    if fmt == "w4a16":
        return _scaled_sum(_group_dots(x, wv, group_size, jnp.float32), scales)
    qx, sx = quantize_activations(x)  # w4a8
    return _scaled_sum(_group_dots(qx, wv, group_size, jnp.int32), scales) * sx


def pad_rows(x: jax.Array, block_rows: int) -> jax.Array:
    m = x.shape[0]
    return jnp.pad(x, ((0, -m % block_rows), (0, 0)))


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_rows"))
def matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype, block_rows: int | None = None) -> jax.Array:
    """[M, K] x QuantizedWeight [K, N] -> [M, N] over fixed row blocks (inputs already validated)."""
    m = x.shape[0]
    block_rows = block_rows or default_block_rows(w.k, w.n)
    wv, scales = prepare_weight(w, x.dtype)

    def block_fn(_, xb):
        return block_matmul(w.fmt, w.group_size, xb, wv, scales)

    return row_block_map(block_fn, pad_rows(x, block_rows), block_rows, w.n, out_dtype)[:m]
