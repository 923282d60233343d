"""The model's one door to quantized matmuls: :func:`dot` (dense, optionally in column blocks) and
:func:`grouped_dot` (the MoE experts), each on a float master kernel (quantized on the fly under a
straight-through estimator: training) or a frozen :class:`QuantizedWeight` (the rollout), both
reaching the same kernel with the same integers. ``spec=None`` is plain XLA."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import (
    QuantizedWeight,
    dequantize,
    grouped_matmul,
    grouped_matmul_ste,
    quantize,
    quantized_matmul,
    quantized_matmul_ste,
)
from kernels_pallas.formats import Quantizer
from qarl_jax.quant.spec import QuantSpec


def _check_frozen(w: QuantizedWeight, fmt: str, kind: str) -> None:
    if w.fmt != fmt:
        raise ValueError(f"{kind} weight is frozen as {w.fmt!r} but the spec runs {kind} layers in {fmt!r}")


def weight_quantizer(fmt: str) -> Quantizer:
    """AQT for the quantized formats; bf16 has nothing to quantize (the weight is the value)."""
    if fmt == "bf16":
        return quantize
    from qarl_jax.quant import aqt

    return aqt.quantize


def _float_weight(w) -> jax.Array:
    return dequantize(w) if isinstance(w, QuantizedWeight) else w


def dot(
    x: jax.Array,
    w: jax.Array | QuantizedWeight,
    spec: QuantSpec | None,
    kind: str,
    blocks: int | None = None,
) -> jax.Array:
    """x [..., K] @ w [K, N] for a layer of ``kind``; w a float master kernel or a frozen weight.

    ``blocks`` (a column-blocked model, ``TransformerConfig.tensor_blocks`` > 1): the N columns as that
    many equal blocks (the last padded with zero columns when they do not divide N, the padded
    outputs dropped), each its own kernel call on its own materialised (x, weight slice) pair,
    concatenated: what a tensor-parallel device computes for the blocks it holds (quantization
    scales are per column, so slicing commutes with it). One block is such a call too: a device of
    a tensor-parallel engine holding one block runs the very program of one of the training
    forward's blocks. Why materialised (an optimization barrier): without it XLA may merge the dots
    back into one, read the slice in place, or fuse x's producer into the kernel and drop x's
    rounding to its dtype (XLA's excess precision: a bf16 value the kernel upcasts to f32 is then
    the producer's unrounded f32), any of which changes the bits on one layout and not the other.
    None: one plain call (a model that is not column-blocked). Ignored by the plain XLA path
    (``spec`` None)."""
    if blocks is not None and spec is not None:
        n = _columns(w)
        width = -(-n // blocks)  # a vocabulary the blocks do not divide: zero columns, cut off below
        w = pad_columns(w, width * blocks)
        parts = []
        for i in range(blocks):
            xi, wi = lax.optimization_barrier((x, column_slice(w, i * width, width)))
            parts.append(dot(xi, wi, spec, kind))
        y = parts[0] if blocks == 1 else jnp.concatenate(parts, axis=-1)
        return y if y.shape[-1] == n else y[..., :n]
    if spec is None:
        wf = _float_weight(w)
        ct = jnp.result_type(x.dtype, wf.dtype)
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return lax.dot_general(x.astype(ct), wf.astype(ct), dims, precision=lax.Precision.HIGHEST)
    fmt, group_size = spec.format_of(kind)
    if isinstance(w, QuantizedWeight):
        _check_frozen(w, fmt, kind)
        return quantized_matmul(x, w)
    return quantized_matmul_ste(x, w, fmt, group_size, quantizer=weight_quantizer(fmt))


def _columns(w: jax.Array | QuantizedWeight) -> int:
    return w.n if isinstance(w, QuantizedWeight) else w.shape[-1]


def pad_columns(w: jax.Array | QuantizedWeight, n: int):
    """``w`` with zero columns appended up to ``n`` columns; a frozen weight's pad has the scale 1
    that a zero column quantizes to, so padding then quantizing and quantizing then padding give
    the same weight (the rollout engine pads its frozen lm_head, the training forward its master)."""
    extra = n - _columns(w)
    if extra == 0:
        return w
    pad = lambda a, value=0: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)], constant_values=value)  # noqa: E731
    if isinstance(w, QuantizedWeight):
        scales = None if w.scales is None else pad(w.scales, 1)
        return dataclasses.replace(w, values=pad(w.values), scales=scales)
    return pad(w)


def column_slice(w: jax.Array | QuantizedWeight, start: int, width: int):
    """Columns [start, start + width) of a float kernel or a frozen weight (values and scales)."""
    cut = lambda a: lax.slice_in_dim(a, start, start + width, axis=a.ndim - 1)  # noqa: E731
    if isinstance(w, QuantizedWeight):
        return jax.tree.map(cut, w)
    return cut(w)


def grouped_dot(
    x: jax.Array,
    w: jax.Array | QuantizedWeight,
    group_sizes: jax.Array,
    spec: QuantSpec | None,
    kind: str = "experts",
) -> jax.Array:
    """x [M, K] (rows sorted by expert) against w [E, K, N]; ``spec=None`` is ``lax.ragged_dot``."""
    if spec is None:
        wf = _float_weight(w)
        ct = jnp.result_type(x.dtype, wf.dtype)
        return lax.ragged_dot(x.astype(ct), wf.astype(ct), group_sizes, precision=lax.Precision.HIGHEST)
    fmt, group_size = spec.format_of(kind)
    if isinstance(w, QuantizedWeight):
        _check_frozen(w, fmt, kind)
        return grouped_matmul(x, w, group_sizes)
    return grouped_matmul_ste(x, w, group_sizes, fmt, group_size, quantizer=weight_quantizer(fmt))
