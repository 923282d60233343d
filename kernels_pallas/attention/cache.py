"""The KV cache in the layout each backend's attention reads, and the attention over it.

A decode step attends to one layer of a stacked cache [L, ...]. On the CPU and GPU the cache is
[L, B, S, KV, D] and a layer is sliced out for :func:`kernels_pallas.attention.attention`. On a TPU
that slice is a copy, and the Mosaic kernel's layout ([B, KV, S_pad, D_pad]) is another: the
compiler counted 28 of the 44 GB a chip Qwen3-8B's w4a16 decode step moved (issue 52) in those
copies, for 12 GB of weights and cache. So there the cache is kept in the kernel's own layout,
[L, B, KV, S, D_pad] with room past ``max_len`` for the kernel's last key window, and the whole
stack goes to the kernel with the layer index as a scalar-prefetched operand
(:func:`kernels_pallas.attention.tpu.cached_attention`): one layer's K/V read, nothing copied.

The bits are the same either way: a layout moves values, and the TPU kernel is the one the training
forward runs (which lays out its K/V as a stack of one layer at index 0), so the digests of
``qarl_jax.tools.tpu_compile.mosaic_kernels`` still show one program.
"""

from __future__ import annotations

import dataclasses
from typing import Unpack

import jax
import jax.numpy as jnp

from kernels_pallas import _backend
from kernels_pallas._backend import Options
from kernels_pallas._tiling import pad_axis, round_up
from kernels_pallas.attention.api import attention, default_block_kv

_LANES = 128


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Where a stacked cache keeps what. ``heads_first``: [L, B, KV, length, head_dim] (the TPU
    kernel's), else [L, B, length, KV, head_dim]; ``max_len`` the positions a slot may use (a write
    at or past it is dropped), ``length`` and ``head_dim`` the allocated (padded) extents."""

    heads_first: bool
    max_len: int
    length: int
    head_dim: int

    def shape(self, layers: int, batch: int, kv_heads: int) -> tuple[int, ...]:
        if self.heads_first:
            return (layers, batch, kv_heads, self.length, self.head_dim)
        return (layers, batch, self.length, kv_heads, self.head_dim)

    def axes(self, batch: str | None, heads: str | None) -> tuple[str | None, ...]:
        """Logical axis names of a cache array, the slots' and the heads' given."""
        return (None, batch, heads, None, None) if self.heads_first else (None, batch, None, heads, None)

    def write(self, cache: jax.Array, layer, positions: jax.Array, new: jax.Array) -> jax.Array:
        """``cache`` with ``new`` [B, T, KV, D] at layer ``layer``, row b's token t at
        ``positions[b, t]``; positions at or past ``max_len`` are dropped."""
        rows = jnp.arange(new.shape[0])[:, None]
        if not self.heads_first:
            return cache.at[layer, rows, positions].set(new.astype(cache.dtype), mode="drop")
        # one head_dim row per (token, head) into [L * B * KV, length, head_dim], a free view: an
        # update window of (KV, head_dim) made XLA:TPU keep the cache in another tiling and copy
        # it into the kernel's at every layer
        n, kv = cache.shape[1], cache.shape[2]
        flat = cache.reshape(-1, *cache.shape[3:])
        which = (layer * n + rows[:, :, None]) * kv + jnp.arange(kv)  # [B, 1, KV]
        at = jnp.where(positions < self.max_len, positions, self.length)[:, :, None]  # past: dropped
        new = pad_axis(new.astype(cache.dtype), 3, self.head_dim)
        return flat.at[which, at].set(new, mode="drop").reshape(cache.shape)

    def put(self, cache: jax.Array, slots: jax.Array, prefix: jax.Array, rows: jax.Array, t: int):
        """``cache`` with the first ``t`` positions of ``prefix``'s ``rows`` (a cache of this
        layout's kind) written into ``slots`` (out-of-range slots dropped)."""
        if self.heads_first:
            src = prefix[:, rows, :, :t]
            return cache.at[:, slots, :, :t].set(src.astype(cache.dtype), mode="drop")
        return cache.at[:, slots, :t].set(prefix[:, rows, :t].astype(cache.dtype), mode="drop")


def cache_layout(max_len: int, head_dim: int, **options: Unpack[Options]) -> CacheLayout:
    """The layout of a cache of ``max_len`` positions for heads of ``head_dim``, on the backend
    ``options`` resolve to (as :func:`cached_attention` on that backend reads it)."""
    if _backend.target(options).backend != "tpu":
        return CacheLayout(False, max_len, max_len, head_dim)
    from kernels_pallas.attention.tpu import cache_length

    length = cache_length(max_len, default_block_kv(head_dim))
    return CacheLayout(True, max_len, length, round_up(head_dim, _LANES))


def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    positions: jax.Array,
    layout: CacheLayout,
    **options: Unpack[Options],
) -> jax.Array:
    """:func:`kernels_pallas.attention.attention` of q [B, T, H, D] at ``positions`` [B, T] against
    layer ``layer`` of a stacked cache of ``layout`` (the KV-cache visibility: starts 0, no
    segments), the same bits as that function on the layer's K/V. Forward only (the decode step)."""
    if not layout.heads_first:
        k, v = k_cache[layer].astype(q.dtype), v_cache[layer].astype(q.dtype)
        return attention(q, k, v, positions, **options)
    target = _backend.target(options)
    if target.backend != "tpu":
        raise ValueError(f"a heads-first (TPU) cache needs the tpu attention kernel, not {target.backend!r}")
    kernel = target.kernel("attention", "cached_attention")
    k, v = k_cache.astype(q.dtype), v_cache.astype(q.dtype)  # no-ops: the cache is in q's dtype
    return kernel(q, k, v, layer, positions, length=layout.max_len, block_kv=default_block_kv(q.shape[-1]))
