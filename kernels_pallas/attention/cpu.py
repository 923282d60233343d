"""CPU path of the invariant attention: plain JAX over fixed blocks of query tokens
(:func:`kernels_pallas._rowblocks.map_row_blocks`); each token reads its own key blocks
``starts + [j * block_kv, (j + 1) * block_kv)`` for ``j = 0 .. position // block_kv``.

Cost: each row block visits ``max(position in the block) // block_kv + 1`` key blocks, and each
visit reads one contiguous ``[block_kv, KV, D]`` slice per token (one start index per token, a
slice gather, never a per-key gather). So a decode step over a KV cache reads what the slots have
filled, not the whole cache. Two details keep it that way under XLA:CPU:

- the keys, values and key segments enter each key-block step through an
  ``optimization_barrier`` together with the step index, so they look different in every
  iteration: otherwise XLA hoists the loop-invariant part out of the loop, i.e. converts the
  *whole* cache to f32 (the dot's operand type) and gathers each row's whole sequence once per row
  block (measured: 6x the CPU time of this version for a 32-slot decode step over a 512-long cache);
- the cache is padded (copied) only when a slice could run past its end: never for the KV-cache
  layout (``starts`` None) when its length is a multiple of ``block_kv``, always by one block for
  packed rows (training, where the copy is small beside the forward); and a key axis of one block
  gets a second (a copy of at most one block): with one row, every key slice of a one-block array
  is the whole array, which XLA:CPU simplifies into another program (measured: with one query head
  per kv head, f32 rows differed from the same rows beside others; a tensor-parallel engine
  prefilling one short prompt per device lost the bits).

Why the row arithmetic stays invariant: a row is one (token, kv head) pair, and every row block runs
the same fixed-shape program (the per-block dots have shapes set by ``block_rows``, ``block_kv``,
the head size and the query heads per kv head), whatever the number of rows, the cache length, the
neighbours or the number of kv heads: a tensor-parallel device holding some of the heads computes
each head's bits as the whole model does (with heads as a batch axis of the dots, XLA:CPU's f32 dot
code, and so the bits, changed with the number of heads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._rowblocks import map_row_blocks
from kernels_pallas._tiling import pad_axis, round_up, rows_per_block
from kernels_pallas.attention.common import MASK, normalise, online_softmax_step, token_ids


@functools.partial(jax.jit, static_argnames=("block_kv", "block_rows"))
def attention(
    q, k, v, positions, starts, segment_ids, kv_segment_ids, *, block_kv: int, block_rows: int | None = None
) -> jax.Array:
    """q [B,T,H,D], k/v [B,S,KV,D] -> [B,T,H,D] (layout as :func:`kernels_pallas.attention.attention`).
    A row is one (token, kv head) pair: its ``H / KV`` query heads against that kv head's keys.
    ``block_rows`` such rows per block default to a function of (block_kv, D) only."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    block_rows = block_rows or rows_per_block(block_kv * d * 2)
    # a block holding a visible key starts below s: it ends within s_pad (see the module docstring);
    # never one block: a key slice would then be the whole array (see the module docstring)
    s_pad = max(round_up(s, block_kv) if starts is None else s + block_kv, 2 * block_kv)
    # no segments = one segment: the same program either way (a different body compiles differently)
    pos, st, q_seg, kv_seg = token_ids(positions, starts, segment_ids, kv_segment_ids, s, s_pad)
    k, v = pad_axis(k, 1, s_pad), pad_axis(v, 1, s_pad)
    per_head = lambda a: jnp.repeat(a.reshape(-1), kvh)  # a token's id, once for each of its kv heads
    rows = (
        q.reshape(b * t * kvh, g, d),  # [B, T, KV, G, D]: rows in (token, kv head) order, no copy
        per_head(pos),
        per_head(st),
        per_head(q_seg),
        per_head(jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))),
        jnp.tile(jnp.arange(kvh, dtype=jnp.int32), b * t),
    )

    def block(qb, pos, st, seg, bi, hi):
        qf = qb.astype(jnp.float32)

        def step(j, carry):
            kc, vc, segc, j = lax.optimization_barrier((k, v, kv_seg, j))  # no hoisting: docstring

            def take(a, head: bool):  # row r's a[bi[r], st[r] + j * block_kv + (0..block_kv), hi[r]]
                size = (1, block_kv, *((1, d) if head else ()))
                one = lambda bb, s0, hh: lax.dynamic_slice(
                    a, (bb, s0, *((hh, 0) if head else ())), size
                ).reshape(size[1:2] + size[3:])
                return jax.vmap(one)(bi, st + j * block_kv, hi)

            rel = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            valid = (rel[None, :] <= pos[:, None]) & (take(segc, False) == seg[:, None])
            kb, vb = take(kc, True).astype(jnp.float32), take(vc, True).astype(jnp.float32)
            sc = jnp.einsum("rgd,rbd->rgb", qf, kb, preferred_element_type=jnp.float32)

            def pv(p):  # probabilities rounded to the values' dtype first, as the reference does
                p = p.astype(v.dtype).astype(jnp.float32)
                return jnp.einsum("rgb,rbd->rgd", p, vb, preferred_element_type=jnp.float32)

            return online_softmax_step(carry, sc, valid[:, None, :], d**-0.5, pv)

        shape = (block_rows, g)
        init = (
            jnp.full(shape, MASK, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, d), jnp.float32),
        )
        _, denom, acc = lax.fori_loop(0, jnp.max(pos) // block_kv + 1, step, init)
        return (normalise(acc, denom),)

    out = jax.ShapeDtypeStruct((g, d), q.dtype)
    (o,) = map_row_blocks(block, rows, block_rows, (out,))
    return o.reshape(b, t, h, d)
