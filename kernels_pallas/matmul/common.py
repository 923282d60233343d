"""What the GPU and TPU matmul kernels (dense and grouped) share: the operands as a kernel reads
them, the dot operand dtype, and the scales applied after the K loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas._tiling import pad_axis, round_up
from kernels_pallas.formats import ACT_BITS, ACT_DTYPE, WEIGHT_BITS, QuantizedWeight, quantize_activations


def compute_dtype(x_dtype, w: QuantizedWeight):
    """The dtype both dot operands are cast to: int8 for the integer a8 formats, bf16 for fp8
    (e4m3 widens to bf16 exactly, and bf16 x bf16 with f32 accumulation is a dot every MXU and
    tensor core has: each e4m3 product exact, the sum in the kernel's fixed K order)."""
    if ACT_BITS[w.fmt] == 8:
        return jnp.int8 if ACT_DTYPE[w.fmt] == jnp.int8 else jnp.bfloat16
    if WEIGHT_BITS[w.fmt] is None:
        return jnp.promote_types(x_dtype, w.values.dtype)
    return jnp.dtype(x_dtype)


def part_dtype(fmt: str):
    """What one dot (a K step, or a 4-bit group) yields: int32 for integer activations, else f32."""
    return jnp.int32 if ACT_BITS[fmt] == 8 and ACT_DTYPE[fmt] == jnp.int8 else jnp.float32


def acc_dtype(fmt: str):
    """What a K loop accumulates in: int32 for w8a8 (exact), f32 otherwise."""
    return jnp.int32 if fmt == "w8a8" else jnp.float32


def channel_scaled(fmt: str) -> bool:
    """Whether the weight scales (one per output channel) apply after the K loop (w8a8, fp8)."""
    return WEIGHT_BITS[fmt] == 8


def finish(acc: jax.Array, fmt: str, s_w: jax.Array | None, s_x: jax.Array | None) -> jax.Array:
    """Apply the scales that sit outside the K loop: w8a8 and fp8 (acc * s_x) * s_w, w4a8 acc * s_x."""
    if channel_scaled(fmt):
        assert s_w is not None and s_x is not None, f"{fmt} has weight and activation scales"
        return (acc.astype(jnp.float32) * s_x) * s_w
    if fmt == "w4a8":
        assert s_x is not None, "w4a8 has activation scales"
        return acc * s_x
    return acc


def kernel_refs(refs, with_scales: bool, with_sx: bool) -> tuple:
    """(x, w, weight scales or None, activation scales or None, the rest) of a matmul kernel's
    refs, which come in that order with the optional ones left out."""
    x_ref, w_ref, *rest = refs
    s_ref = rest.pop(0) if with_scales else None
    sx_ref = rest.pop(0) if with_sx else None
    return x_ref, w_ref, s_ref, sx_ref, rest


@dataclasses.dataclass(frozen=True)
class Operands:
    """x (int8 / e4m3 for the a8 formats) [M_pad, K_pad], its per-row f32 scales [M_pad, 1] (a8 only),
    the weight values (N padded; K padded unless int4-packed, whose K is whole groups) and the
    weight scales (N padded)."""

    x: jax.Array
    sx: jax.Array | None
    w: jax.Array
    scales: jax.Array | None
    m_pad: int


def operands(x: jax.Array, w: QuantizedWeight, *, block_m: int, k_pad: int, n_pad: int) -> Operands:
    """The padded operands of ``x [M, K] @ w [(E,) K, N]``: activations quantized per token for the
    a8 formats (row-wise, outside the kernel: abs-max and one division per element, so no row sees
    another), rows padded to ``block_m``, K to ``k_pad``, N to ``n_pad``."""
    m_pad = round_up(max(x.shape[0], 1), block_m)
    xk, sx = quantize_activations(x, w.fmt) if ACT_BITS[w.fmt] == 8 else (x, None)
    xk = pad_axis(pad_axis(xk, 0, m_pad), 1, k_pad)
    sx = None if sx is None else pad_axis(sx, 0, m_pad)
    k_axis = w.values.ndim - 2
    wv = w.values if WEIGHT_BITS[w.fmt] == 4 else pad_axis(w.values, k_axis, k_pad)
    wv = pad_axis(wv, k_axis + 1, n_pad)
    scales = None if w.scales is None else pad_axis(w.scales, k_axis + 1, n_pad)
    return Operands(xk, sx, wv, scales, m_pad)
