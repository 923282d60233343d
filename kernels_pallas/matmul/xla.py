"""XLA's own dot for the dense quantized matmul: the same formats' values, NOT batch-invariant
(XLA picks the reduction order per shape, so a row's bits depend on M). For comparisons only:
what the invariance costs (``backend="xla"``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.formats import ACT_BITS, QuantizedWeight, dequantize, quantize_activations


def matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype) -> jax.Array:
    """[M, K] x QuantizedWeight [K, N] -> [M, N] with one XLA dot (inputs already checked)."""
    if w.scales is not None and ACT_BITS[w.fmt] == 8:
        qx, sx = quantize_activations(x, w.fmt)
        return ((qx.astype(jnp.float32) @ dequantize(w)) * sx).astype(out_dtype)  # w8a8 / w4a8 / fp8
    wf = w.values if w.scales is None else dequantize(w)  # w4a16: the int4 values times f32 scales
    ct = jnp.promote_types(x.dtype, wf.dtype)
    return jnp.dot(x.astype(ct), wf.astype(ct), preferred_element_type=jnp.float32).astype(out_dtype)
