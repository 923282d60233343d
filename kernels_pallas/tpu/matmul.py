"""Batch-invariant quantized matmul for TPUs: Pallas Mosaic. Lowering- and interpreter-checked only.

Grid (row blocks, column blocks, K steps); the K axis is 'arbitrary', so Mosaic runs it in
ascending order, accumulating into a VMEM scratch tile that is written out at the last step.

  bf16   MXU dot, f32 accumulation.
  w8a8   per-token int8 activations (``formats.quantize_activations``, row-wise, outside the
         kernel), int8 x int8 -> int32 on the MXU (exact), y = (acc * s_x) * s_w at the last step.
  w4a16  a K step holds whole quantization groups; each group's packed rows are unpacked in VMEM
         (widened to int32, two arithmetic shifts, "group halves" layout), dotted in the
         activation dtype with f32 accumulation, and scaled inside the K loop: acc += part * s_g.
  w4a8   the same with int8 activations and an int32 partial per group.

Rows are invariant because every block size comes from (K, N) and the format
(``block_sizes.tpu_blocks``), never from M; M only sets how many row blocks the grid has.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import block_sizes, formats
from kernels_pallas.tpu import ARBITRARY, PARALLEL, compiler_params, interpret_params

_LANES = 128


def _dot(a: jax.Array, b: jax.Array, acc_dtype) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=acc_dtype, precision=lax.Precision.HIGHEST)


def compute_dtype(x_dtype, w: formats.QuantizedWeight):
    """The dtype both dot operands are cast to."""
    if formats.ACT_BITS[w.fmt] == 8:
        return jnp.int8
    if formats.WEIGHT_BITS[w.fmt] is None:
        return jnp.promote_types(x_dtype, w.values.dtype)
    return jnp.dtype(x_dtype)


def accumulate_step(x_ref, w_ref, s_ref, acc_ref, *, fmt: str, group_size: int, step_k: int, cdt) -> None:
    """Add one K step's product into ``acc_ref`` (groups within the step in ascending order)."""
    if formats.WEIGHT_BITS[fmt] != 4:
        part_dtype = acc_ref.dtype
        acc_ref[...] += _dot(x_ref[...].astype(cdt), w_ref[...].astype(cdt), part_dtype)
        return
    part_dtype = jnp.int32 if formats.ACT_BITS[fmt] == 8 else jnp.float32
    half = group_size // 2
    for g in range(step_k // group_size):
        p = w_ref[g * half : (g + 1) * half, :].astype(jnp.int32)
        lo = jnp.right_shift(jnp.left_shift(p, 28), 28).astype(cdt)
        hi = jnp.right_shift(p, 4).astype(cdt)
        x_lo = x_ref[:, g * group_size : g * group_size + half].astype(cdt)
        x_hi = x_ref[:, g * group_size + half : (g + 1) * group_size].astype(cdt)
        part = _dot(x_lo, lo, part_dtype) + _dot(x_hi, hi, part_dtype)
        acc_ref[...] += part.astype(jnp.float32) * s_ref[g]


def finish(acc: jax.Array, fmt: str, s_w: jax.Array | None, s_x: jax.Array | None) -> jax.Array:
    """The scales outside the K loop: w8a8 (acc * s_x) * s_w, w4a8 acc * s_x."""
    if fmt == "w8a8":
        return (acc.astype(jnp.float32) * s_x) * s_w
    if fmt == "w4a8":
        return acc * s_x
    return acc


def acc_dtype(fmt: str):
    return jnp.int32 if fmt == "w8a8" else jnp.float32


def plan(w: formats.QuantizedWeight, blocks: block_sizes.Blocks) -> tuple[int, int, int, int]:
    """(block_n, padded N, K per step, padded K) for Mosaic's (sublane, 128-lane) tiling."""
    if blocks.block_m % 32 or blocks.block_n % _LANES or blocks.block_k % _LANES:
        raise ValueError(f"Mosaic tiles need block_m % 32 == 0 and block_n, block_k % 128 == 0; got {blocks}")
    block_n, n_pad = blocks.block_n, block_sizes.round_up(w.n, blocks.block_n)
    if w.n <= blocks.block_n:
        block_n = n_pad = block_sizes.round_up(w.n, _LANES)
    if formats.WEIGHT_BITS[w.fmt] == 4:
        g = w.group_size
        if g % 64:
            raise ValueError(f"the TPU kernel needs an int4 group size that is a multiple of 64; got {g}")
        # whole groups per step, a whole number of 128-lane tiles (or all of K)
        fits = [s for s in range(g, max(g, blocks.block_k) + 1, g) if w.k % s == 0 and s % _LANES == 0]
        return block_n, n_pad, max(fits, default=w.k), w.k
    step = min(blocks.block_k, block_sizes.round_up(w.k, _LANES))
    return block_n, n_pad, step, block_sizes.round_up(w.k, step)


def prepare_x(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array | None]:
    if formats.ACT_BITS[fmt] == 8:
        return formats.quantize_activations(x)
    return x, None


def _kernel(*refs, fmt: str, group_size: int, step_k: int, cdt):
    has_scales = formats.WEIGHT_BITS[fmt] is not None
    int_act = formats.ACT_BITS[fmt] == 8
    x_ref, w_ref, *rest = refs
    s_ref = rest.pop(0) if has_scales else None
    sx_ref = rest.pop(0) if int_act else None
    o_ref, acc_ref = rest
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    accumulate_step(x_ref, w_ref, s_ref, acc_ref, fmt=fmt, group_size=group_size, step_k=step_k, cdt=cdt)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        s_w = s_ref[...] if fmt == "w8a8" else None
        s_x = sx_ref[...] if int_act else None
        o_ref[...] = finish(acc_ref[...], fmt, s_w, s_x).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_m", "block_n", "block_k"))
def matmul(
    x: jax.Array,
    w: formats.QuantizedWeight,
    *,
    out_dtype=None,
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in ``w.fmt``, rows bitwise independent of M.

    Blocks default to ``block_sizes.tpu_blocks(fmt, K, N)``; ``interpret=True`` runs Pallas' TPU
    interpreter on CPU."""
    block_sizes.check_operands(x, w)
    fmt = w.fmt
    blocks = block_sizes.resolve(block_sizes.tpu_blocks(fmt, w.k, w.n), block_m, block_n, block_k)
    bn, n_pad, step, k_pad = plan(w, blocks)
    bm = blocks.block_m
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m = x.shape[0]
    m_pad = block_sizes.round_up(max(m, 1), bm)
    packed = formats.WEIGHT_BITS[fmt] == 4
    step_rows = step // 2 if packed else step

    xk, sx = prepare_x(x, fmt)
    xk = block_sizes.pad_axis(block_sizes.pad_axis(xk, 0, m_pad), 1, k_pad)
    wv = w.values if packed else block_sizes.pad_axis(w.values, 0, k_pad)
    wv = block_sizes.pad_axis(wv, 1, n_pad)
    args = [xk, wv]
    in_specs = [
        pl.BlockSpec((bm, step), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((step_rows, bn), lambda i, j, kk: (kk, j)),
    ]
    if fmt == "w8a8":
        args.append(block_sizes.pad_axis(w.scales, 1, n_pad))
        in_specs.append(pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)))
    elif packed:
        scales = block_sizes.pad_axis(w.scales, 1, n_pad)
        args.append(scales.reshape(scales.shape[0], 1, n_pad))
        in_specs.append(pl.BlockSpec((step // w.group_size, 1, bn), lambda i, j, kk: (kk, 0, j)))
    if sx is not None:
        args.append(block_sizes.pad_axis(sx, 0, m_pad))
        in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, kk: (i, 0)))

    kernel = functools.partial(
        _kernel, fmt=fmt, group_size=w.group_size, step_k=step, cdt=compute_dtype(x.dtype, w)
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype),
        grid=(m_pad // bm, n_pad // bn, k_pad // step),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), acc_dtype(fmt))],
        interpret=interpret_params() if interpret else False,
        compiler_params=compiler_params(PARALLEL, PARALLEL, ARBITRARY),
        name=f"qarl_{fmt}_matmul_tpu",
    )(*args)
    return out[:m, : w.n]
