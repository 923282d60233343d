"""Block sizes and padding, shared by every operation and backend.

The rule behind every size here: it is a function of the row width, the weight shape, the format or
the head size, never of the number of rows M. A row's bits depend on the tile shape and reduction
order the program was compiled with; if block sizes followed M, a decode step (few rows) and a
training step (many rows) would compile different programs and the same token would get different
log-probs. M only decides how many row blocks run (rows are padded to a block multiple).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One accelerator matmul's tiling: rows per block, output columns per block, K per loop step,
    and (GPU only) Triton's warps per program, software-pipelining depth, and three decode knobs:

    split_k  K split into this many contiguous ranges, each its own program, the partial results
             summed afterwards in ascending split order (fixed by (fmt, K, N), so rows stay invariant);
             it multiplies the programs a decode step launches (N / block_n is often < 132 SMs).
    swap_ab  compute (W^T x^T)^T: the weight tile is the MMA's M side (>= 64, Hopper wgmma-sized) and
             the 16 activation rows its N side.
    int_dot  "int8": int8 x int8 -> int32 MMA; "bf16": the same integers through a bf16 MMA with f32
             accumulation, exact while a step's |partial| < 2^24 (w8a8 block_k <= 1024), then int32.
             Bitwise the same result either way; only speed differs.
    dequant  4-bit weights with float compute: "shift" (shifts and int -> float converts) or "magic"
             (the nibble or-ed into a float's mantissa, no convert: ``kernels_pallas._dequant``).
             The same values either way; only speed differs.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    swap_ab: bool = False
    int_dot: str = "int8"
    dequant: str = "shift"

    def override(self, allowed: tuple[str, ...] | None = None, /, **knobs: int | bool | str | None) -> Blocks:
        """These blocks with the caller's non-None knobs (only the ``allowed`` fields, if given)."""
        allowed = allowed or tuple(f.name for f in dataclasses.fields(self))
        unknown = sorted(set(knobs) - set(allowed))
        if unknown:
            raise TypeError(f"this kernel has no tiling knob {unknown[0]!r}; it takes {list(allowed)}")
        changes: dict[str, Any] = {k: v for k, v in knobs.items() if v is not None}  # one type per field
        return dataclasses.replace(self, **changes)


def pow2_divisor(n: int, cap: int, floor: int = 1) -> int | None:
    """The largest power of two <= ``cap`` that divides ``n``, or None if it is below ``floor``.
    (``pow2_divisor(v, v) == v`` exactly when v is a power of two.)"""
    b = 1 << (max(cap, 1).bit_length() - 1)
    while b >= floor:
        if n % b == 0:
            return b
        b //= 2
    return None


def is_pow2(v: int) -> bool:
    return v >= 1 and pow2_divisor(v, v) == v


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def rows_per_block(row_size: int, budget: int = 1 << 16, lo: int = 8, hi: int = 64) -> int:
    """CPU rows per block: the largest power of two in [lo, hi] whose block of ``row_size``-wide
    rows stays within ``budget`` elements (``lo`` if none does). A function of the row size only."""
    rows = hi
    while rows > lo and rows * row_size > budget:
        rows //= 2
    return rows


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fit_block(size: int, want: int, floor: int) -> tuple[int, int]:
    """(block, padded size): the largest power of two <= want dividing ``size`` (>= floor), or
    ``want`` with ``size`` padded up to a multiple of it."""
    b = pow2_divisor(size, want, floor)
    if b is not None:
        return b, size
    return want, round_up(size, want)


def pad_axis(a: jax.Array, axis: int, size: int, value: float = 0) -> jax.Array:
    """Pad ``axis`` of ``a`` with ``value`` up to ``size`` (no copy when already that size)."""
    extra = size - a.shape[axis]
    if extra == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths, constant_values=value)


def pad_to_block(a: jax.Array, block: int, axis: int = 0, value: float = 0) -> jax.Array:
    """``axis`` padded up to a multiple of ``block`` (at least one block)."""
    return pad_axis(a, axis, round_up(max(a.shape[axis], 1), block), value)


def tiled(configure: Callable[..., Hashable]) -> Callable[[Callable], Callable]:
    """Make ``kernel(x, w, *args, out_dtype, interpret, tiling)`` an entry point taking the caller's
    tiling knobs: ``configure(w, **knobs)`` resolves them, outside the trace, to the hashable tiling
    the jitted kernel compiles for (``out_dtype``, ``interpret`` and ``tiling`` static)."""

    def wrap(kernel: Callable) -> Callable:
        jitted = jax.jit(kernel, static_argnames=("out_dtype", "interpret", "tiling"))

        def entry(x, w, *args, out_dtype, interpret: bool = False, **knobs):
            return jitted(x, w, *args, out_dtype=out_dtype, interpret=interpret, tiling=configure(w, **knobs))

        entry.__name__, entry.__doc__ = kernel.__name__, kernel.__doc__
        return entry

    return wrap
