"""Invariant attention for GPUs (Pallas-Triton); the contract is :mod:`kernels_pallas.attention`'s.

One program per (sequence row, query token, KV head): its G query heads (padded to a power of two
>= 16, Triton's smallest dot) walk the token's own key blocks ``starts + [j * block_kv, (j + 1) *
block_kv)`` for ``j = 0 .. position // block_kv`` with the online softmax, ascending. Nothing in the
program depends on the batch, on T or on the cache length, so a token gets the same bits in a
packed training row and in a decode step. Keys are padded to a multiple of ``block_kv`` (plus one
block when ``starts`` are given) with segment id -1 so every load stays in bounds and padded keys
are invisible. Speed: each token re-reads its keys (no reuse across queries); tuning is issue 10's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import block_sizes
from kernels_pallas.attention import MASK
from kernels_pallas.gpu import compiler_params

_MIN_TILE = 16


def _kernel(q_ref, pos_ref, st_ref, seg_ref, k_ref, v_ref, kseg_ref, o_ref, *, block_kv: int, scale: float):
    q = q_ref[...]
    pos, start, seg = pos_ref[...], st_ref[...], seg_ref[...]
    g = q.shape[0]

    def step(j, carry):
        m, denom, acc = carry
        off = start + j * block_kv
        kb = k_ref[pl.ds(off, block_kv), :]
        vb = v_ref[pl.ds(off, block_kv), :]
        rel = j * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        valid = (rel <= pos) & (kseg_ref[pl.ds(off, block_kv)][None, :] == seg)
        s = lax.dot_general(
            q,
            kb,
            (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
            precision=lax.Precision.HIGHEST,
        )
        s = jnp.where(valid, s * scale, MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        pv = jnp.dot(
            p.astype(vb.dtype), vb, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
        )
        return m_new, denom * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (
        jnp.full((g,), MASK, jnp.float32),
        jnp.zeros((g,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    _, denom, acc = lax.fori_loop(0, pos // block_kv + 1, step, init)
    o_ref[...] = (acc / jnp.where(denom == 0, 1.0, denom)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_kv", "interpret", "num_warps"))
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    starts: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    block_kv: int,
    interpret: bool = False,
    num_warps: int = 4,
) -> jax.Array:
    """q [B,T,H,D], k/v [B,S,KV,D] -> [B,T,H,D] (layout as :func:`kernels_pallas.attention.attention`)."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    if block_kv < _MIN_TILE or block_kv & (block_kv - 1) or d < _MIN_TILE or d & (d - 1):
        raise ValueError(f"Triton needs power-of-two block_kv and head_dim >= 16; got {block_kv}, {d}")
    gp = max(_MIN_TILE, 1 << (g - 1).bit_length())
    s_pad = block_sizes.round_up(s, block_kv) + (0 if starts is None else block_kv)
    qg = block_sizes.pad_axis(q.reshape(b, t, kvh, g, d), 3, gp)
    kp, vp = block_sizes.pad_axis(k, 1, s_pad), block_sizes.pad_axis(v, 1, s_pad)
    kseg = jnp.zeros((b, s), jnp.int32) if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
    kseg = jnp.pad(kseg, ((0, 0), (0, s_pad - s)), constant_values=-1)
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    st = jnp.zeros((b, t), jnp.int32) if starts is None else starts.astype(jnp.int32)
    tok = pl.BlockSpec((None, None), lambda i, j, n: (i, j))
    kv_spec = pl.BlockSpec((None, s_pad, None, d), lambda i, j, n: (i, 0, n, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, block_kv=block_kv, scale=d**-0.5),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        grid=(b, t, kvh),
        in_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, j, n: (i, j, n, 0, 0)),
            tok,
            tok,
            tok,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, s_pad), lambda i, j, n: (i, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, None, gp, d), lambda i, j, n: (i, j, n, 0, 0)),
        interpret=interpret,
        compiler_params=compiler_params(num_warps=num_warps, num_stages=1),
        name="qarl_attention",
    )(qg, positions.astype(jnp.int32), st, seg, kp, vp, kseg)
    return out[:, :, :, :g].reshape(b, t, h, d)
