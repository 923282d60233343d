"""Batch-invariant grouped (MoE experts) quantized matmul for GPUs: Pallas on the Triton backend.

The launch grid walks the static work list of (expert, row block) tiles (``common.group_tiles``);
a tile computes its whole row block against its expert's weights with the dense kernel's K loop
(``matmul.gpu.accumulate``) and stores only its expert's rows (masked store). A row is therefore
computed by the same program, with the same tile shapes and K order, whatever the group sizes, the
number of rows, or its neighbours: bitwise invariant. The dense tiling is used without its split-K
(the expert work list already gives the launch many programs).
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
from kernels_pallas.matmul.common import channel_scaled, compute_dtype, finish, kernel_refs, operands
from kernels_pallas.matmul.gpu import Tiling, accumulate, configure


def _kernel(*refs, fmt: str, k: int, group_size: int, tiling: Tiling, cdt):
    has_scales = WEIGHT_BITS[fmt] is not None
    int_act = ACT_BITS[fmt] == 8
    te_ref, tb_ref, tlo_ref, thi_ref, *rest = refs
    x_ref, w_ref, s_ref, sx_ref, (_zeroed, o_ref) = kernel_refs(rest, has_scales, int_act)
    block_m, block_n = tiling.block_m, tiling.block_n
    t = pl.program_id(0)
    e, rb, lo, hi = te_ref[t], tb_ref[t], tlo_ref[t], thi_ref[t]
    row0 = rb * block_m

    @pl.when(hi > lo)
    def _():
        acc = accumulate(
            lambda c, n: x_ref[pl.ds(row0, block_m), pl.ds(c, n)],
            lambda r, n: w_ref[e, pl.ds(r, n), :],
            (lambda g: s_ref[e, pl.ds(g, 1), :]) if has_scales else None,
            fmt=fmt,
            k=k,
            group_size=group_size,
            tiling=tiling,
            cdt=cdt,
        )
        s_w = s_ref[e, pl.ds(0, 1), :] if channel_scaled(fmt) else None
        s_x = sx_ref[pl.ds(row0, block_m), :] if int_act else None
        y = finish(acc, fmt, s_w, s_x).astype(o_ref.dtype)
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
        pltriton.store(o_ref.at[pl.ds(row0, block_m), :], y, mask=(rows >= lo) & (rows < hi))


def configure_grouped(w: QuantizedWeight, **knobs) -> Tiling:
    """The dense tiling without its split-K (the expert tiles already give the launch many programs)."""
    if "split_k" in knobs:
        raise TypeError("the grouped GPU kernel has no split_k: its expert tiles already fill the GPU")
    return configure(w, **knobs, split_k=1)


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
    bm, bn = t.block_m, t.block_n
    m = x.shape[0]
    tiles = group_tiles(group_sizes, m, bm)
    num_tiles = tiles[0].shape[0]
    ops = operands(x, w, block_m=bm, k_pad=t.k_pad, n_pad=t.n_pad)
    n_exp, k_rows = ops.w.shape[:2]
    args = [*tiles, ops.x, ops.w]
    whole = lambda shape: pl.BlockSpec(shape, lambda t, j: (0,) * len(shape))
    in_specs = [whole((num_tiles,))] * 4 + [
        whole(ops.x.shape),
        pl.BlockSpec((n_exp, k_rows, bn), lambda t, j: (0, 0, j)),
    ]
    if ops.scales is not None:
        args.append(ops.scales)
        in_specs.append(pl.BlockSpec((n_exp, ops.scales.shape[1], bn), lambda t, j: (0, 0, j)))
    if ops.sx is not None:
        args.append(ops.sx)
        in_specs.append(whole(ops.sx.shape))
    out_spec = pl.BlockSpec((ops.m_pad, bn), lambda t, j: (0, j))
    args.append(jnp.zeros((ops.m_pad, t.n_pad), out_dtype))
    in_specs.append(out_spec)

    kernel = functools.partial(
        _kernel, fmt=fmt, k=t.k_pad, group_size=w.group_size, tiling=t, cdt=compute_dtype(x.dtype, w)
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((ops.m_pad, t.n_pad), out_dtype),
        grid=(num_tiles, t.n_pad // bn),
        in_specs=in_specs,
        out_specs=out_spec,
        input_output_aliases={len(args) - 1: 0},
        interpret=interpret,
        compiler_params=compiler_params(t.num_warps, t.num_stages),
        name=f"qarl_{fmt}_grouped_matmul",
    )(*args)
    return out[:m, : w.n]
