"""Batch-invariant quantized matmul for TPUs: Pallas Mosaic. Compiled by the TPU compiler (no chip
here) and interpreter-checked; never run on a TPU.

Grid (row blocks, column blocks, K steps); the K axis is 'arbitrary', so Mosaic runs it in
ascending order, accumulating into a VMEM scratch tile that is written out at the last step.

  bf16   MXU dot, f32 accumulation.
  w8a8   per-token int8 activations (``common.operands``), int8 x int8 -> int32 on the MXU
         (exact), y = (acc * s_x) * s_w at the last step.
  w4a16  a K step holds whole quantization groups; each group's packed rows are unpacked in VMEM
         (widened to int32, two arithmetic shifts, "group halves" layout), dotted in the
         activation dtype with f32 accumulation, and scaled inside the K loop: acc += part * s_g.
  w4a8   the same with int8 activations and an int32 partial per group.
  fp8    per-token e4m3 activations; the e4m3 x and w tiles widened to bf16 in VMEM (exact), a
         bf16 MXU dot with f32 accumulation (every product exact), y = (acc * s_x) * s_w at the
         last step.

Rows are invariant because every block size comes from (K, N) and the format (:func:`tpu_blocks`),
never from M; M only sets how many row blocks the grid has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._mosaic import ARBITRARY, LANES, PARALLEL, compiler_params, cost, interpret_mode, mxu_dot
from kernels_pallas._tiling import Blocks, round_up, tiled
from kernels_pallas.formats import ACT_BITS, WEIGHT_BITS, QuantizedWeight, check_format
from kernels_pallas.matmul import common


def tpu_blocks(fmt: str, k: int, n: int) -> Blocks:
    """Mosaic tiles: rows a multiple of the (8|16|32, 128) VMEM tiling for every operand dtype (32
    rows cover int8's 32-row sublane packing), columns a multiple of the 128 lanes, K steps of a
    whole number of 128-lane tiles."""
    check_format(fmt)
    block_n = 256 if n >= 256 else 128
    block_k = 512 if WEIGHT_BITS[fmt] == 8 else 256
    return Blocks(block_m=32, block_n=block_n, block_k=block_k)


def accumulate_step(x_ref, w_ref, s_ref, acc_ref, *, fmt: str, group_size: int, step_k: int, cdt) -> None:
    """Add one K step's product into ``acc_ref`` (groups within the step in ascending order)."""
    if WEIGHT_BITS[fmt] != 4:
        acc_ref[...] += mxu_dot(x_ref[...].astype(cdt), w_ref[...].astype(cdt), acc_ref.dtype)
        return
    part = common.part_dtype(fmt)
    half = group_size // 2
    for g in range(step_k // group_size):
        p = w_ref[g * half : (g + 1) * half, :].astype(jnp.int32)
        lo = jnp.right_shift(jnp.left_shift(p, 28), 28).astype(cdt)
        hi = jnp.right_shift(p, 4).astype(cdt)
        x_lo = x_ref[:, g * group_size : g * group_size + half].astype(cdt)
        x_hi = x_ref[:, g * group_size + half : (g + 1) * group_size].astype(cdt)
        group_part = mxu_dot(x_lo, lo, part) + mxu_dot(x_hi, hi, part)
        acc_ref[...] += group_part.astype(jnp.float32) * s_ref[g]


def plan(w: QuantizedWeight, blocks: Blocks) -> tuple[int, int, int, int]:
    """(block_n, padded N, K per step, padded K) for Mosaic's (sublane, 128-lane) tiling."""
    if blocks.block_m % 32 or blocks.block_n % LANES or blocks.block_k % LANES:
        raise ValueError(f"Mosaic tiles need block_m % 32 == 0 and block_n, block_k % 128 == 0; got {blocks}")
    block_n, n_pad = blocks.block_n, round_up(w.n, blocks.block_n)
    if w.n <= blocks.block_n:
        block_n = n_pad = round_up(w.n, LANES)
    if WEIGHT_BITS[w.fmt] == 4:
        g = w.group_size
        if g % 64:
            raise ValueError(f"the TPU kernel needs an int4 group size that is a multiple of 64; got {g}")
        # whole groups per step, a whole number of 128-lane tiles (or all of K)
        fits = [s for s in range(g, max(g, blocks.block_k) + 1, g) if w.k % s == 0 and s % LANES == 0]
        return block_n, n_pad, max(fits, default=w.k), w.k
    step = min(blocks.block_k, round_up(w.k, LANES))
    return block_n, n_pad, step, round_up(w.k, step)


def configure(w: QuantizedWeight, **knobs) -> Blocks:
    """:func:`tpu_blocks` with the caller's non-None ``block_m``, ``block_n``, ``block_k``."""
    return tpu_blocks(w.fmt, w.k, w.n).override(("block_m", "block_n", "block_k"), **knobs)


def scale_operand(w: QuantizedWeight, scales: jax.Array, step: int) -> tuple[jax.Array, tuple, Callable]:
    """The weight scales as the kernel reads them, their block shape and block index ``(kk, j) ->``
    (both without the expert axis): w8a8 and fp8 one [1, block_n] row; int4 one [1, block_n] row per group
    of the K step, as a 3-D array so that a group's row is a whole VMEM tile."""
    if WEIGHT_BITS[w.fmt] == 4:
        *lead, groups, n = scales.shape
        return scales.reshape(*lead, groups, 1, n), (step // w.group_size, 1), lambda kk, j: (kk, 0, j)
    return scales, (1,), lambda kk, j: (0, j)


def k_step(x_ref, w_ref, s_ref, sx_ref, acc_ref, store, **cfg) -> None:
    """One step of the grid's K axis (axis 2): zero the accumulator at the first step, add this
    step's product, and at the last step hand the finished tile (outer scales applied) to
    ``store``. ``cfg``: ``accumulate_step``'s fmt, group_size, step_k, cdt."""
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    accumulate_step(x_ref, w_ref, s_ref, acc_ref, **cfg)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        s_w = s_ref[...] if common.channel_scaled(cfg["fmt"]) else None
        store(common.finish(acc_ref[...], cfg["fmt"], s_w, None if sx_ref is None else sx_ref[...]))


def split_refs(refs, fmt: str) -> tuple:
    """A TPU matmul kernel's refs: x, w, scales (quantized formats), activation scales (a8)..."""
    return common.kernel_refs(refs, WEIGHT_BITS[fmt] is not None, ACT_BITS[fmt] == 8)


def _kernel(*refs, **cfg):
    x_ref, w_ref, s_ref, sx_ref, (o_ref, acc_ref) = split_refs(refs, cfg["fmt"])

    def store(y):
        o_ref[...] = y.astype(o_ref.dtype)

    k_step(x_ref, w_ref, s_ref, sx_ref, acc_ref, store, **cfg)


@tiled(configure)
def matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype, interpret: bool, tiling: Blocks) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in ``w.fmt`` (operands already checked), rows bitwise
    independent of M. Blocks: :func:`tpu_blocks` with the caller's knobs."""
    blocks = tiling
    fmt = w.fmt
    bn, n_pad, step, k_pad = plan(w, blocks)
    bm = blocks.block_m
    m = x.shape[0]
    step_rows = step // 2 if WEIGHT_BITS[fmt] == 4 else step
    ops = common.operands(x, w, block_m=bm, k_pad=k_pad, n_pad=n_pad)
    args = [ops.x, ops.w]
    in_specs = [
        pl.BlockSpec((bm, step), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((step_rows, bn), lambda i, j, kk: (kk, j)),
    ]
    if ops.scales is not None:
        scales, s_block, s_index = scale_operand(w, ops.scales, step)
        args.append(scales)
        in_specs.append(pl.BlockSpec((*s_block, bn), lambda i, j, kk: s_index(kk, j)))
    if ops.sx is not None:
        args.append(ops.sx)
        in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, kk: (i, 0)))

    cdt = common.compute_dtype(x.dtype, w)
    out_shape = jax.ShapeDtypeStruct((ops.m_pad, n_pad), out_dtype)
    grid = (ops.m_pad // bm, n_pad // bn, k_pad // step)
    out_spec = pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j))
    out = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, group_size=w.group_size, step_k=step, cdt=cdt),
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=[pltpu.VMEM((bm, bn), common.acc_dtype(fmt))],
        interpret=interpret_mode(interpret),
        compiler_params=compiler_params(PARALLEL, PARALLEL, ARBITRARY, fuse_inputs=len(args)),
        name=f"qarl_{fmt}_matmul_tpu",
        cost_estimate=cost(2 * ops.m_pad * n_pad * k_pad, grid, [*in_specs, out_spec], [*args, out_shape]),
    )(*args)
    return out[:m, : w.n]
