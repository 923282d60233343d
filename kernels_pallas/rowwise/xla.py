"""XLA's own row-wise operations (the references' formulas): NOT batch-invariant, for comparisons
only (``backend="xla"``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.rowwise.reference import reference_logsumexp, reference_rms_norm, reference_rope


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    return reference_rms_norm(x, weight, eps)


def rope(
    x: jax.Array, positions: jax.Array, *, theta: float, inv_freq: tuple[float, ...] | None = None
) -> jax.Array:
    return reference_rope(x, positions, theta, inv_freq)


def logsumexp(x: jax.Array, *, block_v: int) -> jax.Array:
    """``block_v`` is ignored: one reduction over the whole vocabulary."""
    del block_v
    return reference_logsumexp(x)


def scale_rows(x: jax.Array, inv: jax.Array) -> jax.Array:
    return x.astype(jnp.float32) * inv[:, None]
