"""Batch-invariant quantized matmul for GPUs: Pallas on the Triton backend.

Every format (see ``kernels_pallas.formats``) runs through one kernel:

  bf16   float dot, f32 accumulation over K tiles in ascending order.
  w8a8   per-token int8 activations (``formats.quantize_activations``, row-wise, outside the kernel:
         abs-max and one division per element are exact/elementwise, so no row sees another),
         int8 x int8 -> int32 (exact, order-free), y = (acc * s_x) * s_w.
  w4a16  int4 unpacked in registers (two arithmetic shifts per byte, "group halves" layout), dot
         in the activation dtype with f32 accumulation, each group's partial product scaled
         inside the K loop (acc += partial * s_g), groups in ascending order.
  w4a8   the same unpacking, int8 activations, int32 partial per group.

Why the rows are invariant: the tiling (``block_sizes.Blocks``: tile shape, warps, stages, split-K,
operand order) comes from (fmt, K, N) only (``block_sizes.gpu_blocks``), rows are padded to block_m,
each program's K loop runs in a fixed ascending order, and a split-K's partials are summed in
ascending split order by one elementwise XLA fusion (int32 for w8a8: exact). M only changes how
many identical programs are launched, so row r's bits do not depend on M or on its neighbours.

Why it is fast at decode (M <= 64, bound by weight bytes): one flat K loop per program (Triton
software-pipelines only the innermost loop; a 4-bit step covers whole groups, unrolled), and enough
programs (column blocks x split-K) to keep every SM streaming weights.
f32 activations use IEEE dots (precision=HIGHEST; Triton would otherwise use TF32).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import block_sizes, formats
from kernels_pallas.gpu import compiler_params

_MIN_TILE = 16  # smallest Triton dot dimension
_BF16_EXACT_INT = 2**24  # f32 holds every integer below this exactly


@dataclasses.dataclass(frozen=True)
class Tiling:
    """What the kernels need, resolved from ``Blocks`` and the weight (never from M)."""

    block_m: int
    block_n: int
    n_pad: int
    block_k: int  # K elements per loop step (4-bit: whole groups per step, or a chunk of one)
    k_pad: int
    split_k: int
    swap_ab: bool
    int_dot: str
    num_warps: int
    num_stages: int


def _is_pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def _pow2_dividing(total: int, cap: int) -> int:
    """Largest power of two <= cap that divides total (>= 1)."""
    b = 1 << (max(cap, 1).bit_length() - 1)
    while total % b:
        b //= 2
    return b


def plan(w: formats.QuantizedWeight, blocks: block_sizes.Blocks) -> Tiling:
    """The tiling the kernel runs for this weight: checks powers of two, fits N and K blocks, and
    lowers split_k / block_k to the largest power of two that tiles K (a function of the weight's
    shape and group size only). Raises on what cannot be tiled."""
    k, n = w.k, w.n
    for name, v in (("block_m", blocks.block_m), ("block_n", blocks.block_n), ("block_k", blocks.block_k)):
        if v < _MIN_TILE or not _is_pow2(v):
            raise ValueError(f"Triton needs power-of-two tiles >= {_MIN_TILE}; got {name}={v}")
    if not _is_pow2(blocks.split_k):
        raise ValueError(f"split_k must be a power of two, got {blocks.split_k}")
    if blocks.int_dot not in ("int8", "bf16"):
        raise ValueError(f"int_dot must be 'int8' or 'bf16', got {blocks.int_dot!r}")
    block_n, n_pad = block_sizes.fit_block(n, blocks.block_n, _MIN_TILE)
    if formats.WEIGHT_BITS[w.fmt] == 4:
        g = w.group_size
        if g // 2 < _MIN_TILE or not _is_pow2(g):
            raise ValueError(
                f"the GPU kernel needs a power-of-two int4 group size >= {2 * _MIN_TILE}; got {g}"
            )
        if blocks.block_k < 2 * _MIN_TILE:
            raise ValueError(f"4-bit steps unpack block_k // 2 packed rows: block_k >= {2 * _MIN_TILE}")
        split = _pow2_dividing(k // g, blocks.split_k)
        local_groups = k // g // split
        # whole groups per step when block_k >= g, else a chunk of block_k // 2 packed rows of one group
        block_k = blocks.block_k
        if block_k >= g:
            block_k = g * _pow2_dividing(local_groups, block_k // g)
        k_pad = k
    else:
        block_k, k_pad = block_sizes.fit_block(k, blocks.block_k, 2 * _MIN_TILE)
        split = _pow2_dividing(k_pad // block_k, blocks.split_k)
    int_dot = blocks.int_dot
    if w.fmt == "w8a8" and block_k * 127 * 127 >= _BF16_EXACT_INT:
        int_dot = "int8"  # a bf16 MMA would no longer be exact
    return Tiling(
        blocks.block_m, block_n, n_pad, block_k, k_pad, split, blocks.swap_ab, int_dot,
        blocks.num_warps, blocks.num_stages,
    )  # fmt: skip


def configure(w: formats.QuantizedWeight, **overrides) -> Tiling:
    """``block_sizes.gpu_blocks(fmt, K, N)`` with the caller's non-None overrides, planned."""
    blocks = block_sizes.gpu_blocks(w.fmt, w.k, w.n)
    blocks = dataclasses.replace(blocks, **{k: v for k, v in overrides.items() if v is not None})
    return plan(w, blocks)


def compute_dtype(x_dtype, w: formats.QuantizedWeight):
    """The dtype both dot operands are cast to."""
    if formats.ACT_BITS[w.fmt] == 8:
        return jnp.int8
    if formats.WEIGHT_BITS[w.fmt] is None:
        return jnp.promote_types(x_dtype, w.values.dtype)
    return jnp.dtype(x_dtype)


def _dot(a: jax.Array, b: jax.Array, acc_dtype, swap: bool, int_dot: str) -> jax.Array:
    """a [bm, kk] @ b [kk, bn] -> [bm, bn], or its transpose [bn, bm] when ``swap`` (b^T a^T: the
    weight tile becomes the MMA's M side). int8 operands with ``int_dot == "bf16"`` go through a
    bf16 MMA (integers exact in bf16, partial exact in f32) and come back as int32."""
    if acc_dtype == jnp.int32 and int_dot == "bf16":
        return _dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), jnp.float32, swap, "").astype(jnp.int32)
    dims = (((0,), (1,)), ((), ())) if swap else (((1,), (0,)), ((), ()))
    lhs, rhs = (b, a) if swap else (a, b)
    return lax.dot_general(lhs, rhs, dims, preferred_element_type=acc_dtype, precision=lax.Precision.HIGHEST)


def accumulate(
    load_x: Callable[[jax.Array | int, int], jax.Array],
    load_w: Callable[[jax.Array | int, int], jax.Array],
    load_s: Callable[[jax.Array | int], jax.Array] | None,
    *,
    fmt: str,
    k: int,
    group_size: int,
    tiling: Tiling,
    cdt,
) -> jax.Array:
    """One output tile's K reduction over this program's ``k`` columns, ascending K. ``load_x(col,
    width)`` reads activation columns, ``load_w(row, rows)`` stored weight rows (packed rows for
    4-bit), ``load_s(g)`` the [1, block_n] scales of local group g. Returns f32 (float formats,
    4-bit) or int32 (w8a8) [block_m, block_n]."""
    bm, bn, bk, swap = tiling.block_m, tiling.block_n, tiling.block_k, tiling.swap_ab
    acc_shape = (bn, bm) if swap else (bm, bn)
    part_dtype = jnp.int32 if formats.ACT_BITS[fmt] == 8 else jnp.float32
    dot = functools.partial(_dot, acc_dtype=part_dtype, swap=swap, int_dot=tiling.int_dot)

    if formats.WEIGHT_BITS[fmt] != 4:

        def body(i, acc):
            xs = load_x(i * bk, bk).astype(cdt)
            ws = load_w(i * bk, bk).astype(cdt)
            return acc + dot(xs, ws)

        acc = lax.fori_loop(0, k // bk, body, jnp.zeros(acc_shape, part_dtype))
        return acc.T if swap else acc

    half = group_size // 2

    def unpacked_part(prow: jax.Array | int, col: jax.Array | int, rows: int) -> jax.Array:
        """Both halves' contribution: packed rows [prow, prow+rows) hold K rows col.. (low nibbles)
        and col+half.. (high nibbles)."""
        p = load_w(prow, rows)
        lo = (jnp.left_shift(p, 4) >> 4).astype(cdt)
        hi = (p >> 4).astype(cdt)
        return dot(load_x(col, rows).astype(cdt), lo) + dot(load_x(col + half, rows).astype(cdt), hi)

    def scaled(part: jax.Array, g: jax.Array | int) -> jax.Array:
        s = load_s(g)
        return part.astype(jnp.float32) * (s.T if swap else s)

    zeros = jnp.zeros(acc_shape, jnp.float32)
    if bk >= group_size:  # one flat loop; each step covers gps whole groups, unrolled
        gps = bk // group_size

        def step(i, acc):
            for j in range(gps):
                g = i * gps + j
                acc = acc + scaled(unpacked_part(g * half, g * group_size, half), g)
            return acc

        acc = lax.fori_loop(0, k // bk, step, zeros)
    else:  # groups longer than a step (e.g. per-channel): inner loop over chunks of one group
        chunk = bk // 2

        def group(g, acc):
            def inner(c, part):
                return part + unpacked_part(g * half + c * chunk, g * group_size + c * chunk, chunk)

            part = lax.fori_loop(0, half // chunk, inner, jnp.zeros(acc_shape, part_dtype))
            return acc + scaled(part, g)

        acc = lax.fori_loop(0, k // group_size, group, zeros)
    return acc.T if swap else acc


def finish(acc: jax.Array, fmt: str, s_w: jax.Array | None, s_x: jax.Array | None) -> jax.Array:
    """Apply the scales that sit outside the K loop: w8a8 (acc * s_x) * s_w, w4a8 acc * s_x."""
    if fmt == "w8a8":
        return (acc.astype(jnp.float32) * s_x) * s_w
    if fmt == "w4a8":
        return acc * s_x
    return acc


def _kernel(*refs, fmt: str, k: int, group_size: int, tiling: Tiling, cdt, fused: bool):
    """One (row block, column block, K split) program; ``fused``: no split, apply the scales here."""
    in_scales = formats.WEIGHT_BITS[fmt] == 4 or (fmt == "w8a8" and fused)
    in_sx = formats.ACT_BITS[fmt] == 8 and fused
    x_ref, w_ref, *rest = refs
    s_ref = rest.pop(0) if in_scales else None
    sx_ref = rest.pop(0) if in_sx else None
    (o_ref,) = rest
    acc = accumulate(
        lambda c, n: x_ref[:, pl.ds(c, n)],
        lambda r, n: w_ref[pl.ds(r, n), :],
        (lambda g: s_ref[pl.ds(g, 1), :]) if in_scales else None,
        fmt=fmt,
        k=k,
        group_size=group_size,
        tiling=tiling,
        cdt=cdt,
    )
    if fused:
        s_w = s_ref[...] if fmt == "w8a8" else None
        acc = finish(acc, fmt, s_w, sx_ref[...] if in_sx else None)
    o_ref[...] = acc.astype(o_ref.dtype)


def prepare_x(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array | None]:
    """Activations as the kernel reads them: per-token int8 plus f32 scales for the a8 formats."""
    if formats.ACT_BITS[fmt] == 8:
        return formats.quantize_activations(x)
    return x, None


@functools.partial(
    jax.jit,
    static_argnames=(
        "out_dtype", "interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages",
        "split_k", "swap_ab", "int_dot",
    ),
)  # fmt: skip
def matmul(
    x: jax.Array,
    w: formats.QuantizedWeight,
    *,
    out_dtype=None,
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    swap_ab: bool | None = None,
    int_dot: str | None = None,
) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in ``w.fmt``, rows bitwise independent of M.

    Tiling defaults to ``block_sizes.gpu_blocks(fmt, K, N)``; pass the same overrides for every M or
    the invariance is lost. ``interpret=True`` runs the kernel in Pallas' interpreter (CPU)."""
    block_sizes.check_operands(x, w)
    fmt = w.fmt
    t = configure(
        w, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
        num_stages=num_stages, split_k=split_k, swap_ab=swap_ab, int_dot=int_dot,
    )  # fmt: skip
    bm, bn, split = t.block_m, t.block_n, t.split_k
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m = x.shape[0]
    m_pad = block_sizes.round_up(max(m, 1), bm)
    four_bit = formats.WEIGHT_BITS[fmt] == 4
    fused = split == 1

    xk, sx = prepare_x(x, fmt)
    xk = block_sizes.pad_axis(block_sizes.pad_axis(xk, 0, m_pad), 1, t.k_pad)
    wv = block_sizes.pad_axis(w.values, 0, w.values.shape[0] if four_bit else t.k_pad)
    wv = block_sizes.pad_axis(wv, 1, t.n_pad)
    k_local = t.k_pad // split
    args = [xk, wv]
    in_specs = [
        pl.BlockSpec((bm, k_local), lambda i, j, s: (i, s)),
        pl.BlockSpec((wv.shape[0] // split, bn), lambda i, j, s: (s, j)),
    ]
    scales = None if w.scales is None else block_sizes.pad_axis(w.scales, 1, t.n_pad)
    if four_bit or (fmt == "w8a8" and fused):
        args.append(scales)
        in_specs.append(pl.BlockSpec((scales.shape[0] // split, bn), lambda i, j, s: (s, j)))
    if sx is not None and fused:
        args.append(block_sizes.pad_axis(sx, 0, m_pad))
        in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, s: (i, 0)))

    part_dtype = jnp.int32 if fmt == "w8a8" else jnp.float32  # what accumulate returns
    if fused:
        out_shape = jax.ShapeDtypeStruct((m_pad, t.n_pad), out_dtype)
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split, m_pad, t.n_pad), part_dtype)
        out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
    kernel = functools.partial(
        _kernel, fmt=fmt, k=k_local, group_size=w.group_size, tiling=t,
        cdt=compute_dtype(x.dtype, w), fused=fused,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(m_pad // bm, t.n_pad // bn, split),
        in_specs=in_specs,
        out_specs=out_spec,
        interpret=interpret,
        compiler_params=compiler_params(t.num_warps, t.num_stages),
        name=f"qarl_{fmt}_matmul",
    )(*args)
    if fused:
        return out[:m, : w.n]
    return combine_splits(out[:, :m, : w.n], fmt, scales, sx, out_dtype, w.n)


def combine_splits(parts, fmt: str, scales, sx, out_dtype, n: int) -> jax.Array:
    """Sum split-K partials [S, M, N] in ascending split order (an explicit chain of adds, one
    elementwise fusion: no reduction whose order XLA could pick), then the outer scales."""
    acc = parts[0]
    for s in range(1, parts.shape[0]):
        acc = acc + parts[s]
    s_w = scales[:, :n] if fmt == "w8a8" else None
    return finish(acc, fmt, s_w, sx).astype(out_dtype)
