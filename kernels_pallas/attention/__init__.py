"""Batch-invariant causal attention: ``api`` (public function, custom VJP), ``reference`` (dense
XLA and float64), ``cpu`` / ``gpu`` / ``tpu`` kernels, ``common`` (the online softmax step and
token ids the three share, and :class:`Visibility`, the arguments after q, k, v), ``cache`` (the KV
cache in the layout each backend's kernel reads, and the attention over one layer of it)."""

from kernels_pallas.attention.api import attention, default_block_kv
from kernels_pallas.attention.cache import CacheLayout, cache_layout, cached_attention
from kernels_pallas.attention.common import Visibility
from kernels_pallas.attention.reference import key_mask, reference_attention, reference_attention_f64

__all__ = [
    "CacheLayout",
    "Visibility",
    "attention",
    "cache_layout",
    "cached_attention",
    "default_block_kv",
    "key_mask",
    "reference_attention",
    "reference_attention_f64",
]
