"""Batch-invariant quantized matmul for GPUs: Pallas on the Triton backend.

Every format (see ``kernels_pallas.formats``) runs through one kernel:

  bf16   float dot, f32 accumulation over K tiles in ascending order.
  w8a8   per-token int8 activations (``common.operands``), int8 x int8 -> int32 (exact,
         order-free), y = (acc * s_x) * s_w.
  w4a16  int4 unpacked in registers ("group halves" layout; shifts and converts, or the same values
         by the magic-number trick: ``Blocks.dequant``, ``kernels_pallas._dequant``), dot
         in the activation dtype with f32 accumulation, each group's partial product scaled
         inside the K loop (acc += partial * s_g), groups in ascending order.
  w4a8   the same unpacking, int8 activations, int32 partial per group.
  fp8    per-token e4m3 activations; e4m3 x and w tiles widened to bf16 in registers (exact), a
         bf16 MMA with f32 accumulation (every product exact), y = (acc * s_x) * s_w.

Why the rows are invariant: the tiling (``Blocks``: tile shape, warps, stages, split-K, operand
order) comes from (fmt, K, N) only (:func:`gpu_blocks`), rows are padded to block_m, each
program's K loop runs in a fixed ascending order, and a split-K's partials are summed in ascending
split order by one elementwise XLA fusion (int32 for w8a8: exact). M only changes how many
identical programs are launched, so row r's bits do not depend on M or on its neighbours.

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

from kernels_pallas._dequant import check_dequant, int4_halves
from kernels_pallas._tiling import Blocks, fit_block, is_pow2, pow2_divisor, tiled
from kernels_pallas._triton import MIN_TILE, compiler_params
from kernels_pallas.formats import ACT_BITS, WEIGHT_BITS, QuantizedWeight, check_format
from kernels_pallas.gpu_support import check_gpu_format
from kernels_pallas.matmul import common
from kernels_pallas.matmul.tuned import TUNED

GPU_SMS = 132  # H200 / H100 SXM multiprocessors: the decode grid should cover them
_F32_EXACT_INT = 2**24  # f32 holds every integer below this exactly


def base_blocks(fmt: str) -> Blocks:
    """The format's blocks before split-K and tuning: 128-column blocks (64 for bf16); block_m = 16,
    the smallest Triton dot tile, fixed for every M (training pays for it in re-reads of the
    weights, which stay in L2)."""
    check_format(fmt)
    block_n, block_k = {4: (128, 256), 8: (128, 128), None: (64, 128)}[WEIGHT_BITS[fmt]]
    return Blocks(block_m=16, block_n=block_n, block_k=block_k, num_warps=4, num_stages=4)


def gpu_blocks(fmt: str, k: int, n: int) -> Blocks:
    """Triton tiles for one (fmt, K, N): the H200-tuned entry of ``tuned.TUNED`` if there is one,
    else the base blocks with a split-K. Decode is bound by the weight bytes, so the split aims for
    >= GPU_SMS programs at M <= 16: a fixed split of up to 4 when N / block_n alone is too few."""
    base = base_blocks(fmt)
    tuned = TUNED.get((fmt, k, n))
    if tuned is not None:
        return base.override(**tuned)
    n_blocks = -(-n // base.block_n)
    split = 1
    while n_blocks * split < GPU_SMS and split < 4 and k % (2 * split * base.block_k) == 0:
        split *= 2
    return dataclasses.replace(base, split_k=split)


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
    dequant: str = "shift"


def _pow2_dividing(total: int, cap: int) -> int:
    return pow2_divisor(total, cap) or 1


def plan(w: QuantizedWeight, blocks: Blocks) -> Tiling:
    """The tiling the kernel runs for this weight: checks powers of two, fits N and K blocks, and
    lowers split_k / block_k to the largest power of two that tiles K (a function of the weight's
    shape and group size only). Raises on what cannot be tiled."""
    k, n = w.k, w.n
    for name, v in (("block_m", blocks.block_m), ("block_n", blocks.block_n), ("block_k", blocks.block_k)):
        if v < MIN_TILE or not is_pow2(v):
            raise ValueError(f"Triton needs power-of-two tiles >= {MIN_TILE}; got {name}={v}")
    if not is_pow2(blocks.split_k):
        raise ValueError(f"split_k must be a power of two, got {blocks.split_k}")
    if blocks.int_dot not in ("int8", "bf16"):
        raise ValueError(f"int_dot must be 'int8' or 'bf16', got {blocks.int_dot!r}")
    check_dequant(blocks.dequant)
    block_n, n_pad = fit_block(n, blocks.block_n, MIN_TILE)
    if WEIGHT_BITS[w.fmt] == 4:
        g = w.group_size
        if g // 2 < MIN_TILE or not is_pow2(g):
            raise ValueError(
                f"the GPU kernel needs a power-of-two int4 group size >= {2 * MIN_TILE}; got {g}"
            )
        if blocks.block_k < 2 * MIN_TILE:
            raise ValueError(f"4-bit steps unpack block_k // 2 packed rows: block_k >= {2 * MIN_TILE}")
        split = _pow2_dividing(k // g, blocks.split_k)
        local_groups = k // g // split
        # whole groups per step when block_k >= g, else a chunk of block_k // 2 packed rows of one group
        block_k = blocks.block_k
        if block_k >= g:
            block_k = g * _pow2_dividing(local_groups, block_k // g)
        k_pad = k
    else:
        block_k, k_pad = fit_block(k, blocks.block_k, 2 * MIN_TILE)
        split = _pow2_dividing(k_pad // block_k, blocks.split_k)
    int_dot = blocks.int_dot
    if w.fmt == "w8a8" and block_k * 127 * 127 >= _F32_EXACT_INT:
        int_dot = "int8"  # a bf16 MMA would no longer be exact
    return Tiling(
        blocks.block_m, block_n, n_pad, block_k, k_pad, split, blocks.swap_ab, int_dot,
        blocks.num_warps, blocks.num_stages, blocks.dequant,
    )  # fmt: skip


def configure(w: QuantizedWeight, **overrides) -> Tiling:
    """:func:`gpu_blocks` with the caller's non-None overrides, planned."""
    return plan(w, gpu_blocks(w.fmt, w.k, w.n).override(**overrides))


def _dot(a: jax.Array, b: jax.Array, acc: jnp.dtype, swap: bool, int_dot: str) -> jax.Array:
    """a [bm, kk] @ b [kk, bn] -> [bm, bn], or its transpose [bn, bm] when ``swap`` (b^T a^T: the
    weight tile becomes the MMA's M side). int8 operands with ``int_dot == "bf16"`` go through a
    bf16 MMA (integers exact in bf16, partial exact in f32) and come back as int32."""
    if acc == jnp.int32 and int_dot == "bf16":
        return _dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), jnp.float32, swap, "").astype(jnp.int32)
    dims = (((0,), (1,)), ((), ())) if swap else (((1,), (0,)), ((), ()))
    lhs, rhs = (b, a) if swap else (a, b)
    return lax.dot_general(lhs, rhs, dims, preferred_element_type=acc, precision=lax.Precision.HIGHEST)


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
    4-bit, fp8) or int32 (w8a8) [block_m, block_n]."""
    bm, bn, bk, swap = tiling.block_m, tiling.block_n, tiling.block_k, tiling.swap_ab
    acc_shape = (bn, bm) if swap else (bm, bn)
    part = common.part_dtype(fmt)
    dot = functools.partial(_dot, acc=part, swap=swap, int_dot=tiling.int_dot)

    if WEIGHT_BITS[fmt] != 4:

        def body(i, acc):
            xs = load_x(i * bk, bk).astype(cdt)
            ws = load_w(i * bk, bk).astype(cdt)
            return acc + dot(xs, ws)

        acc = lax.fori_loop(0, k // bk, body, jnp.zeros(acc_shape, part))
        return acc.T if swap else acc

    assert load_s is not None, "4-bit weights have group scales"
    half = group_size // 2

    def unpacked_part(prow: jax.Array | int, col: jax.Array | int, rows: int) -> jax.Array:
        """Both halves' contribution: packed rows [prow, prow+rows) hold K rows col.. (low nibbles)
        and col+half.. (high nibbles)."""
        lo, hi = int4_halves(load_w(prow, rows), cdt, tiling.dequant)
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

            group_part = lax.fori_loop(0, half // chunk, inner, jnp.zeros(acc_shape, part))
            return acc + scaled(group_part, g)

        acc = lax.fori_loop(0, k // group_size, group, zeros)
    return acc.T if swap else acc


def _kernel(*refs, fmt: str, k: int, group_size: int, tiling: Tiling, cdt, fused: bool):
    """One (row block, column block, K split) program; ``fused``: no split, apply the scales here."""
    in_scales = WEIGHT_BITS[fmt] == 4 or (common.channel_scaled(fmt) and fused)
    in_sx = ACT_BITS[fmt] == 8 and fused
    x_ref, w_ref, s_ref, sx_ref, (o_ref,) = common.kernel_refs(refs, in_scales, in_sx)
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
        s_w = s_ref[...] if common.channel_scaled(fmt) else None
        acc = common.finish(acc, fmt, s_w, sx_ref[...] if in_sx else None)
    o_ref[...] = acc.astype(o_ref.dtype)


@tiled(configure)
def matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype, interpret: bool, tiling: Tiling) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in ``w.fmt`` (operands already checked), rows bitwise
    independent of M. Tiling: :func:`gpu_blocks` with the caller's knobs (``Blocks`` fields); pass
    the same knobs for every M or the invariance is lost."""
    t = tiling
    fmt = w.fmt
    if not interpret:  # the interpreter converts e4m3 anywhere
        check_gpu_format(fmt)
    bm, bn, split = t.block_m, t.block_n, t.split_k
    m = x.shape[0]
    fused = split == 1
    ops = common.operands(x, w, block_m=bm, k_pad=t.k_pad, n_pad=t.n_pad)
    k_local = t.k_pad // split
    args = [ops.x, ops.w]
    in_specs = [
        pl.BlockSpec((bm, k_local), lambda i, j, s: (i, s)),
        pl.BlockSpec((ops.w.shape[0] // split, bn), lambda i, j, s: (s, j)),
    ]
    if WEIGHT_BITS[fmt] == 4 or (common.channel_scaled(fmt) and fused):
        assert ops.scales is not None, f"{fmt} weights have scales"
        args.append(ops.scales)
        in_specs.append(pl.BlockSpec((ops.scales.shape[0] // split, bn), lambda i, j, s: (s, j)))
    if ops.sx is not None and fused:
        args.append(ops.sx)
        in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, s: (i, 0)))
    if fused:
        out_shape = jax.ShapeDtypeStruct((ops.m_pad, t.n_pad), out_dtype)
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split, ops.m_pad, t.n_pad), common.acc_dtype(fmt))
        out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
    kernel = functools.partial(
        _kernel, fmt=fmt, k=k_local, group_size=w.group_size, tiling=t,
        cdt=common.compute_dtype(x.dtype, w), fused=fused,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(ops.m_pad // bm, t.n_pad // bn, split),
        in_specs=in_specs,
        out_specs=out_spec,
        interpret=interpret,
        compiler_params=compiler_params(t.num_warps, t.num_stages),
        name=f"qarl_{fmt}_matmul",
    )(*args)
    if fused:
        return out[:m, : w.n]
    sx = None if ops.sx is None else ops.sx[:m]
    return combine_splits(out[:, :m, : w.n], fmt, ops.scales, sx, out_dtype, w.n)


def combine_splits(parts, fmt: str, scales, sx, out_dtype, n: int) -> jax.Array:
    """Sum split-K partials [S, M, N] in ascending split order (an explicit chain of adds, one
    elementwise fusion: no reduction whose order XLA could pick), then the outer scales."""
    acc = parts[0]
    for s in range(1, parts.shape[0]):
        acc = acc + parts[s]
    s_w = scales[:, :n] if common.channel_scaled(fmt) else None
    return common.finish(acc, fmt, s_w, sx).astype(out_dtype)
