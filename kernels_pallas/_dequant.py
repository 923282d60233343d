"""int4 -> float in registers: the two halves of a packed ("group halves") int4 tile, two ways that
give the same values, so a kernel may pick either per weight shape without changing a bit.

  shift  two arithmetic shifts per byte (low = (p << 4) >> 4, high = p >> 4), then an int -> float
         convert per element (on a GPU: cvt instructions, a quarter of the integer-op rate).
  magic  no int -> float convert: the nibble, made offset-binary (u = nibble ^ 8 = v + 8, 0..15), is
         or-ed into the mantissa of a float whose exponent makes the mantissa's units ones
         (bf16 0x4300 = 128.0, f16 0x6400 = 1024.0, f32 0x4B000000 = 2^23); the bits, reinterpreted,
         are magic + u, and one subtraction of (magic + 8) gives v. Every step is exact (the float
         holds magic + 15 exactly), so the values are the shift path's, bit for bit. One AND and one
         XOR (the XOR also sets the exponent: (q & 0xF) ^ (magic_bits | 8)), a free bitcast, one
         float subtraction; the high half adds one shift. The trick of Marlin / FasterTransformer's
         int4 -> half converters, on one element a lane (Triton lowers the 16-bit ops packed).

Integer compute dtypes (w4a8: int8 x int8 dots) keep the shifts: their unpack has no convert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

DEQUANT = ("shift", "magic")

# compute dtype -> (integer type of its width, the magic float's bits with 8 or-ed in, magic + 8)
_MAGIC: dict[jnp.dtype, tuple[jnp.dtype, int, float]] = {
    jnp.dtype(jnp.bfloat16): (jnp.dtype(jnp.int16), 0x4300 | 8, 136.0),
    jnp.dtype(jnp.float16): (jnp.dtype(jnp.int16), 0x6400 | 8, 1032.0),
    jnp.dtype(jnp.float32): (jnp.dtype(jnp.int32), 0x4B000000 | 8, float(2**23 + 8)),
}


def check_dequant(method: str) -> None:
    if method not in DEQUANT:
        raise ValueError(f"dequant must be one of {DEQUANT}, got {method!r}")


def int4_halves(p: jax.Array, cdt, method: str = "shift") -> tuple[jax.Array, jax.Array]:
    """(low, high) nibbles of the packed int8 tile ``p`` as signed values in ``cdt``, by ``method``
    (see the module doc; "magic" falls back to the shifts for integer ``cdt``)."""
    cdt = jnp.dtype(cdt)
    if method == "shift" or cdt not in _MAGIC:
        return (jnp.left_shift(p, 4) >> 4).astype(cdt), (p >> 4).astype(cdt)
    check_dequant(method)
    itype, bits, bias = _MAGIC[cdt]
    q = p.astype(itype)  # sign-extended; only the low byte is read below
    lo = lax.bitcast_convert_type((q & 0xF) ^ bits, cdt) - jnp.asarray(bias, cdt)
    hi = lax.bitcast_convert_type(((q >> 4) & 0xF) ^ bits, cdt) - jnp.asarray(bias, cdt)
    return lo, hi
