"""Block sizes for the accelerator kernels, chosen from (K, N) and the format only -- never from M.

Why never M: a row's bits depend on the tile shape and the K order the kernel was compiled with.
If the block sizes followed the number of rows, a decode step (few rows) and a training step (many
rows) would compile different programs and the same token would get different log-probs. M only
decides how many row blocks are launched (rows are padded to ``block_m``).

Also here: the operand checks and padding helpers both backends share.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas import formats


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One kernel's tiling: rows per block, output columns per block, K per loop step, and (GPU only)
    Triton's warps per program and software-pipelining depth."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def _pow2_divisor(n: int, cap: int, floor: int) -> int | None:
    """Largest power of two <= cap that divides n, if it is >= floor."""
    b = 1 << (max(cap, 1).bit_length() - 1)
    while b >= floor:
        if n % b == 0:
            return b
        b //= 2
    return None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def gpu_blocks(fmt: str, k: int, n: int) -> Blocks:
    """Triton tiles (all powers of two). Decode is bound by the weight bytes, so columns are split
    finely enough to give the H200's 132 SMs work at M <= 16 without split-K (which would make the
    reduction order depend on scheduling). block_m = 16 is the smallest Triton dot tile; it is
    fixed for every M (training pays for it in re-reads of the weights, which stay in L2).
    Starting points, to be tuned on the H200 (issue 10)."""
    formats.check_format(fmt)
    block_n = 64 if n >= 64 * 64 else 32
    if formats.WEIGHT_BITS[fmt] == 4:
        block_k = 256  # K elements per step; capped by the group size in the kernel
    elif formats.WEIGHT_BITS[fmt] == 8:
        block_k = 256
    else:
        block_k = 128
    return Blocks(block_m=16, block_n=block_n, block_k=block_k, num_warps=4, num_stages=3)


def tpu_blocks(fmt: str, k: int, n: int) -> Blocks:
    """Mosaic tiles: rows a multiple of the (8|16|32, 128) VMEM tiling for every operand dtype (32
    rows cover int8's 32-row sublane packing), columns a multiple of the 128 lanes, K steps of a
    whole number of 128-lane tiles. Lowering- and interpreter-checked only (no TPU here)."""
    formats.check_format(fmt)
    block_n = 256 if n >= 256 else 128
    block_k = 512 if formats.WEIGHT_BITS[fmt] == 8 else 256
    return Blocks(block_m=32, block_n=block_n, block_k=block_k)


def resolve(default: Blocks, block_m: int | None, block_n: int | None, block_k: int | None) -> Blocks:
    """The table's blocks with the caller's overrides."""
    return dataclasses.replace(
        default,
        block_m=block_m or default.block_m,
        block_n=block_n or default.block_n,
        block_k=block_k or default.block_k,
    )


def fit_block(size: int, want: int, floor: int) -> tuple[int, int]:
    """(block, padded size): the largest power of two <= want dividing ``size`` (>= floor), or
    ``want`` with ``size`` padded up to a multiple of it."""
    b = _pow2_divisor(size, want, floor)
    if b is not None:
        return b, size
    return want, round_up(size, want)


def check_operands(x: jax.Array, w: formats.QuantizedWeight, *, experts: bool = False) -> None:
    """Clear errors for what no kernel can compute."""
    if not isinstance(w, formats.QuantizedWeight):
        raise TypeError(f"w must be a kernels_pallas.formats.QuantizedWeight, got {type(w).__name__}")
    formats.check_format(w.fmt)
    want_ndim = 3 if experts else 2
    if w.values.ndim != want_ndim:
        want = "[E, K, N]" if experts else "[K, N]"
        raise ValueError(f"w.values must be {want} for this kernel, got shape {w.values.shape}")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if x.shape[1] != w.k:
        raise ValueError(f"x has K={x.shape[1]} but the {w.fmt} weight has K={w.k}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be floating point (activations), got {x.dtype}")
    if formats.WEIGHT_BITS[w.fmt] is None:
        if w.scales is not None:
            raise ValueError("bf16 weights carry no scales")
        if not jnp.issubdtype(w.values.dtype, jnp.floating):
            raise TypeError(f"bf16-format weights must be floating point, got {w.values.dtype}")
        return
    if w.values.dtype != jnp.int8:
        raise TypeError(f"{w.fmt} weights must be stored as int8, got {w.values.dtype}")
    if w.scales is None:
        raise ValueError(f"{w.fmt} weights need scales")
    lead = w.values.shape[:-2]
    want = (*lead, w.k // w.group_size, w.n)
    if w.k % w.group_size or tuple(w.scales.shape) != want:
        raise ValueError(
            f"{w.fmt}: scales must be {want} for group size {w.group_size}, got {w.scales.shape}"
        )


def pad_axis(a: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad ``axis`` of ``a`` up to ``size`` (no copy when already that size)."""
    extra = size - a.shape[axis]
    if extra == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def group_tiles(
    group_sizes: jax.Array, m: int, block_m: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Static-shape work list for a grouped (MoE) matmul over rows sorted by expert.

    Each tile is one (expert, row block) pair whose rows overlap; a row block that straddles an
    expert boundary appears once per expert, and each visit writes only its expert's rows. There
    are at most ``m_pad // block_m + E - 1`` such tiles; the rest are empty (lo == hi == 0) and walk
    the row blocks past the last expert row, so that row blocks come in non-decreasing order and
    every block is visited (TPU keeps an output block resident across consecutive visits and zeroes
    it on the first). Returns int32 [T] arrays (expert, row_block, lo, hi): rows [lo, hi) are the
    tile's to write. Rows past ``sum(group_sizes)`` belong to no expert (their output is zero)."""
    num_experts = group_sizes.shape[0]
    m_pad = round_up(max(m, 1), block_m)
    num_tiles = m_pad // block_m + num_experts - 1
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first = starts // block_m
    last = (ends - 1) // block_m
    ntiles = jnp.where(ends > starts, last - first + 1, 0)
    cum = jnp.cumsum(ntiles)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    valid = t < cum[-1]
    e = jnp.minimum(jnp.searchsorted(cum, t, side="right").astype(jnp.int32), num_experts - 1)
    row_block = first[e] + t - (cum[e] - ntiles[e])
    lo = jnp.where(valid, jnp.maximum(starts[e], row_block * block_m), 0)
    hi = jnp.where(valid, jnp.minimum(ends[e], (row_block + 1) * block_m), 0)
    covered = jnp.where(ends[-1] > 0, (ends[-1] - 1) // block_m, -1)
    spare = jnp.minimum(covered + 1 + t - cum[-1], m_pad // block_m - 1)
    row_block = jnp.where(valid, row_block, spare)
    return e, row_block.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32)
