"""CPU path of the invariant attention: plain JAX over fixed blocks of query tokens
(:func:`kernels_pallas._rowblocks.map_row_blocks`); each token gathers its own key blocks
``starts + [j * block_kv, (j + 1) * block_kv)`` for ``j = 0 .. position // block_kv``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._rowblocks import map_row_blocks
from kernels_pallas._tiling import rows_per_block
from kernels_pallas.attention.common import MASK, normalise, online_softmax_step, token_ids

_HIGHEST = lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("block_kv", "block_rows"))
def attention(
    q, k, v, positions, starts, segment_ids, kv_segment_ids, *, block_kv: int, block_rows: int | None = None
) -> jax.Array:
    """q [B,T,H,D], k/v [B,S,KV,D] -> [B,T,H,D] (layout as :func:`kernels_pallas.attention.attention`).
    ``block_rows`` query tokens per block default to a function of (block_kv, KV, D)."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    block_rows = block_rows or rows_per_block(block_kv * kvh * d * 2, hi=16)
    # no segments = one segment: the same program either way (a different body compiles differently)
    pos, st, q_seg, kv_seg = token_ids(positions, starts, segment_ids, kv_segment_ids, s, s)
    # opaque, like a kernel's operands: neither recomputed inside the loop nor constant-folded into it
    k, v, kv_seg = lax.optimization_barrier((k, v, kv_seg))
    rows = (
        q.reshape(b * t, kvh, g, d),
        pos.reshape(-1),
        st.reshape(-1),
        q_seg.reshape(-1),
        jnp.repeat(jnp.arange(b, dtype=jnp.int32), t),
    )

    def block(qb, pos, st, seg, bi):
        def step(j, carry):
            rel = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            idx = st[:, None] + rel[None, :]
            valid = (rel[None, :] <= pos[:, None]) & (idx >= 0) & (idx < s)
            valid &= kv_seg.at[bi[:, None], idx].get(mode="fill", fill_value=-1) == seg[:, None]
            kb = k.at[bi[:, None], idx].get(mode="fill", fill_value=0)
            vb = v.at[bi[:, None], idx].get(mode="fill", fill_value=0)
            sc = jnp.einsum("rkgd,rbkd->rkgb", qb, kb, preferred_element_type=jnp.float32, precision=_HIGHEST)

            def pv(p):
                return jnp.einsum(
                    "rkgb,rbkd->rkgd",
                    p.astype(vb.dtype),
                    vb,
                    preferred_element_type=jnp.float32,
                    precision=_HIGHEST,
                )

            return online_softmax_step(carry, sc, valid[:, None, None, :], d**-0.5, pv)

        shape = (block_rows, kvh, g)
        init = (
            jnp.full(shape, MASK, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, d), jnp.float32),
        )
        _, denom, acc = lax.fori_loop(0, jnp.max(pos) // block_kv + 1, step, init)
        return (normalise(acc, denom),)

    out = jax.ShapeDtypeStruct((kvh, g, d), q.dtype)
    (o,) = map_row_blocks(block, rows, block_rows, (out,))
    return o.reshape(b, t, h, d)
