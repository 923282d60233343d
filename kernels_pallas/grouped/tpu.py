"""Batch-invariant grouped (MoE experts) quantized matmul for TPUs: Pallas Mosaic.
Compiled by the TPU compiler (no chip here) and interpreter-checked; no TPU has run it.

The static work list of (expert, row block) tiles (``common.group_tiles``) is scalar-prefetched
into SMEM; the grid is (column blocks, tiles, K steps). A tile runs the dense kernel's K step
(``matmul.tpu.accumulate_step``) against its expert's weights (chosen by the weight BlockSpec's
index map) and writes only its expert's rows of the output block. Tiles come in non-decreasing
row-block order, so an output block stays resident in VMEM across the tiles that share it; its
first visit zeroes it. Each row is computed by the same program whatever the group sizes, M or its
neighbours: bitwise invariant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._mosaic import ARBITRARY, PARALLEL, compiler_params, cost, interpret_mode
from kernels_pallas._tiling import Blocks, tiled
from kernels_pallas.formats import WEIGHT_BITS, QuantizedWeight
from kernels_pallas.grouped.common import group_tiles
from kernels_pallas.matmul.common import acc_dtype, compute_dtype, operands
from kernels_pallas.matmul.tpu import configure, k_step, plan, scale_operand, split_refs


def _kernel(te_ref, tb_ref, tlo_ref, thi_ref, *refs, block_m: int, **cfg):
    x_ref, w_ref, s_ref, sx_ref, (o_ref, acc_ref) = split_refs(refs, cfg["fmt"])
    t, kk = pl.program_id(1), pl.program_id(2)
    rb, lo, hi = tb_ref[t], tlo_ref[t], thi_ref[t]
    first_visit = jnp.logical_or(t == 0, tb_ref[jnp.maximum(t - 1, 0)] != rb)

    @pl.when(jnp.logical_and(kk == 0, first_visit))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    def store(y):  # only this tile's expert rows of the output block
        rows = rb * block_m + jax.lax.broadcasted_iota(jnp.int32, y.shape, 0)
        o_ref[...] = jnp.where((rows >= lo) & (rows < hi), y.astype(o_ref.dtype), o_ref[...])

    @pl.when(hi > lo)
    def _():
        k_step(x_ref, w_ref, s_ref, sx_ref, acc_ref, store, **cfg)


@tiled(configure)
def grouped_matmul(
    x, w: QuantizedWeight, group_sizes, *, out_dtype, interpret: bool, tiling: Blocks
) -> jax.Array:
    """``out[r] = x[r] @ w[e(r)]`` for rows sorted by expert (operands already checked); rows past
    ``sum(group_sizes)`` come out zero. Blocks as the dense kernel's."""
    blocks = tiling
    fmt = w.fmt
    bn, n_pad, step, k_pad = plan(w, blocks)
    bm = blocks.block_m
    m = x.shape[0]
    tiles = group_tiles(group_sizes, m, bm)
    step_rows = step // 2 if WEIGHT_BITS[fmt] == 4 else step
    ops = operands(x, w, block_m=bm, k_pad=k_pad, n_pad=n_pad)
    # index maps see (column block, tile, K step, then the prefetched expert/row-block lists)
    args = [ops.x, ops.w]
    in_specs = [
        pl.BlockSpec((bm, step), lambda j, t, kk, te, tb, *_: (tb[t], kk)),
        pl.BlockSpec((None, step_rows, bn), lambda j, t, kk, te, *_: (te[t], kk, j)),
    ]
    if ops.scales is not None:
        scales, s_block, s_index = scale_operand(w, ops.scales, step)
        args.append(scales)
        in_specs.append(pl.BlockSpec((None, *s_block, bn), lambda j, t, kk, te, *_: (te[t], *s_index(kk, j))))
    if ops.sx is not None:
        args.append(ops.sx)
        in_specs.append(pl.BlockSpec((bm, 1), lambda j, t, kk, te, tb, *_: (tb[t], 0)))

    kernel = functools.partial(
        _kernel, fmt=fmt, group_size=w.group_size, step_k=step, block_m=bm, cdt=compute_dtype(x.dtype, w)
    )
    grid = (n_pad // bn, tiles[0].shape[0], k_pad // step)
    out_spec = pl.BlockSpec((bm, bn), lambda j, t, kk, te, tb, *_: (tb[t], j))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=[pltpu.VMEM((bm, bn), acc_dtype(fmt))],
    )
    out_shape = jax.ShapeDtypeStruct((ops.m_pad, n_pad), out_dtype)
    # each row meets one expert: the flops of a dense matmul of the rows; every expert's weights read
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        interpret=interpret_mode(interpret),
        compiler_params=compiler_params(PARALLEL, ARBITRARY, ARBITRARY),
        name=f"qarl_{fmt}_grouped_matmul_tpu",
        cost_estimate=cost(
            2 * ops.m_pad * n_pad * k_pad, grid, [*in_specs, out_spec], [*args, out_shape], prefetch=tiles
        ),
    )(*tiles, *args)
    return out[:m, : w.n]
