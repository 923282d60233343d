"""References of the invariant attention: the visibility rule every path implements, dense XLA
attention (the gradient reference of the blockwise backward) and a float64 numpy version for the
tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas.attention.common import MASK


def key_mask(positions, starts, segment_ids, kv_segment_ids, s: int) -> jax.Array:
    """[B, T, S] bool: which keys each query sees."""
    idx = jnp.arange(s)[None, None, :]
    rel = idx - starts[:, :, None]
    mask = (rel >= 0) & (rel <= positions[:, :, None])
    if kv_segment_ids is not None:
        mask &= kv_segment_ids[:, None, :] == segment_ids[:, :, None]
    return mask


def reference_attention(q, k, v, positions, starts=None, segment_ids=None, kv_segment_ids=None):
    """Dense XLA attention with the same visibility (f32 scores)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    starts = jnp.zeros_like(positions) if starts is None else starts
    mask = key_mask(positions, starts, segment_ids, kv_segment_ids, k.shape[1])
    qg = q.reshape(b, t, kvh, h // kvh, d)
    sc = jnp.einsum(
        "btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
    )
    sc = jnp.where(mask[:, None, None], sc * (d**-0.5), MASK)
    p = jnp.where(mask[:, None, None], jax.nn.softmax(sc, axis=-1), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def reference_attention_f64(q, k, v, positions, starts=None, segment_ids=None, kv_segment_ids=None):
    """float64 numpy reference (rows that see no key give zeros)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    positions = np.asarray(positions)
    starts = np.zeros_like(positions) if starts is None else np.asarray(starts)
    mask = np.asarray(
        key_mask(jnp.asarray(positions), jnp.asarray(starts), segment_ids, kv_segment_ids, k.shape[1])
    )
    b, t, h, d = q.shape
    g = h // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    sc = np.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(d)
    sc = np.where(mask[:, None], sc, -np.inf)
    mx = np.max(sc, axis=-1, keepdims=True)
    e = np.where(mask[:, None], np.exp(sc - np.where(np.isfinite(mx), mx, 0)), 0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhts,bshd->bthd", p, vv)
