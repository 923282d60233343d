"""Invariant attention for GPUs (Pallas-Triton); the contract is :mod:`kernels_pallas.attention`'s.

One program per (sequence row, query token, KV head): its G query heads (padded to a power of two
>= 16, Triton's smallest dot) walk the token's own key blocks ``starts + [j * block_kv, (j + 1) *
block_kv)`` for ``j = 0 .. position // block_kv`` with the online softmax, ascending. Nothing in the
program depends on the batch, on T or on the cache length, so a token gets the same bits in a
packed training row and in a decode step. Keys are padded to a multiple of ``block_kv`` (plus one
block when ``starts`` are given) with segment id -1 so every load stays in bounds and padded keys
are invisible. Speed: each token re-reads its keys (no reuse across queries).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._tiling import is_pow2, next_pow2, pad_axis, round_up
from kernels_pallas._triton import MIN_TILE, compiler_params
from kernels_pallas.attention.common import MASK, normalise, online_softmax_step, token_ids

_HIGHEST = lax.Precision.HIGHEST


def _kernel(q_ref, pos_ref, st_ref, seg_ref, k_ref, v_ref, kseg_ref, o_ref, *, block_kv: int, scale: float):
    q = q_ref[...]
    pos, start, seg = pos_ref[...], st_ref[...], seg_ref[...]
    g = q.shape[0]

    def step(j, carry):
        off = start + j * block_kv
        kb = k_ref[pl.ds(off, block_kv), :]
        vb = v_ref[pl.ds(off, block_kv), :]
        rel = j * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        valid = (rel <= pos) & (kseg_ref[pl.ds(off, block_kv)][None, :] == seg)
        s = lax.dot_general(
            q, kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=_HIGHEST
        )

        def pv(p):
            return jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32, precision=_HIGHEST)

        return online_softmax_step(carry, s, valid, scale, pv)

    init = (jnp.full((g,), MASK, jnp.float32), jnp.zeros((g,), jnp.float32), jnp.zeros(q.shape, jnp.float32))
    _, denom, acc = lax.fori_loop(0, pos // block_kv + 1, step, init)
    o_ref[...] = normalise(acc, denom).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_kv", "interpret", "num_warps"))
def attention(
    q, k, v, positions, starts, segment_ids, kv_segment_ids, *, block_kv, interpret=False, num_warps=4
) -> jax.Array:
    """q [B,T,H,D], k/v [B,S,KV,D] -> [B,T,H,D] (layout as :func:`kernels_pallas.attention.attention`)."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    if block_kv < MIN_TILE or not is_pow2(block_kv) or d < MIN_TILE or not is_pow2(d):
        raise ValueError(f"Triton needs power-of-two block_kv and head_dim >= 16; got {block_kv}, {d}")
    gp = max(MIN_TILE, next_pow2(g))
    s_pad = round_up(s, block_kv) + (0 if starts is None else block_kv)
    qg = pad_axis(q.reshape(b, t, kvh, g, d), 3, gp)
    ids = token_ids(positions, starts, segment_ids, kv_segment_ids, s, s_pad)
    tok = pl.BlockSpec((None, None), lambda i, j, n: (i, j))
    kv_spec = pl.BlockSpec((None, s_pad, None, d), lambda i, j, n: (i, 0, n, 0))
    q_spec = pl.BlockSpec((None, None, None, gp, d), lambda i, j, n: (i, j, n, 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, block_kv=block_kv, scale=d**-0.5),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        grid=(b, t, kvh),
        in_specs=[
            q_spec,
            tok,
            tok,
            tok,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, s_pad), lambda i, j, n: (i, 0)),
        ],
        out_specs=q_spec,
        interpret=interpret,
        compiler_params=compiler_params(num_warps=num_warps, num_stages=1),
        name="qarl_attention",
    )(qg, *ids[:3], pad_axis(k, 1, s_pad), pad_axis(v, 1, s_pad), ids[3])
    return out[:, :, :, :g].reshape(b, t, h, d)
