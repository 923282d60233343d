"""Quantized weight formats: the one data layout every backend (CPU, TPU, GPU) reads.

Formats
  bf16   unquantized weights, same invariant kernels (values in the weight dtype, no scales).
  w8a8   int8 weights, one f32 scale per output channel; activations quantized per token
         (abs-max, int8) on the fly; int32 accumulation; y = (acc * s_x) * s_w.
  w4a16  int4 weights, f32 scales per group of ``group_size`` rows of K (per channel when
         group_size == K); activations stay bf16/f32; f32 accumulation group by group in
         ascending K order, each group's partial product scaled inside the K loop.
  w4a8   int4 weights (grouped as w4a16) x per-token int8 activations; int32 partial per group.
  fp8    FP8-W8A8: float8 e4m3 weights, one f32 scale per output channel; activations quantized
         per token (abs-max, e4m3) on the fly; f32 accumulation in a fixed K order;
         y = (acc * s_x) * s_w. An e4m3 x e4m3 product (4-bit significands) is exact in f32 and
         both operands widen exactly to bf16, so only the order of the sum needs fixing.

Quantization is symmetric: q = clip(round_half_even(w / s), -qmax, qmax), s = absmax / qmax
(s = 1 where a column/group is all zeros), qmax = 127 (int8) or 7 (int4). fp8 is the same with
qmax = 448 (e4m3's largest finite value) and the rounding of the cast to e4m3 (to nearest, ties
to even, on e4m3's grid) in place of rounding to an integer.

int4 packing ("group halves"): two int4 values per int8 byte, packed WITHIN each quantization
group of G rows of K: packed row g*G/2 + j holds q[g*G + j] in its low nibble and
q[g*G + G/2 + j] in its high nibble (j < G/2). A kernel walking K group by group loads G/2
packed rows, unpacks them with two shifts (low = (p << 4) >> 4, high = p >> 4, arithmetic) into
two [G/2, N] halves and needs no interleaving.

Weights are stored [K, N] (input features first), as Flax kernels are. A leading expert axis
[E, K, N] is allowed for the grouped MoE matmul.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

FORMATS = ("bf16", "w8a8", "w4a16", "w4a8", "fp8")
WEIGHT_BITS = {"bf16": None, "w8a8": 8, "w4a16": 4, "w4a8": 4, "fp8": 8}
ACT_BITS = {"bf16": None, "w8a8": 8, "w4a16": None, "w4a8": 8, "fp8": 8}
# the stored weight values' dtype, and (a8 formats) the quantized activations'
VALUE_DTYPE = {"w8a8": jnp.int8, "w4a16": jnp.int8, "w4a8": jnp.int8, "fp8": jnp.float8_e4m3fn}
ACT_DTYPE = {"w8a8": jnp.int8, "w4a8": jnp.int8, "fp8": jnp.float8_e4m3fn}
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value: fp8's quantization bound
DEFAULT_GROUP_SIZE = 128
# the smallest group size chosen by default: the GPU kernel's least (two 16-row Triton tiles)
MIN_DEFAULT_GROUP_SIZE = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """Weights of one projection in one format (a pytree: arrays are leaves, the rest static).

    values: bf16: the weight [.., K, N]; w8a8: int8 [.., K, N]; fp8: float8_e4m3fn [.., K, N];
            4-bit: packed int8 [.., K//2, N].
    scales: f32 [.., K // group_size, N], or None for bf16.
    """

    values: jax.Array
    scales: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def k(self) -> int:
        rows = self.values.shape[-2]
        return rows * 2 if WEIGHT_BITS[self.fmt] == 4 else rows

    @property
    def n(self) -> int:
        return self.values.shape[-1]


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {FORMATS}")


def resolve_group_size(fmt: str, k: int, group_size: int | None) -> int:
    """Group size along K for ``fmt``: per channel (K) for 8-bit, ``group_size`` for 4-bit. The
    4-bit default (``group_size`` None) is 128 where it divides K, all of K up to 128, else the
    largest power of two from 32 to 128 that divides K (K=192: 64), so a model whose hidden size is
    not a multiple of 128 still runs (every path resolves the same group size, the bits are kept).
    Raises on a K the format cannot hold, in one line saying what to set."""
    check_format(fmt)
    bits = WEIGHT_BITS[fmt]
    if bits is None:
        return k
    if bits == 8:
        if group_size not in (None, k):
            raise ValueError(
                f"{fmt} uses one scale per output channel; got group_size={group_size} for K={k}"
            )
        return k
    if k % 2:
        raise ValueError(f"{fmt} packs two int4 values per byte along K; K={k} is odd")
    g = default_group_size(fmt, k) if group_size is None else group_size
    if g <= 0 or g % 2 or k % g:
        raise ValueError(
            f"{fmt}: K={k} is not a multiple of the group size {g}: set an even group size that "
            f"divides {k}, or a per-channel format (w8a8, fp8)"
        )
    return g


def default_group_size(fmt: str, k: int) -> int:
    """The 4-bit group size when none is named (see :func:`resolve_group_size`); one line on a K
    that no power of two from 32 up divides (an explicit even divisor of K still runs)."""
    if k <= DEFAULT_GROUP_SIZE:
        return k
    g = DEFAULT_GROUP_SIZE
    while g >= MIN_DEFAULT_GROUP_SIZE:
        if k % g == 0:
            return g
        g //= 2
    raise ValueError(
        f"{fmt}: no power-of-two group size from {MIN_DEFAULT_GROUP_SIZE} to {DEFAULT_GROUP_SIZE} divides "
        f"K={k}: set an even group size that divides {k}, or a per-channel format (w8a8, fp8)"
    )


def _to_e4m3(v: jax.Array) -> jax.Array:
    """f32 values within [-448, 448] (after clipping) on e4m3's grid: XLA's convert rounds to
    nearest, ties to even."""
    return jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def _symmetric_quantize(w: jax.Array, fmt: str, group_size: int) -> tuple[jax.Array, jax.Array]:
    fp8 = VALUE_DTYPE[fmt] == jnp.float8_e4m3fn
    bits = WEIGHT_BITS[fmt]
    assert bits is not None, f"{fmt} has no quantized weights"
    qmax = E4M3_MAX if fp8 else 2 ** (bits - 1) - 1
    *lead, k, n = w.shape
    groups = w.astype(jnp.float32).reshape(*lead, k // group_size, group_size, n)
    absmax = jnp.max(jnp.abs(groups), axis=-2)
    scales = jnp.where(absmax > 0, absmax / qmax, 1.0).astype(jnp.float32)
    v = groups / scales[..., None, :]
    q = _to_e4m3(v) if fp8 else jnp.clip(jnp.round(v), -qmax, qmax).astype(jnp.int8)
    return q.reshape(*lead, k, n), scales


def pack_int4(q: jax.Array, group_size: int) -> jax.Array:
    """Pack int4 values (int8 in [-8, 7], shape [.., K, N]) two per byte, group halves layout."""
    *lead, k, n = q.shape
    halves = q.reshape(*lead, k // group_size, 2, group_size // 2, n)
    low, high = halves[..., 0, :, :], halves[..., 1, :, :]
    packed = (low & 0xF) | (high << 4)
    return packed.astype(jnp.int8).reshape(*lead, k // 2, n)


def unpack_int4(packed: jax.Array, group_size: int) -> jax.Array:
    """Inverse of :func:`pack_int4`: int8 [.., K//2, N] -> int8 values [.., K, N]."""
    *lead, k2, n = packed.shape
    p = packed.astype(jnp.int8).reshape(*lead, (2 * k2) // group_size, group_size // 2, n)
    low = jnp.left_shift(p, 4) >> 4
    high = p >> 4
    return jnp.stack([low, high], axis=-3).reshape(*lead, 2 * k2, n)


Quantizer = Callable[[jax.Array, str, int | None], QuantizedWeight]
"""What the straight-through estimators call to produce a weight format (default :func:`quantize`;
any function yielding the same integers and scales will do)."""


def quantize(w: jax.Array, fmt: str, group_size: int | None = None) -> QuantizedWeight:
    """Quantize a [.., K, N] weight into ``fmt``. Pure and deterministic (usable under jit)."""
    k = w.shape[-2]
    g = resolve_group_size(fmt, k, group_size)
    bits = WEIGHT_BITS[fmt]
    if bits is None:
        return QuantizedWeight(values=w, scales=None, fmt=fmt, group_size=g)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"quantize expects floating-point weights, got {w.dtype}")
    q, scales = _symmetric_quantize(w, fmt, g)
    values = pack_int4(q, g) if bits == 4 else q
    return QuantizedWeight(values=values, scales=scales, fmt=fmt, group_size=g)


def int_values(w: QuantizedWeight) -> jax.Array:
    """The quantized weight values [.., K, N] unpacked: int8 (int4 range for 4-bit formats), or
    float8_e4m3fn for fp8."""
    if WEIGHT_BITS[w.fmt] == 4:
        return unpack_int4(w.values, w.group_size)
    return w.values


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The weight the quantized format represents, [.., K, N] in ``dtype`` (STE backward uses it)."""
    if w.scales is None:
        return w.values.astype(dtype)
    q = int_values(w).astype(jnp.float32)
    *lead, k, n = q.shape
    g = w.group_size
    deq = q.reshape(*lead, k // g, g, n) * w.scales[..., None, :]
    return deq.reshape(*lead, k, n).astype(dtype)


def quantize_activations(x: jax.Array, fmt: str = "w8a8") -> tuple[jax.Array, jax.Array]:
    """Per-token (row) abs-max quantization of [.., K] activations to the a8 format ``fmt``'s
    8-bit type -> (int8 or float8_e4m3fn, f32 [.., 1]). Row-wise: no row sees another."""
    fp8 = ACT_DTYPE[fmt] == jnp.float8_e4m3fn
    qmax = E4M3_MAX if fp8 else 127.0
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / qmax, 1.0)
    v = xf / scale
    q = _to_e4m3(v) if fp8 else jnp.clip(jnp.round(v), -127, 127).astype(jnp.int8)
    return q, scale
