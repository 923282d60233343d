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

Why the rows are invariant: the tile shape (block_m, block_n, block_k), warps and stages come from
(K, N) and the format only (``block_sizes.gpu_blocks``), rows are padded to block_m, and the K
loop runs in a fixed ascending order inside one program with no split-K. M only changes how many
identical programs are launched, so row r's bits do not depend on M or on its neighbours.
f32 activations use IEEE dots (precision=HIGHEST; Triton would otherwise use TF32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import block_sizes, formats
from kernels_pallas.gpu import compiler_params

_MIN_TILE = 16  # smallest Triton dot dimension


def _dot(a: jax.Array, b: jax.Array, acc_dtype) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=acc_dtype, precision=lax.Precision.HIGHEST)


def compute_dtype(x_dtype, w: formats.QuantizedWeight):
    """The dtype both dot operands are cast to."""
    if formats.ACT_BITS[w.fmt] == 8:
        return jnp.int8
    if formats.WEIGHT_BITS[w.fmt] is None:
        return jnp.promote_types(x_dtype, w.values.dtype)
    return jnp.dtype(x_dtype)


def accumulate(
    load_x: Callable[[jax.Array | int, int], jax.Array],
    load_w: Callable[[jax.Array | int, int], jax.Array],
    load_s: Callable[[jax.Array | int], jax.Array] | None,
    *,
    fmt: str,
    k: int,
    group_size: int,
    block_k: int,
    block_shape: tuple[int, int],
    cdt,
) -> jax.Array:
    """One output tile's K reduction, ascending K. ``load_x(col, width)`` reads activation
    columns, ``load_w(row, rows)`` stored weight rows (packed rows for 4-bit), ``load_s(g)`` the
    [1, block_n] scales of group g. Returns f32 (float formats, 4-bit) or int32 (w8a8) [bm, bn]."""
    bits = formats.WEIGHT_BITS[fmt]
    int_act = formats.ACT_BITS[fmt] == 8
    part_dtype = jnp.int32 if int_act else jnp.float32
    if bits != 4:
        steps = k // block_k

        def body(i, acc):
            xs = load_x(i * block_k, block_k).astype(cdt)
            ws = load_w(i * block_k, block_k).astype(cdt)
            return acc + _dot(xs, ws, part_dtype)

        return lax.fori_loop(0, steps, body, jnp.zeros(block_shape, part_dtype))

    half = group_size // 2
    chunk = min(half, block_k // 2)  # packed rows per inner step
    chunks = half // chunk

    def group(g, acc):
        def inner(c, part):
            p = load_w(g * half + c * chunk, chunk)
            lo = (jnp.left_shift(p, 4) >> 4).astype(cdt)
            hi = (p >> 4).astype(cdt)
            x_lo = load_x(g * group_size + c * chunk, chunk).astype(cdt)
            x_hi = load_x(g * group_size + half + c * chunk, chunk).astype(cdt)
            return part + _dot(x_lo, lo, part_dtype) + _dot(x_hi, hi, part_dtype)

        part = lax.fori_loop(0, chunks, inner, jnp.zeros(block_shape, part_dtype))
        return acc + part.astype(jnp.float32) * load_s(g)

    return lax.fori_loop(0, k // group_size, group, jnp.zeros(block_shape, jnp.float32))


def finish(acc: jax.Array, fmt: str, s_w: jax.Array | None, s_x: jax.Array | None) -> jax.Array:
    """Apply the scales that sit outside the K loop: w8a8 (acc * s_x) * s_w, w4a8 acc * s_x."""
    if fmt == "w8a8":
        return (acc.astype(jnp.float32) * s_x) * s_w
    if fmt == "w4a8":
        return acc * s_x
    return acc


def _kernel(*refs, fmt: str, k: int, group_size: int, block_k: int, cdt):
    has_scales = formats.WEIGHT_BITS[fmt] is not None
    int_act = formats.ACT_BITS[fmt] == 8
    x_ref, w_ref, *rest = refs
    s_ref = rest.pop(0) if has_scales else None
    sx_ref = rest.pop(0) if int_act else None
    (o_ref,) = rest
    acc = accumulate(
        lambda c, n: x_ref[:, pl.ds(c, n)],
        lambda r, n: w_ref[pl.ds(r, n), :],
        (lambda g: s_ref[pl.ds(g, 1), :]) if has_scales else None,
        fmt=fmt,
        k=k,
        group_size=group_size,
        block_k=block_k,
        block_shape=o_ref.shape,
        cdt=cdt,
    )
    s_w = s_ref[...] if fmt == "w8a8" else None
    s_x = sx_ref[...] if int_act else None
    o_ref[...] = finish(acc, fmt, s_w, s_x).astype(o_ref.dtype)


def plan(w: formats.QuantizedWeight, blocks: block_sizes.Blocks) -> tuple[int, int, int, int]:
    """(block_n, padded N, block_k, padded K) for the Triton kernel; raises on a group size that
    cannot be tiled in powers of two."""
    k, n = w.k, w.n
    for name, v in (("block_m", blocks.block_m), ("block_n", blocks.block_n), ("block_k", blocks.block_k)):
        if v < _MIN_TILE or v & (v - 1):
            raise ValueError(f"Triton needs power-of-two tiles >= {_MIN_TILE}; got {name}={v}")
    block_n, n_pad = block_sizes.fit_block(n, blocks.block_n, _MIN_TILE)
    if formats.WEIGHT_BITS[w.fmt] == 4:
        half = w.group_size // 2
        if half < _MIN_TILE or half & (half - 1):
            raise ValueError(
                f"the GPU kernel needs a power-of-two int4 group size >= {2 * _MIN_TILE}; got {w.group_size}"
            )
        return block_n, n_pad, blocks.block_k, k
    block_k, k_pad = block_sizes.fit_block(k, blocks.block_k, 2 * _MIN_TILE)
    return block_n, n_pad, block_k, k_pad


def prepare_x(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array | None]:
    """Activations as the kernel reads them: per-token int8 plus f32 scales for the a8 formats."""
    if formats.ACT_BITS[fmt] == 8:
        return formats.quantize_activations(x)
    return x, None


@functools.partial(
    jax.jit,
    static_argnames=("out_dtype", "interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages"),
)
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
) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in ``w.fmt``, rows bitwise independent of M.

    Block sizes default to ``block_sizes.gpu_blocks(fmt, K, N)``; pass the same overrides for every
    M or the invariance is lost. ``interpret=True`` runs the kernel in Pallas' interpreter (CPU)."""
    block_sizes.check_operands(x, w)
    fmt = w.fmt
    blocks = block_sizes.resolve(block_sizes.gpu_blocks(fmt, w.k, w.n), block_m, block_n, block_k)
    bn, n_pad, bk, k_pad = plan(w, blocks)
    bm = blocks.block_m
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m = x.shape[0]
    m_pad = block_sizes.round_up(max(m, 1), bm)

    xk, sx = prepare_x(x, fmt)
    xk = block_sizes.pad_axis(block_sizes.pad_axis(xk, 0, m_pad), 1, k_pad)
    wv = block_sizes.pad_axis(
        block_sizes.pad_axis(w.values, 0, k_pad if fmt in ("bf16", "w8a8") else w.values.shape[0]), 1, n_pad
    )
    k_rows = wv.shape[0]
    args = [xk, wv]
    in_specs = [
        pl.BlockSpec((bm, k_pad), lambda i, j: (i, 0)),
        pl.BlockSpec((k_rows, bn), lambda i, j: (0, j)),
    ]
    if w.scales is not None:
        scales = block_sizes.pad_axis(w.scales, 1, n_pad)
        args.append(scales)
        in_specs.append(pl.BlockSpec((scales.shape[0], bn), lambda i, j: (0, j)))
    if sx is not None:
        args.append(block_sizes.pad_axis(sx, 0, m_pad))
        in_specs.append(pl.BlockSpec((bm, 1), lambda i, j: (i, 0)))

    kernel = functools.partial(
        _kernel, fmt=fmt, k=k_pad, group_size=w.group_size, block_k=bk, cdt=compute_dtype(x.dtype, w)
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype),
        grid=(m_pad // bm, n_pad // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=compiler_params(num_warps or blocks.num_warps, num_stages or blocks.num_stages),
        name=f"qarl_{fmt}_matmul",
    )(*args)
    return out[:m, : w.n]
