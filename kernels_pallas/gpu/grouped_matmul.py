"""Batch-invariant grouped (MoE experts) quantized matmul for GPUs: Pallas on the Triton backend.

Rows of ``x`` are sorted by expert in contiguous groups (``group_sizes[e]`` rows for expert e,
dropless, static shapes). The launch grid walks a static work list of (expert, row block) tiles
(``block_sizes.group_tiles``); a tile computes its whole row block against its expert's weights
with the dense kernel's K loop (``gpu.matmul.accumulate``) and stores only its expert's rows
(masked store). A row is therefore computed by the same program, with the same tile shapes and K
order, whatever the group sizes, the number of rows, or its neighbours: bitwise invariant.
The dense tiling is used without its split-K (``split_k`` is ignored here: the expert work list
already gives the launch many programs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import block_sizes, formats
from kernels_pallas.gpu import compiler_params
from kernels_pallas.gpu.matmul import Tiling, accumulate, compute_dtype, configure, finish, prepare_x


def _kernel(*refs, fmt: str, k: int, group_size: int, tiling: Tiling, cdt):
    has_scales = formats.WEIGHT_BITS[fmt] is not None
    int_act = formats.ACT_BITS[fmt] == 8
    te_ref, tb_ref, tlo_ref, thi_ref, x_ref, w_ref, *rest = refs
    s_ref = rest.pop(0) if has_scales else None
    sx_ref = rest.pop(0) if int_act else None
    _, o_ref = rest  # rest[0] is the zero-filled output it aliases
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
        s_w = s_ref[e, pl.ds(0, 1), :] if fmt == "w8a8" else None
        s_x = sx_ref[pl.ds(row0, block_m), :] if int_act else None
        y = finish(acc, fmt, s_w, s_x).astype(o_ref.dtype)
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
        pltriton.store(o_ref.at[pl.ds(row0, block_m), :], y, mask=(rows >= lo) & (rows < hi))


@functools.partial(
    jax.jit,
    static_argnames=(
        "out_dtype", "interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages",
        "swap_ab", "int_dot",
    ),
)  # fmt: skip
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
    num_warps: int | None = None,
    num_stages: int | None = None,
    swap_ab: bool | None = None,
    int_dot: str | None = None,
) -> jax.Array:
    """``out[r] = x[r] @ w[e(r)]`` for rows sorted by expert; ``w`` is [E, K, N] in any format,
    ``group_sizes`` int32 [E]. Rows past ``sum(group_sizes)`` come out zero. Block sizes as in
    ``gpu.matmul.matmul`` (from (K, N) only)."""
    block_sizes.check_operands(x, w, experts=True)
    if group_sizes.ndim != 1 or group_sizes.shape[0] != w.values.shape[0]:
        raise ValueError(f"group_sizes must be [E={w.values.shape[0]}], got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")
    fmt = w.fmt
    t = configure(
        w, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
        num_stages=num_stages, split_k=1, swap_ab=swap_ab, int_dot=int_dot,
    )  # fmt: skip
    bm, bn, n_pad, k_pad = t.block_m, t.block_n, t.n_pad, t.k_pad
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m = x.shape[0]
    m_pad = block_sizes.round_up(max(m, 1), bm)
    tiles = block_sizes.group_tiles(group_sizes, m, bm)
    num_tiles = tiles[0].shape[0]

    xk, sx = prepare_x(x, fmt)
    xk = block_sizes.pad_axis(block_sizes.pad_axis(xk, 0, m_pad), 1, k_pad)
    wv = w.values
    if formats.WEIGHT_BITS[fmt] != 4:
        wv = block_sizes.pad_axis(wv, 1, k_pad)
    wv = block_sizes.pad_axis(wv, 2, n_pad)
    n_exp, k_rows = wv.shape[:2]
    args = [*tiles, xk, wv]
    whole = lambda shape: pl.BlockSpec(shape, lambda t, j: (0,) * len(shape))
    in_specs = [whole((num_tiles,))] * 4 + [
        whole((m_pad, k_pad)),
        pl.BlockSpec((n_exp, k_rows, bn), lambda t, j: (0, 0, j)),
    ]
    if w.scales is not None:
        scales = block_sizes.pad_axis(w.scales, 2, n_pad)
        args.append(scales)
        in_specs.append(pl.BlockSpec((n_exp, scales.shape[1], bn), lambda t, j: (0, 0, j)))
    if sx is not None:
        args.append(block_sizes.pad_axis(sx, 0, m_pad))
        in_specs.append(whole((m_pad, 1)))
    out_spec = pl.BlockSpec((m_pad, bn), lambda t, j: (0, j))
    args.append(jnp.zeros((m_pad, n_pad), out_dtype))
    in_specs.append(out_spec)

    kernel = functools.partial(
        _kernel,
        fmt=fmt,
        k=k_pad,
        group_size=w.group_size,
        tiling=t,
        cdt=compute_dtype(x.dtype, w),
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype),
        grid=(num_tiles, n_pad // bn),
        in_specs=in_specs,
        out_specs=out_spec,
        input_output_aliases={len(args) - 1: 0},
        interpret=interpret,
        compiler_params=compiler_params(t.num_warps, t.num_stages),
        name=f"qarl_{fmt}_grouped_matmul",
    )(*args)
    return out[:m, : w.n]
