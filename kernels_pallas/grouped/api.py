"""Public grouped (ragged) quantized matmul for MoE experts, and its straight-through estimator.

Dropless, static shapes, per-token invariant: rows of x are sorted by expert in contiguous groups
(``group_sizes[e]`` rows for expert e) and each row's bits are the dense kernel's on that row,
whatever the other tokens, the group sizes of the other experts, or M. Rows past
``sum(group_sizes)`` give zeros (as ``jax.lax.ragged_dot``). Keyword options as
:func:`kernels_pallas.quantized_matmul`'s (the GPU kernel's ``split_k`` defaults to 1, not the dense table's).
The STE's backward walks the rows in blocks, one expert's dequantized weight at a time (dx with the
transposed weights, dW as a transposed grouped matmul: :mod:`kernels_pallas.grouped.backward`),
in O(rows) memory where ``lax.ragged_dot``'s transpose would expand over every expert.
"""

from __future__ import annotations

import functools
from typing import Unpack

import jax

from kernels_pallas import _backend, _checks
from kernels_pallas._backend import Options, Target
from kernels_pallas.formats import QuantizedWeight, quantize
from kernels_pallas.grouped.backward import grouped_backward
from kernels_pallas.matmul.api import SteOptions, out_dtype_of


def _grouped(
    x: jax.Array, w: QuantizedWeight, group_sizes: jax.Array, out_dtype, target: Target
) -> jax.Array:
    _checks.matmul_operands(x, w, ndim=3)
    _checks.group_sizes(group_sizes, w.values.shape[0])
    return target.kernel("grouped", "grouped_matmul")(x, w, group_sizes, out_dtype=out_dtype)


def grouped_matmul(
    x: jax.Array, w: QuantizedWeight, group_sizes: jax.Array, *, out_dtype=None, **options: Unpack[Options]
) -> jax.Array:
    """x [M, K] (rows sorted by expert) x w [E, K, N] -> [M, N]; each row bitwise independent of the
    other rows and of the group sizes other than its own expert's."""
    return _grouped(x, w, group_sizes, out_dtype_of(x, out_dtype), _backend.target(options))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _grouped_ste(x, w_master, group_sizes, fmt, group_size, out_dtype, target, quantizer):
    return _grouped(x, quantizer(w_master, fmt, group_size), group_sizes, out_dtype, target)


def _grouped_ste_fwd(x, w_master, group_sizes, fmt, group_size, out_dtype, target, quantizer):
    wq = quantizer(w_master, fmt, group_size)
    return _grouped(x, wq, group_sizes, out_dtype, target), (x, w_master, wq, group_sizes)


def _grouped_ste_bwd(fmt, group_size, out_dtype, target, quantizer, res, g):
    x, w_master, wq, group_sizes = res
    dx, dw = grouped_backward(x, g, wq, group_sizes)
    return dx.astype(x.dtype), dw.astype(w_master.dtype), None


_grouped_ste.defvjp(_grouped_ste_fwd, _grouped_ste_bwd)


def grouped_matmul_ste(
    x: jax.Array,
    w_master: jax.Array,
    group_sizes: jax.Array,
    fmt: str,
    group_size: int | None = None,
    **options: Unpack[SteOptions],
) -> jax.Array:
    """grouped_matmul(x, quantizer(w_master [E, K, N]), group_sizes), differentiable in x and w_master."""
    _checks.master_weight(w_master, ndim=3)
    out_dtype, quantizer = out_dtype_of(x, options.pop("out_dtype", None)), options.pop("quantizer", quantize)
    target = _backend.target(options)
    return _grouped_ste(x, w_master, group_sizes, fmt, group_size, out_dtype, target, quantizer)
