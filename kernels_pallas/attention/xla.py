"""XLA's dense attention (f32 scores over every key): NOT batch-invariant, for comparisons only
(``backend="xla"``)."""

from __future__ import annotations

import jax

from kernels_pallas.attention.reference import reference_attention


def attention(q, k, v, positions, starts, segment_ids, kv_segment_ids, *, block_kv: int) -> jax.Array:
    """q [B,T,H,D], k/v [B,S,KV,D] -> [B,T,H,D]; ``block_kv`` is ignored (one dense product)."""
    del block_kv
    return reference_attention(q, k, v, positions, starts, segment_ids, kv_segment_ids)
