"""The float64 / int64 numpy reference of the grouped (MoE) matmul: each expert's rows through the
dense reference, zeros past the groups."""

from __future__ import annotations

import numpy as np

from kernels_pallas.formats import QuantizedWeight
from kernels_pallas.matmul.reference import reference_matmul


def expert_weight(w: QuantizedWeight, e: int) -> QuantizedWeight:
    """Expert ``e`` of a [E, K, N] weight as a dense [K, N] QuantizedWeight."""
    scales = None if w.scales is None else w.scales[e]
    return QuantizedWeight(values=w.values[e], scales=scales, fmt=w.fmt, group_size=w.group_size)


def reference_grouped_matmul(x: np.ndarray, w: QuantizedWeight, group_sizes: np.ndarray) -> np.ndarray:
    """x [M, K] (rows sorted by expert) x w [E, K, N] in float64; rows past the groups are zeros."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros((x.shape[0], w.n), np.float64)
    start = 0
    for e, size in enumerate(np.asarray(group_sizes)):
        if size:
            out[start : start + size] = reference_matmul(x[start : start + size], expert_weight(w, e))
        start += size
    return out
