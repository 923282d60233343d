"""CPU path of the quantized matmuls: plain JAX over fixed blocks of rows
(:func:`kernels_pallas._rowblocks.map_row_blocks`, whose docstring says why that keeps every row
bitwise independent of M and of its neighbours). The reference is
:func:`kernels_pallas.matmul.reference.reference_matmul`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._rowblocks import map_row_blocks, row_kernel
from kernels_pallas._tiling import rows_per_block
from kernels_pallas.formats import ACT_BITS, WEIGHT_BITS, QuantizedWeight, quantize_activations, unpack_int4


def default_block_rows(k: int, n: int) -> int:
    """Rows per block: one block of x and of y near 64K elements. A function of (K, N) only."""
    return rows_per_block(max(k, n))


def prepare_weight(w: QuantizedWeight, x_dtype) -> tuple[jax.Array, jax.Array | None]:
    """Weight-only, exact work hoisted out of the block loop: int4 unpacking, the cast of int4
    values to the activation dtype for w4a16 (exact: |q| <= 8), and of e4m3 values to f32 for fp8
    (exact)."""
    if w.scales is None:
        return w.values, None
    q = unpack_int4(w.values, w.group_size) if WEIGHT_BITS[w.fmt] == 4 else w.values
    if ACT_BITS[w.fmt] is None:
        q = q.astype(x_dtype)
    elif w.fmt == "fp8":
        q = q.astype(jnp.float32)
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
    assert scales is not None, f"{fmt} weights have scales"
    if fmt == "w8a8":
        qx, sx = quantize_activations(x)
        acc = _dot(qx, wv, jnp.int32)
        return (acc.astype(jnp.float32) * sx) * scales[0]
    if fmt == "fp8":  # e4m3 x e4m3 products are exact in f32; the block's dot fixes the sum order
        qx, sx = quantize_activations(x, fmt)
        return (_dot(qx.astype(jnp.float32), wv, jnp.float32) * sx) * scales[0]
    if fmt == "w4a16":
        return _scaled_sum(_group_dots(x, wv, group_size, jnp.float32), scales)
    qx, sx = quantize_activations(x)  # w4a8
    return _scaled_sum(_group_dots(qx, wv, group_size, jnp.int32), scales) * sx


@row_kernel(static_argnames=("out_dtype", "block_rows"))
def matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype, block_rows: int | None = None) -> jax.Array:
    """[M, K] x QuantizedWeight [K, N] -> [M, N] over fixed row blocks (inputs already checked)."""
    block_rows = block_rows or default_block_rows(w.k, w.n)
    wv, scales = prepare_weight(w, x.dtype)

    def block(xb):
        return (block_matmul(w.fmt, w.group_size, xb, wv, scales),)

    out = jax.ShapeDtypeStruct((w.n,), out_dtype)
    return map_row_blocks(block, (x,), block_rows, (out,), fusable=True)[0]
