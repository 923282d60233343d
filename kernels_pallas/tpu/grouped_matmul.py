"""Batch-invariant grouped (MoE experts) quantized matmul for TPUs: Pallas Mosaic.
Lowering- and interpreter-checked only (no TPU here).

Rows sorted by expert, contiguous groups, dropless. The static work list of (expert, row block)
tiles (``block_sizes.group_tiles``) is scalar-prefetched into SMEM; the grid is (column blocks,
tiles, K steps). A tile runs the dense kernel's K loop (``tpu.matmul.accumulate_step``) against
its expert's weights (chosen by the weight BlockSpec's index map) and writes only its expert's
rows of the output block. Tiles come in non-decreasing row-block order, so an output block stays
resident in VMEM across the tiles that share it; its first visit zeroes it. Each row is computed
by the same program whatever the group sizes, M or its neighbours: bitwise invariant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import block_sizes, formats
from kernels_pallas.tpu import ARBITRARY, PARALLEL, compiler_params, interpret_params
from kernels_pallas.tpu.matmul import acc_dtype, accumulate_step, compute_dtype, finish, plan, prepare_x


def _kernel(
    te_ref, tb_ref, tlo_ref, thi_ref, *refs, fmt: str, group_size: int, step_k: int, block_m: int, cdt
):
    has_scales = formats.WEIGHT_BITS[fmt] is not None
    int_act = formats.ACT_BITS[fmt] == 8
    x_ref, w_ref, *rest = refs
    s_ref = rest.pop(0) if has_scales else None
    sx_ref = rest.pop(0) if int_act else None
    o_ref, acc_ref = rest
    t, kk = pl.program_id(1), pl.program_id(2)
    rb, lo, hi = tb_ref[t], tlo_ref[t], thi_ref[t]
    first_visit = jnp.logical_or(t == 0, tb_ref[jnp.maximum(t - 1, 0)] != rb)

    @pl.when(jnp.logical_and(kk == 0, first_visit))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(hi > lo)
    def _():
        @pl.when(kk == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        accumulate_step(x_ref, w_ref, s_ref, acc_ref, fmt=fmt, group_size=group_size, step_k=step_k, cdt=cdt)

        @pl.when(kk == pl.num_programs(2) - 1)
        def _():
            s_w = s_ref[...] if fmt == "w8a8" else None
            s_x = sx_ref[...] if int_act else None
            y = finish(acc_ref[...], fmt, s_w, s_x).astype(o_ref.dtype)
            rows = rb * block_m + jax.lax.broadcasted_iota(jnp.int32, y.shape, 0)
            o_ref[...] = jnp.where((rows >= lo) & (rows < hi), y, o_ref[...])


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_m", "block_n", "block_k"))
def grouped_matmul(
    x: jax.Array,
    w: formats.QuantizedWeight,
    group_sizes: jax.Array,
    *,
    out_dtype=None,
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """``out[r] = x[r] @ w[e(r)]`` for rows sorted by expert; ``w`` [E, K, N] in any format,
    ``group_sizes`` int32 [E]. Rows past ``sum(group_sizes)`` come out zero."""
    block_sizes.check_operands(x, w, experts=True)
    if group_sizes.ndim != 1 or group_sizes.shape[0] != w.values.shape[0]:
        raise ValueError(f"group_sizes must be [E={w.values.shape[0]}], got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")
    fmt = w.fmt
    blocks = block_sizes.resolve(block_sizes.tpu_blocks(fmt, w.k, w.n), block_m, block_n, block_k)
    bn, n_pad, step, k_pad = plan(w, blocks)
    bm = blocks.block_m
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m = x.shape[0]
    m_pad = block_sizes.round_up(max(m, 1), bm)
    tiles = block_sizes.group_tiles(group_sizes, m, bm)
    num_tiles = tiles[0].shape[0]
    packed = formats.WEIGHT_BITS[fmt] == 4
    step_rows = step // 2 if packed else step

    xk, sx = prepare_x(x, fmt)
    xk = block_sizes.pad_axis(block_sizes.pad_axis(xk, 0, m_pad), 1, k_pad)
    wv = w.values if packed else block_sizes.pad_axis(w.values, 1, k_pad)
    wv = block_sizes.pad_axis(wv, 2, n_pad)
    args = [xk, wv]
    in_specs = [
        pl.BlockSpec((bm, step), lambda j, t, kk, te, tb, lo, hi: (tb[t], kk)),
        pl.BlockSpec((None, step_rows, bn), lambda j, t, kk, te, tb, lo, hi: (te[t], kk, j)),
    ]
    if fmt == "w8a8":
        args.append(block_sizes.pad_axis(w.scales, 2, n_pad))
        in_specs.append(pl.BlockSpec((None, 1, bn), lambda j, t, kk, te, tb, lo, hi: (te[t], 0, j)))
    elif packed:
        scales = block_sizes.pad_axis(w.scales, 2, n_pad)
        args.append(scales.reshape(scales.shape[0], scales.shape[1], 1, n_pad))
        in_specs.append(
            pl.BlockSpec(
                (None, step // w.group_size, 1, bn), lambda j, t, kk, te, tb, lo, hi: (te[t], kk, 0, j)
            )
        )
    if sx is not None:
        args.append(block_sizes.pad_axis(sx, 0, m_pad))
        in_specs.append(pl.BlockSpec((bm, 1), lambda j, t, kk, te, tb, lo, hi: (tb[t], 0)))

    kernel = functools.partial(
        _kernel, fmt=fmt, group_size=w.group_size, step_k=step, block_m=bm, cdt=compute_dtype(x.dtype, w)
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n_pad // bn, num_tiles, k_pad // step),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda j, t, kk, te, tb, lo, hi: (tb[t], j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), acc_dtype(fmt))],
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype),
        grid_spec=grid_spec,
        interpret=interpret_params() if interpret else False,
        compiler_params=compiler_params(PARALLEL, ARBITRARY, ARBITRARY),
        name=f"qarl_{fmt}_grouped_matmul_tpu",
    )(*tiles, *args)
    return out[:m, : w.n]
