"""Straight-through estimators: train on master weights with the rollout's exact forward.

Forward = ``quantize(w_master)`` then the quantized kernel, so it is bitwise the rollout's forward
on frozen weights (training log-probs == rollout log-probs). Backward treats quantization (of the
weight and, for w8a8/w4a8, of the activations) as the identity: ordinary f32 matmuls with the
dequantized weight, gradients for the activations and the full-precision master weight.

``quantizer`` (default :func:`kernels_pallas.quantize`) lets a caller produce the weight format with
another quantizer that yields the same integers (``qarl_jax.quant`` passes AQT's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.formats import QuantizedWeight, dequantize, quantize
from kernels_pallas.grouped import grouped_matmul
from kernels_pallas.matmul import quantized_matmul

_HIGHEST = lax.Precision.HIGHEST
Quantizer = Callable[[jax.Array, str, int | None], QuantizedWeight]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _ste(x, w_master, fmt, group_size, out_dtype, block_rows, backend, quantizer):
    return _ste_fwd(x, w_master, fmt, group_size, out_dtype, block_rows, backend, quantizer)[0]


def _ste_fwd(x, w_master, fmt, group_size, out_dtype, block_rows, backend, quantizer):
    wq = quantizer(w_master, fmt, group_size)
    y = quantized_matmul(x, wq, out_dtype=out_dtype, block_rows=block_rows, backend=backend)
    return y, (x, w_master, wq)


def _ste_bwd(fmt, group_size, out_dtype, block_rows, backend, quantizer, res, g):
    x, w_master, wq = res
    k, n = w_master.shape
    w = dequantize(wq, jnp.float32)
    g2 = g.reshape(-1, n).astype(jnp.float32)
    x2 = x.reshape(-1, k).astype(jnp.float32)
    dx = jnp.matmul(g2, w.T, precision=_HIGHEST)
    dw = jnp.matmul(x2.T, g2, precision=_HIGHEST)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w_master.dtype)


_ste.defvjp(_ste_fwd, _ste_bwd)


def quantized_matmul_ste(
    x: jax.Array,
    w_master: jax.Array,
    fmt: str,
    group_size: int | None = None,
    *,
    out_dtype=None,
    block_rows: int | None = None,
    backend: str | None = None,
    quantizer: Quantizer = quantize,
) -> jax.Array:
    """x [..., K] @ quantizer(w_master [K, N], fmt, group_size), differentiable in x and w_master."""
    if w_master.ndim != 2:
        raise ValueError(f"w_master must be [K, N], got shape {w_master.shape}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    return _ste(x, w_master, fmt, group_size, out_dtype, block_rows, backend, quantizer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _grouped_ste(x, w_master, group_sizes, fmt, group_size, out_dtype, block_rows, backend, quantizer):
    args = (fmt, group_size, out_dtype, block_rows, backend, quantizer)
    return _grouped_ste_fwd(x, w_master, group_sizes, *args)[0]


def _grouped_ste_fwd(x, w_master, group_sizes, fmt, group_size, out_dtype, block_rows, backend, quantizer):
    wq = quantizer(w_master, fmt, group_size)
    y = grouped_matmul(x, wq, group_sizes, out_dtype=out_dtype, block_rows=block_rows, backend=backend)
    return y, (x, w_master, wq, group_sizes)


def _grouped_ste_bwd(fmt, group_size, out_dtype, block_rows, backend, quantizer, res, g):
    x, w_master, wq, group_sizes = res
    w = dequantize(wq, jnp.float32)

    def ragged(x32, w32):
        return lax.ragged_dot(x32, w32, group_sizes, precision=_HIGHEST, preferred_element_type=jnp.float32)

    _, vjp = jax.vjp(ragged, x.astype(jnp.float32), w)
    dx, dw = vjp(g.astype(jnp.float32))
    return dx.astype(x.dtype), dw.astype(w_master.dtype), None


_grouped_ste.defvjp(_grouped_ste_fwd, _grouped_ste_bwd)


def grouped_matmul_ste(
    x: jax.Array,
    w_master: jax.Array,
    group_sizes: jax.Array,
    fmt: str,
    group_size: int | None = None,
    *,
    out_dtype=None,
    block_rows: int | None = None,
    backend: str | None = None,
    quantizer: Quantizer = quantize,
) -> jax.Array:
    """grouped_matmul(x, quantizer(w_master [E, K, N]), group_sizes), differentiable in x and w_master."""
    if w_master.ndim != 3:
        raise ValueError(f"w_master must be [E, K, N], got shape {w_master.shape}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    return _grouped_ste(x, w_master, group_sizes, fmt, group_size, out_dtype, block_rows, backend, quantizer)
