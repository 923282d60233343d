"""Batch-invariant causal attention: one token's output has the same bits whether it is computed in
a full-sequence forward (training, prefill, packed rows) or in a decode step over a KV cache.

How: a query at position p visits the keys of its own sequence in fixed blocks of ``block_kv``
positions, block ``j`` holding positions ``[j * block_kv, (j + 1) * block_kv)`` *relative to the
start of the sequence* (key index ``starts + position``), so packing does not move the block
boundaries. Blocks are combined by the same online softmax in ascending order. Masked keys give
exact zeros (their probability is selected to 0, not underflowed); a block with no visible key
leaves the running state bit-for-bit unchanged (max unchanged, rescale by exp(0) = 1, plus 0), so
the number of trailing or leading all-masked blocks a path happens to visit is irrelevant. Nothing
depends on the batch size, the neighbouring rows, the padding or the cache length.

Key layout: q [B, T, H, D], k/v [B, S, KV, D] (grouped-query: H a multiple of KV). ``positions``
[B, T] is each query's position in its sequence, ``starts`` [B, T] the key index of that sequence's
position 0 (None: 0, the KV-cache layout; a packed row passes ``t - positions``). Optional
``segment_ids`` [B, T] / ``kv_segment_ids`` [B, S]: a key is visible only within the query's
segment. Requires ``starts >= 0`` (positions never run ahead of the row index).

The CPU path is plain JAX over fixed blocks of query tokens (each token gathers its own key
blocks); GPU/TPU run ``kernels_pallas.{gpu,tpu}.attention``. The backward (custom VJP) is the dense
XLA formula: gradients need not be invariant.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas import cpu_rows
from kernels_pallas.matmul import resolve_backend

MASK = -1e30  # the running max starts here, so an all-masked block rescales by exactly exp(0) = 1
_HIGHEST = lax.Precision.HIGHEST


def default_block_kv(head_dim: int) -> int:
    """Keys per block: a function of the head size only (never of T, S or B)."""
    return 32 if head_dim <= 128 else 16


def key_mask(positions, starts, segment_ids, kv_segment_ids, s: int) -> jax.Array:
    """[B, T, S] bool: which keys each query sees (the semantics every path implements)."""
    idx = jnp.arange(s)[None, None, :]
    rel = idx - starts[:, :, None]
    mask = (rel >= 0) & (rel <= positions[:, :, None])
    if kv_segment_ids is not None:
        mask &= kv_segment_ids[:, None, :] == segment_ids[:, :, None]
    return mask


def reference_attention(q, k, v, positions, starts=None, segment_ids=None, kv_segment_ids=None):
    """Dense XLA attention with the same visibility (f32 scores); also the custom-VJP backward."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    starts = jnp.zeros_like(positions) if starts is None else starts
    mask = key_mask(positions, starts, segment_ids, kv_segment_ids, k.shape[1])
    qg = q.reshape(b, t, kvh, h // kvh, d)
    sc = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=_HIGHEST)
    sc = jnp.where(mask[:, None, None], sc * (d**-0.5), MASK)
    p = jnp.where(mask[:, None, None], jax.nn.softmax(sc, axis=-1), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def reference_attention_f64(q, k, v, positions, starts=None, segment_ids=None, kv_segment_ids=None):
    """float64 numpy reference for the tests (rows that see no key give zeros)."""
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


@functools.partial(jax.jit, static_argnames=("block_kv", "block_rows"))
def _cpu_attention(q, k, v, positions, starts, segment_ids, kv_segment_ids, *, block_kv, block_rows):
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    scale = d**-0.5
    # no segments = one segment: the same program either way (a different body compiles differently)
    kv_seg = jnp.zeros((b, s), jnp.int32) if kv_segment_ids is None else kv_segment_ids
    # opaque, like a kernel's operands: neither recomputed inside the loop nor constant-folded into it
    k, v, kv_seg = lax.optimization_barrier((k, v, kv_seg.astype(jnp.int32)))
    q_seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids
    rows = (
        q.reshape(b * t, kvh, g, d),
        positions.reshape(-1).astype(jnp.int32),
        starts.reshape(-1).astype(jnp.int32),
        q_seg.reshape(-1).astype(jnp.int32),
        jnp.repeat(jnp.arange(b, dtype=jnp.int32), t),
    )

    def block(qb, pos, st, seg, bi):
        def step(j, carry):
            m, denom, acc = carry
            rel = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            idx = st[:, None] + rel[None, :]
            valid = (rel[None, :] <= pos[:, None]) & (idx >= 0) & (idx < s)
            valid &= kv_seg.at[bi[:, None], idx].get(mode="fill", fill_value=-1) == seg[:, None]
            kb = k.at[bi[:, None], idx].get(mode="fill", fill_value=0)
            vb = v.at[bi[:, None], idx].get(mode="fill", fill_value=0)
            mask = valid[:, None, None, :]
            sc = jnp.einsum("rkgd,rbkd->rkgb", qb, kb, preferred_element_type=jnp.float32, precision=_HIGHEST)
            sc = jnp.where(mask, sc * scale, MASK)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(sc - m_new[..., None]), 0.0)
            pv = jnp.einsum(
                "rkgb,rbkd->rkgd",
                p.astype(vb.dtype),
                vb,
                preferred_element_type=jnp.float32,
                precision=_HIGHEST,
            )
            return m_new, denom * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        shape = (block_rows, kvh, g)
        init = (
            jnp.full(shape, MASK, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, d), jnp.float32),
        )
        _, denom, acc = lax.fori_loop(0, jnp.max(pos) // block_kv + 1, step, init)
        return (acc / jnp.where(denom == 0, 1.0, denom)[..., None],)

    out = jax.ShapeDtypeStruct((kvh, g, d), q.dtype)
    (o,) = cpu_rows.map_row_blocks(block, rows, block_rows, (out,))
    return o.reshape(b, t, h, d)


def _dispatch(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv, block_rows, backend):
    if backend == "cpu":
        st = jnp.zeros_like(positions) if starts is None else starts
        return _cpu_attention(
            q, k, v, positions, st, segment_ids, kv_segment_ids, block_kv=block_kv, block_rows=block_rows
        )
    try:
        kernel = importlib.import_module(f"kernels_pallas.{backend}.attention").attention
    except (ImportError, AttributeError) as err:
        raise RuntimeError(f"no {backend} attention kernel ({err}); pass backend='cpu'") from err
    return kernel(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv=block_kv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv, block_rows, backend):
    return _dispatch(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv, block_rows, backend)


def _attention_fwd(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv, block_rows, backend):
    out = _dispatch(q, k, v, positions, starts, segment_ids, kv_segment_ids, block_kv, block_rows, backend)
    return out, (q, k, v, positions, starts, segment_ids, kv_segment_ids)


def _attention_bwd(block_kv, block_rows, backend, res, g):
    q, k, v, *meta = res
    _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, *meta), q, k, v)
    return (*vjp(g), *(None for _ in meta))


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
    block_rows: int | None = None,
    backend: str | None = None,
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
    block_rows = block_rows or cpu_rows.pow2_rows(block_kv * k.shape[2] * d * 2, hi=16)
    return _attention(
        q,
        k,
        v,
        positions,
        starts,
        segment_ids,
        kv_segment_ids,
        block_kv,
        block_rows,
        resolve_backend(backend),
    )
