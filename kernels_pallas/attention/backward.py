"""The attention backward in O(T) memory: blockwise (flash-style), recomputing the probabilities
one (query block, key block) tile at a time instead of holding the [B, KV, G, T, S] scores.

The forward stays the invariant kernel and returns no softmax statistics, so the backward
recomputes them: per query block, one pass over its visible key blocks for the log-sum-exp, then
a second for the gradients, with ``delta = rowsum(dO * O)``::

    p = exp(s - lse)       dV_j += p^T dO       dP = dO V_j^T
    dS = p * (dP - delta)  dQ += dS K_j * scale  dK_j += dS^T Q * scale

Visibility is the forward's (``reference.key_mask``: causal within each packed sequence, from
``starts``, by segment); a query block visits only the key blocks between its earliest start
and its latest visible key. Plain JAX (a scan over query blocks, loops over key blocks), so it
lowers on every backend; gradients need not be invariant, they match the dense formula to
rounding. Temporaries: a few [B, KV, G, block_q, block_k] f32 tiles and the f32 dK / dV
accumulators [B, S, KV, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._tiling import next_pow2, pad_axis
from kernels_pallas.attention.common import Visibility

_HIGHEST = lax.Precision.HIGHEST
DEFAULT_BLOCK = 256


def default_blocks(t: int, s: int, block: int = DEFAULT_BLOCK) -> tuple[int, int]:
    """(block_q, block_k): ``block`` each, or the next power of two >= the length when shorter."""
    return min(block, next_pow2(t)), min(block, next_pow2(s))


def attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    g: jax.Array,
    visibility: Visibility,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) of ``attention(q, k, v, *visibility) = out`` for the cotangent ``g`` (layouts
    as the forward's), in the dtypes of q, k, v."""
    positions, starts, segment_ids, kv_segment_ids = visibility
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    grp, scale, f32 = h // kvh, d**-0.5, jnp.float32
    dq_, dk_ = default_blocks(t, s)
    bq, bk = block_q or dq_, block_k or dk_
    nq, nk = -(-t // bq), -(-s // bk)
    tp, sp = nq * bq, nk * bk
    zeros = jnp.zeros((b, t), jnp.int32)
    pos = pad_axis(positions.astype(jnp.int32), 1, tp, -1)  # padded queries see nothing
    st = pad_axis(zeros if starts is None else starts.astype(jnp.int32), 1, tp)
    qseg = pad_axis(zeros if segment_ids is None else segment_ids.astype(jnp.int32), 1, tp)
    kseg = jnp.zeros((b, s), jnp.int32) if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
    kseg = pad_axis(kseg, 1, sp, -1)  # padded keys: no query's segment
    qg = pad_axis(q.astype(f32).reshape(b, t, kvh, grp, d), 1, tp)
    gg = pad_axis(g.astype(f32).reshape(b, t, kvh, grp, d), 1, tp)
    delta = jnp.sum(g.astype(f32) * out.astype(f32), axis=-1).reshape(b, t, kvh, grp)
    delta = jnp.moveaxis(pad_axis(delta, 1, tp), 1, -1)  # [b, kvh, grp, tp]
    kf, vf = pad_axis(k.astype(f32), 1, sp), pad_axis(v.astype(f32), 1, sp)

    def rows(a, i, size=bq):
        return lax.dynamic_slice_in_dim(a, i * size, size, 1)

    def tile(i, j):
        """Scaled scores [b, kvh, grp, bq, bk] of query block i and key block j, -inf where masked."""
        sc = jnp.einsum("bqkgd,bskd->bkgqs", rows(qg, i), rows(kf, j, bk), precision=_HIGHEST) * scale
        rel = j * bk + jnp.arange(bk)[None, None, :] - rows(st, i)[:, :, None]
        seen = (rel >= 0) & (rel <= rows(pos, i)[:, :, None])
        seen &= rows(qseg, i)[:, :, None] == rows(kseg, j, bk)[:, None, :]
        return jnp.where(seen[:, None, None], sc, -jnp.inf)

    def accumulate(a, x, j):
        return lax.dynamic_update_slice_in_dim(a, rows(a, j, bk) + x, j * bk, 1)

    def key_blocks(i):
        """[lo, hi): the key blocks holding some key visible to query block i."""
        p, start = rows(pos, i), rows(st, i)
        real = p >= 0
        lo = jnp.min(jnp.where(real, start, sp)) // bk
        hi = jnp.max(jnp.where(real, start + p, -1)) // bk + 1
        return jnp.clip(lo, 0, nk), jnp.clip(hi, 0, nk)

    def query_block(carry, i):
        lo, hi = key_blocks(i)

        def lse_step(j, ml):
            m, l_ = ml
            sc = tile(i, j)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            l_ = l_ * jnp.exp(m - ref) + jnp.sum(jnp.exp(sc - ref[..., None]), axis=-1)
            return m_new, l_

        shape = (b, kvh, grp, bq)
        m, l_ = lax.fori_loop(lo, hi, lse_step, (jnp.full(shape, -jnp.inf, f32), jnp.zeros(shape, f32)))
        # a query that sees no key: lse = +inf, so every p below is exactly 0
        lse = jnp.where(l_ > 0, m + jnp.log(jnp.where(l_ > 0, l_, 1.0)), jnp.inf)
        gi, qi, di = rows(gg, i), rows(qg, i), lax.dynamic_slice_in_dim(delta, i * bq, bq, 3)

        def grad_step(j, acc):
            dq, dk, dv = acc
            p = jnp.exp(tile(i, j) - lse[..., None])
            dv_j = jnp.einsum("bkgqs,bqkgd->bskd", p, gi, precision=_HIGHEST)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", gi, rows(vf, j, bk), precision=_HIGHEST)
            ds = p * (dp - di[..., None]) * scale
            dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, rows(kf, j, bk), precision=_HIGHEST)
            dk_j = jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, precision=_HIGHEST)
            return dq, accumulate(dk, dk_j, j), accumulate(dv, dv_j, j)

        dk, dv = carry
        dq, dk, dv = lax.fori_loop(lo, hi, grad_step, (jnp.zeros((b, bq, kvh, grp, d), f32), dk, dv))
        return (dk, dv), dq

    init = (jnp.zeros((b, sp, kvh, d), f32), jnp.zeros((b, sp, kvh, d), f32))
    (dk, dv), dq = lax.scan(query_block, init, jnp.arange(nq))
    dq = jnp.moveaxis(dq, 0, 1).reshape(b, tp, h, d)[:, :t]
    return dq.astype(q.dtype), dk[:, :s].astype(k.dtype), dv[:, :s].astype(v.dtype)
