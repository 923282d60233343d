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
    Triton's warps per program, software-pipelining depth, and three decode knobs:

    split_k  K split into this many contiguous ranges, each its own program, the partial results
             summed afterwards in ascending split order (fixed by (fmt, K, N), so rows stay invariant);
             it multiplies the programs a decode step launches (N / block_n is often < 132 SMs).
    swap_ab  compute (W^T x^T)^T: the weight tile is the MMA's M side (>= 64, Hopper wgmma-sized) and
             the 16 activation rows its N side.
    int_dot  "int8": int8 x int8 -> int32 MMA; "bf16": the same integers through a bf16 MMA with f32
             accumulation, exact while a step's |partial| < 2^24 (w8a8 block_k <= 1024), then int32.
             Bitwise the same result either way; only speed differs.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    swap_ab: bool = False
    int_dot: str = "int8"


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


GPU_SMS = 132  # H200 / H100 SXM multiprocessors: the decode grid should cover them


def gpu_blocks(fmt: str, k: int, n: int) -> Blocks:
    """Triton tiles (all powers of two) for one (fmt, K, N): the H200-tuned entry of
    ``kernels_pallas.gpu.tuned.TUNED`` if there is one, else a heuristic.

    Decode is bound by the weight bytes, so the heuristic aims for >= GPU_SMS programs at M <= 16:
    128-column blocks (64 for bf16) and a fixed split-K of up to 4 when N / block_n alone is too
    few. block_m = 16 is the smallest Triton dot tile; it is fixed for every M (training pays for it
    in re-reads of the weights, which stay in L2)."""
    formats.check_format(fmt)
    from kernels_pallas.gpu.tuned import TUNED  # lazy: only the GPU path needs the table

    bits = formats.WEIGHT_BITS[fmt]
    if bits == 4:
        base = Blocks(block_m=16, block_n=128, block_k=256, num_warps=4, num_stages=4)
    elif bits == 8:
        base = Blocks(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4)
    else:
        base = Blocks(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    tuned = TUNED.get((fmt, k, n))
    if tuned is not None:
        return dataclasses.replace(base, **tuned)
    n_blocks = -(-n // base.block_n)
    split = 1
    while n_blocks * split < GPU_SMS and split < 4 and k % (2 * split * base.block_k) == 0:
        split *= 2
    return dataclasses.replace(base, split_k=split)


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
