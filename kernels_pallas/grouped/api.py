"""Public grouped (ragged) quantized matmul for MoE experts, and its straight-through estimator.

Dropless, static shapes, per-token invariant: rows of x are sorted by expert in contiguous groups
(``group_sizes[e]`` rows for expert e) and each row's bits are the dense kernel's on that row,
whatever the other tokens, the group sizes of the other experts, or M. Rows past
``sum(group_sizes)`` give zeros (as ``jax.lax.ragged_dot``). ``interpret`` and ``**tiling`` as in
:func:`kernels_pallas.quantized_matmul` (the GPU kernel takes every dense knob but ``split_k``).
The STE's backward is ``lax.ragged_dot`` on the dequantized weight (see ``matmul.api``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import _backend, _checks
from kernels_pallas._backend import Knob, Target
from kernels_pallas.formats import QuantizedWeight, Quantizer, dequantize, quantize


def _grouped(
    x: jax.Array, w: QuantizedWeight, group_sizes: jax.Array, out_dtype, target: Target
) -> jax.Array:
    _checks.matmul_operands(x, w, ndim=3)
    _checks.group_sizes(group_sizes, w.values.shape[0])
    return target.kernel("grouped", "grouped_matmul")(x, w, group_sizes, out_dtype=out_dtype)


def grouped_matmul(
    x: jax.Array,
    w: QuantizedWeight,
    group_sizes: jax.Array,
    *,
    out_dtype=None,
    backend: str | None = None,
    interpret: bool = False,
    **tiling: Knob | None,
) -> jax.Array:
    """x [M, K] (rows sorted by expert) x w [E, K, N] -> [M, N]; each row bitwise independent of the
    other rows and of the group sizes other than its own expert's."""
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    return _grouped(x, w, group_sizes, out_dtype, _backend.target(backend, interpret, tiling))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _grouped_ste(x, w_master, group_sizes, fmt, group_size, out_dtype, target, quantizer):
    return _grouped(x, quantizer(w_master, fmt, group_size), group_sizes, out_dtype, target)


def _grouped_ste_fwd(x, w_master, group_sizes, fmt, group_size, out_dtype, target, quantizer):
    wq = quantizer(w_master, fmt, group_size)
    return _grouped(x, wq, group_sizes, out_dtype, target), (x, w_master, wq, group_sizes)


def _grouped_ste_bwd(fmt, group_size, out_dtype, target, quantizer, res, g):
    x, w_master, wq, group_sizes = res

    def ragged(x32, w32):
        return lax.ragged_dot(
            x32, w32, group_sizes, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )

    _, vjp = jax.vjp(ragged, x.astype(jnp.float32), dequantize(wq, jnp.float32))
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
    backend: str | None = None,
    interpret: bool = False,
    quantizer: Quantizer = quantize,
    **tiling: Knob | None,
) -> jax.Array:
    """grouped_matmul(x, quantizer(w_master [E, K, N]), group_sizes), differentiable in x and w_master."""
    if w_master.ndim != 3:
        raise ValueError(f"w_master must be [E, K, N], got shape {w_master.shape}")
    target = _backend.target(backend, interpret, tiling)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    return _grouped_ste(x, w_master, group_sizes, fmt, group_size, out_dtype, target, quantizer)
