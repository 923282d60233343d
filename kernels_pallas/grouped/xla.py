"""XLA's ``ragged_dot`` for the grouped (MoE) matmul: NOT batch-invariant, for comparisons only
(``backend="xla"``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.formats import ACT_BITS, QuantizedWeight, dequantize, quantize_activations


def grouped_matmul(x: jax.Array, w: QuantizedWeight, group_sizes: jax.Array, *, out_dtype) -> jax.Array:
    """x [M, K] (rows sorted by expert) x w [E, K, N] -> [M, N] (operands already checked)."""
    if w.scales is not None and ACT_BITS[w.fmt] == 8:
        qx, sx = quantize_activations(x, w.fmt)
        y = lax.ragged_dot(qx.astype(jnp.float32), dequantize(w), group_sizes) * sx
        return y.astype(out_dtype)
    wf = w.values if w.scales is None else dequantize(w)  # w4a16: the int4 values times f32 scales
    ct = jnp.promote_types(x.dtype, wf.dtype)
    y = lax.ragged_dot(x.astype(ct), wf.astype(ct), group_sizes, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
