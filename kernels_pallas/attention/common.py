"""What the CPU, GPU and TPU attention programs share: the per-token ids they read and the online
softmax step, so that the three compute the same thing in the same order; and :class:`Visibility`,
the arguments that say which keys a query sees, as the backward and the models pass them on.

A masked key's score is set to ``MASK`` and its probability selected to exactly 0 (not
underflowed); the running max starts at ``MASK``, so a block with no visible key leaves the running
state bit-for-bit unchanged (max unchanged, rescale by exp(0) = 1, plus 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas._tiling import pad_axis

MASK = -1e30


class Visibility(NamedTuple):
    """Which keys each query sees: the attention's arguments after q, k, v, in their order, so
    ``attention(q, k, v, *visibility)`` (layouts in :mod:`kernels_pallas.attention.api`). One list
    of them for every function that only passes them on (the backward, the models' per-device
    call)."""

    positions: jax.Array
    starts: jax.Array | None = None
    segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None


def token_ids(
    positions: jax.Array,
    starts: jax.Array | None,
    segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    s: int,
    s_pad: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """int32 (positions, starts, segment ids) [B, T] and key segment ids [B, s_pad]: absent starts
    are 0 (the KV-cache layout), absent segments one segment 0, the keys past ``s`` segment -1
    (invisible)."""
    b, t = positions.shape
    zeros = jnp.zeros((b, t), jnp.int32)
    st = zeros if starts is None else starts.astype(jnp.int32)
    seg = zeros if segment_ids is None else segment_ids.astype(jnp.int32)
    kseg = jnp.zeros((b, s), jnp.int32) if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
    return positions.astype(jnp.int32), st, seg, pad_axis(kseg, 1, s_pad, -1)


def online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    scores: jax.Array,
    valid: jax.Array,
    scale: float,
    pv: Callable[[jax.Array], jax.Array],
    keepdims: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block into the running (max, denominator, accumulator): ``scores`` [..., block_kv]
    (unscaled), ``valid`` the visible keys, ``pv(p)`` the probabilities times the block's values.
    ``keepdims``: the running max and denominator keep a trailing axis of 1 (Mosaic's layout)."""
    m, denom, acc = carry
    col = (lambda a: a) if keepdims else (lambda a: a[..., None])
    sc = jnp.where(valid, scores * scale, MASK)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1, keepdims=keepdims))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(sc - col(m_new)), 0.0)
    return m_new, denom * alpha + jnp.sum(p, axis=-1, keepdims=keepdims), acc * col(alpha) + pv(p)


def normalise(acc: jax.Array, denom: jax.Array, keepdims: bool = False) -> jax.Array:
    """The accumulator over its denominator; a query that sees no key gives zeros."""
    d = jnp.where(denom == 0, 1.0, denom)
    return acc / (d if keepdims else d[..., None])
