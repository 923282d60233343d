"""The float64 / int64 numpy reference of the dense quantized matmul (what each format computes,
with no block order): exact for w8a8 (int64 core), the ideal value for the float formats (fp8:
its e4m3 products are exact in float64 and summed there)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.formats import ACT_BITS, QuantizedWeight, int_values, quantize_activations


def reference_matmul(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """x [M, K] @ w [K, N] in float64 (int64 for the w8a8 / w4a8 integer cores)."""
    x = np.asarray(x, dtype=np.float64)
    if w.scales is None:
        return x @ np.asarray(w.values, dtype=np.float64)
    scales = np.asarray(w.scales, dtype=np.float64)
    if w.fmt == "fp8":
        xq, xs = (np.asarray(a, np.float64) for a in quantize_activations(jnp.asarray(x, jnp.float32), "fp8"))
        return (xq @ np.asarray(int_values(w), np.float64)) * xs * scales[0]
    q = np.asarray(int_values(w), dtype=np.int64)
    k, n = q.shape
    g = w.group_size
    if ACT_BITS[w.fmt] == 8:
        xq, xs = (np.asarray(a) for a in quantize_activations(jnp.asarray(x, jnp.float32)))
        xq = xq.astype(np.int64)
        parts = np.stack([xq[:, i * g : (i + 1) * g] @ q[i * g : (i + 1) * g] for i in range(k // g)])
        return np.einsum("gmn,gn->mn", parts.astype(np.float64), scales) * xs.astype(np.float64)
    deq = (q.reshape(k // g, g, n) * scales[:, None, :]).reshape(k, n)
    return x @ deq
