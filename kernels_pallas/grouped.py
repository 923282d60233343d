"""Grouped (ragged) quantized matmul for MoE experts: dropless, static shapes, per-token invariant.

Rows of x are sorted by expert in contiguous groups (``group_sizes[e]`` rows for expert e). Each
group is padded to a multiple of ``block_rows`` inside a static buffer of
``round_up(M + E * (block_rows - 1), block_rows)`` rows, so every block holds rows of one expert
only; each block then runs the dense per-block program with that expert's weight. A token's
arithmetic is therefore the dense kernel's on its own row, whatever the other tokens, groups or M.
Rows past ``sum(group_sizes)`` give zeros (as ``jax.lax.ragged_dot``).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas import cpu_matmul
from kernels_pallas.formats import QuantizedWeight, reference_matmul
from kernels_pallas.matmul import check_activations, check_weight, resolve_backend


def group_layout(group_sizes: jax.Array, m: int, block_rows: int) -> tuple[jax.Array, jax.Array, int]:
    """(dest [M]: padded row of each input row, out of range for rows past the groups;
    block_expert [P / block_rows]: the expert of each block; P: padded rows, static)."""
    e = group_sizes.shape[0]
    padded_rows = -(-(m + e * (block_rows - 1)) // block_rows) * block_rows
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    padded = -(-sizes // block_rows) * block_rows
    pends = jnp.cumsum(padded)
    rows = jnp.arange(m, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), e - 1)
    dest = (pends - padded)[expert] + rows - (ends - sizes)[expert]
    dest = jnp.where(rows < ends[-1], dest, padded_rows)
    block_starts = jnp.arange(0, padded_rows, block_rows, dtype=jnp.int32)
    block_expert = jnp.minimum(jnp.searchsorted(pends, block_starts, side="right"), e - 1)
    return dest, block_expert, padded_rows


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_rows"))
def _cpu_grouped(x, w: QuantizedWeight, group_sizes, out_dtype, block_rows):
    m, k = x.shape
    block_rows = block_rows or cpu_matmul.default_block_rows(w.k, w.n)
    dest, block_expert, padded_rows = group_layout(group_sizes, m, block_rows)
    xp = jnp.zeros((padded_rows, k), x.dtype).at[dest].set(x, mode="drop")
    wv, scales = cpu_matmul.prepare_weight(w, x.dtype)

    def block_fn(i, xb):
        e = block_expert[i]
        we = lax.dynamic_index_in_dim(wv, e, keepdims=False)
        se = None if scales is None else lax.dynamic_index_in_dim(scales, e, keepdims=False)
        return cpu_matmul.block_matmul(w.fmt, w.group_size, xb, we, se)

    yp = cpu_matmul.row_block_map(block_fn, xp, block_rows, w.n, out_dtype)
    return jnp.take(yp, dest, axis=0, mode="fill", fill_value=0)


def _accelerator_grouped(backend: str):
    try:
        return importlib.import_module(f"kernels_pallas.{backend}.grouped_matmul").grouped_matmul
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            f"no {backend} grouped matmul: kernels_pallas.{backend}.grouped_matmul.grouped_matmul is "
            f"unavailable ({err}); pass backend='cpu' to force the plain-JAX path"
        ) from err


def grouped_matmul(
    x: jax.Array,
    w: QuantizedWeight,
    group_sizes: jax.Array,
    *,
    out_dtype=None,
    block_rows: int | None = None,
    backend: str | None = None,
) -> jax.Array:
    """x [M, K] (rows sorted by expert) x w [E, K, N] -> [M, N]; each row bitwise independent of the
    other rows and of the group sizes other than its own expert's."""
    check_activations(x)
    check_weight(w, ndim=3)
    e = w.values.shape[0]
    if x.ndim != 2 or x.shape[1] != w.k:
        raise ValueError(f"x must be [M, K={w.k}], got shape {x.shape}")
    if group_sizes.shape != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be an integer array of shape ({e},); "
            f"got {group_sizes.dtype} {group_sizes.shape}"
        )
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    backend = resolve_backend(backend)
    if backend == "cpu":
        return _cpu_grouped(x, w, group_sizes, out_dtype, block_rows)
    return _accelerator_grouped(backend)(x, w, group_sizes, out_dtype=out_dtype, interpret=False)


def expert_weight(w: QuantizedWeight, e: int) -> QuantizedWeight:
    """Expert ``e`` of a [E, K, N] weight as a dense [K, N] QuantizedWeight."""
    scales = None if w.scales is None else w.scales[e]
    return QuantizedWeight(values=w.values[e], scales=scales, fmt=w.fmt, group_size=w.group_size)


def reference_grouped_matmul(x: np.ndarray, w: QuantizedWeight, group_sizes: np.ndarray) -> np.ndarray:
    """float64 / int64 numpy reference: each group through :func:`reference_matmul`, zeros past the groups."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros((x.shape[0], w.n), np.float64)
    start = 0
    for e, size in enumerate(np.asarray(group_sizes)):
        if size:
            out[start : start + size] = reference_matmul(x[start : start + size], expert_weight(w, e))
        start += size
    return out
