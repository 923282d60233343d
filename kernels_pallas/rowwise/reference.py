"""Plain-XLA references of the row-wise operations (the numerics every kernel implements; also
the custom VJPs' backward formulas)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.rowwise import common


def reference_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3's RMSNorm: normalise in f32, cast to the input dtype, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def reference_rope(
    x: jax.Array, positions: jax.Array, theta: float, inv_freq: tuple[float, ...] | None = None
) -> jax.Array:
    """Rotary embedding, non-interleaved halves (rotate_half), angles in f32: x [..., H, D],
    positions [...]. ``inv_freq``: the D/2 inverse frequencies of a scaled RoPE (Llama 3's),
    used instead of ``theta``'s; theta's are computed on the host, the same bits on every host and
    backend (:func:`common.inv_freq`)."""
    freq = jnp.asarray(common.inv_freq(theta, x.shape[-1], inv_freq))
    angles = positions.astype(jnp.float32)[..., None] * freq
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def reference_logsumexp(x: jax.Array, temperature: float = 1.0) -> jax.Array:
    return jax.nn.logsumexp(x.astype(jnp.float32) / temperature, axis=-1)
