"""Batch-invariant causal attention: one token's output has the same bits whether it is computed in
a full-sequence forward (training, prefill, packed rows) or in a decode step over a KV cache.

How: a query at position p visits the keys of its own sequence in fixed blocks of ``block_kv``
positions, block ``j`` holding positions ``[j * block_kv, (j + 1) * block_kv)`` *relative to the
start of the sequence* (key index ``starts + position``), so packing does not move the block
boundaries. Blocks are combined by the same online softmax in ascending order (``common``). Masked
keys give exact zeros, and a block with no visible key leaves the running state bit-for-bit
unchanged, so the number of trailing or leading all-masked blocks a path happens to visit is
irrelevant. Nothing depends on the batch size, the neighbouring rows, the padding or the cache
length.

Key layout: q [B, T, H, D], k/v [B, S, KV, D] (grouped-query: H a multiple of KV). ``positions``
[B, T] is each query's position in its sequence, ``starts`` [B, T] the key index of that sequence's
position 0 (None: 0, the KV-cache layout; a packed row passes ``t - positions``). Optional
``segment_ids`` [B, T] / ``kv_segment_ids`` [B, S]: a key is visible only within the query's
segment. Requires ``starts >= 0`` (positions never run ahead of the row index).

Keyword options: ``block_kv`` (keys per block, every backend; default :func:`default_block_kv`)
and the kernel :class:`kernels_pallas._backend.Options` (CPU ``block_rows``: query tokens per
block; GPU ``num_warps``). The backward (custom VJP) is blockwise in O(T) memory on every backend
(:mod:`kernels_pallas.attention.backward`): gradients need not be invariant.
"""

from __future__ import annotations

import functools
from typing import Unpack

import jax

from kernels_pallas import _backend
from kernels_pallas._backend import Options
from kernels_pallas.attention.backward import attention_backward
from kernels_pallas.attention.common import Visibility


def default_block_kv(head_dim: int) -> int:
    """Keys per block: a function of the head size only (never of T, S or B)."""
    return 32 if head_dim <= 128 else 16


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attention(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv, target):
    kernel = target.kernel("attention", "attention")
    return kernel(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv=block_kv)


def _attention_fwd(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv, target):
    out = _attention(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv, target)
    return out, (q, k, v, out, positions, starts, segment_ids, kv_segment_ids)


def _attention_bwd(block_kv, target, res, g):
    q, k, v, out, *meta = res
    return (*attention_backward(q, k, v, out, g, Visibility(*meta)), *(None for _ in meta))


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    starts: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    block_kv: int | None = None,
    **options: Unpack[Options],
) -> jax.Array:
    """Causal grouped-query attention, every query bitwise independent of batch, packing and cache
    length (see the module docstring for the layout). Returns [B, T, H, D] in q's dtype."""
    b, t, h, d = q.shape
    if k.shape != v.shape or k.ndim != 4 or k.shape[0] != b or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(
            f"q {q.shape} and k/v {k.shape}/{v.shape} are not [B,T,H,D] / [B,S,KV,D] with KV | H"
        )
    if positions.shape != (b, t) or (starts is not None and starts.shape != (b, t)):
        raise ValueError(f"positions/starts must be [B, T] = {(b, t)}")
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both segment_ids and kv_segment_ids, or neither")
    block_kv = block_kv or default_block_kv(d)
    return _attention(
        q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv, _backend.target(options)
    )
