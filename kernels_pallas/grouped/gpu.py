"""Batch-invariant grouped (MoE experts) quantized matmul for GPUs: Pallas on the Triton backend.

The launch grid walks the static work list of (expert, row block) tiles (``common.group_tiles``);
a tile computes its whole row block against its expert's weights with the dense kernel's K loop
(``matmul.gpu.accumulate``) and stores only its expert's rows (masked store). A row is therefore
computed by the same program, with the same tile shapes and K order, whatever the group sizes, the
number of rows, or its neighbours: bitwise invariant.

Split-K (``split_k`` > 1; default 1, or the entry of ``tuned.TUNED_GROUPED`` for (fmt, K, N)): a
third grid axis splits K into that many contiguous ranges, each tile's program stores its rows'
partial sum of one range (f32, int32 for w8a8) into a [split, M, N] buffer, and one elementwise XLA
fusion sums the partials in ascending split order, then applies the scales outside the K loop (w8a8
and fp8 with each row's expert scales): the dense kernel's split, per expert. The split count is a
knob of the weight shape, never of M or of the group sizes, so rows stay invariant. Decode with
few tokens per expert launches few (expert, row block) tiles; the split multiplies them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas._tiling import tiled
from kernels_pallas._triton import compiler_params
from kernels_pallas.formats import ACT_BITS, WEIGHT_BITS, QuantizedWeight
from kernels_pallas.gpu_support import check_gpu_format
from kernels_pallas.grouped.common import group_tiles
from kernels_pallas.matmul import common
from kernels_pallas.matmul.common import channel_scaled, compute_dtype, finish, kernel_refs, operands
from kernels_pallas.matmul.gpu import Tiling, accumulate, combine_splits, configure
from kernels_pallas.matmul.tuned import TUNED_GROUPED


def _kernel(*refs, fmt: str, k: int, group_size: int, tiling: Tiling, cdt, fused: bool):
    """One (tile, column block, K split) program; ``fused``: no split, apply the outer scales here."""
    in_scales = WEIGHT_BITS[fmt] == 4 or (channel_scaled(fmt) and fused)
    in_sx = ACT_BITS[fmt] == 8 and fused
    te_ref, tb_ref, tlo_ref, thi_ref, *rest = refs
    x_ref, w_ref, s_ref, sx_ref, (_zeroed, o_ref) = kernel_refs(rest, in_scales, in_sx)
    block_m, block_n = tiling.block_m, tiling.block_n
    t = pl.program_id(0)
    col0 = pl.program_id(2) * k  # this split's first K column of x
    e, rb, lo, hi = te_ref[t], tb_ref[t], tlo_ref[t], thi_ref[t]
    row0 = rb * block_m

    @pl.when(hi > lo)
    def _():
        acc = accumulate(
            lambda c, n: x_ref[pl.ds(row0, block_m), pl.ds(col0 + c, n)],
            lambda r, n: w_ref[e, pl.ds(r, n), :],
            (lambda g: s_ref[e, pl.ds(g, 1), :]) if in_scales else None,
            fmt=fmt,
            k=k,
            group_size=group_size,
            tiling=tiling,
            cdt=cdt,
        )
        if fused:
            s_w = s_ref[e, pl.ds(0, 1), :] if channel_scaled(fmt) else None
            s_x = sx_ref[pl.ds(row0, block_m), :] if in_sx else None
            acc = finish(acc, fmt, s_w, s_x)
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
        store_rows = o_ref.at[pl.ds(row0, block_m), :]
        pltriton.store(store_rows, acc.astype(o_ref.dtype), mask=(rows >= lo) & (rows < hi))


def configure_grouped(w: QuantizedWeight, **knobs) -> Tiling:
    """The dense tiling with the grouped table's entry for (fmt, K, N) over it (``tuned.TUNED_GROUPED``)
    and the caller's knobs over both; split-K 1 unless the entry or the caller sets it (the dense
    table's split was chosen for a dense launch, not for the expert work list)."""
    entry: dict = {"split_k": 1, **TUNED_GROUPED.get((w.fmt, w.k, w.n), {})}
    return configure(w, **{**entry, **{name: v for name, v in knobs.items() if v is not None}})


@tiled(configure_grouped)
def grouped_matmul(
    x, w: QuantizedWeight, group_sizes, *, out_dtype, interpret: bool, tiling: Tiling
) -> jax.Array:
    """``out[r] = x[r] @ w[e(r)]`` for rows sorted by expert (operands already checked); rows past
    ``sum(group_sizes)`` come out zero. Block sizes as the dense kernel's (from (K, N) only)."""
    t = tiling
    fmt = w.fmt
    if not interpret:  # the interpreter converts e4m3 anywhere
        check_gpu_format(fmt)
    bm, bn, split = t.block_m, t.block_n, t.split_k
    fused = split == 1
    m = x.shape[0]
    tiles = group_tiles(group_sizes, m, bm)
    num_tiles = tiles[0].shape[0]
    ops = operands(x, w, block_m=bm, k_pad=t.k_pad, n_pad=t.n_pad)
    n_exp, k_rows = ops.w.shape[:2]
    args = [*tiles, ops.x, ops.w]
    whole = lambda shape: pl.BlockSpec(shape, lambda t, j, s: (0,) * len(shape))
    in_specs = [whole((num_tiles,))] * 4 + [
        whole(ops.x.shape),
        pl.BlockSpec((n_exp, k_rows // split, bn), lambda t, j, s: (0, s, j)),
    ]
    if WEIGHT_BITS[fmt] == 4 or (channel_scaled(fmt) and fused):
        assert ops.scales is not None, f"{fmt} weights have scales"
        args.append(ops.scales)
        rows = ops.scales.shape[1] // split
        in_specs.append(pl.BlockSpec((n_exp, rows, bn), lambda t, j, s: (0, s, j)))
    if ops.sx is not None and fused:
        args.append(ops.sx)
        in_specs.append(whole(ops.sx.shape))
    if fused:
        out_shape = jax.ShapeDtypeStruct((ops.m_pad, t.n_pad), out_dtype)
        out_spec = pl.BlockSpec((ops.m_pad, bn), lambda t, j, s: (0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split, ops.m_pad, t.n_pad), common.acc_dtype(fmt))
        out_spec = pl.BlockSpec((None, ops.m_pad, bn), lambda t, j, s: (s, 0, j))
    args.append(jnp.zeros(out_shape.shape, out_shape.dtype))  # rows no tile writes stay zero
    in_specs.append(out_spec)

    kernel = functools.partial(
        _kernel, fmt=fmt, k=t.k_pad // split, group_size=w.group_size, tiling=t,
        cdt=compute_dtype(x.dtype, w), fused=fused,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tiles, t.n_pad // bn, split),
        in_specs=in_specs,
        out_specs=out_spec,
        input_output_aliases={len(args) - 1: 0},
        interpret=interpret,
        compiler_params=compiler_params(t.num_warps, t.num_stages),
        name=f"qarl_{fmt}_grouped_matmul",
    )(*args)
    if fused:
        return out[:m, : w.n]
    scales = None
    if channel_scaled(fmt):  # each row's expert's channel scales (rows of no expert: zeros anyway)
        assert ops.scales is not None, f"{fmt} weights have scales"
        ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
        expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right"), n_exp - 1)
        scales = ops.scales[expert, 0, :]
    sx = None if ops.sx is None else ops.sx[:m]
    return combine_splits(out[:, :m, : w.n], fmt, scales, sx, out_dtype, w.n)
