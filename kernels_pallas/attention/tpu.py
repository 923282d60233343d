"""Invariant attention for TPUs (Pallas Mosaic); the contract is :mod:`kernels_pallas.attention`'s.
Compiled by the TPU compiler (no chip here) and interpreter-checked; no TPU has run it.

One program per (sequence row, KV head, query token): the token's G query heads walk its own key
blocks ``starts + [j * block_kv, (j + 1) * block_kv)`` for ``j = 0 .. position // block_kv`` with
the online softmax, ascending, exactly as the CPU and GPU paths do. Nothing in the program depends
on the batch, on T or on the cache length, so a token gets the same bits in a packed training row
and in a decode step.

Mosaic specifics. Tiles are (8, 128): q's G heads are padded to a multiple of 8 sublanes and the
head size to a multiple of 128 lanes (zeros: they add exact zeros to the dots). A key block starts
at an arbitrary key index (the segment start), which Mosaic cannot slice directly; the kernel loads
the aligned window around it and rotates it into place (``pltpu.roll``, a dynamic shift), for K and
V along sublanes and for the key segment ids, kept as one lane row per sequence, along lanes. The
per-token position, start and segment id are scalar-prefetched into SMEM, and so are S, T and the
layer: K and V come as a stack of layers [L, B, KV, S_pad, D_pad] whose index maps read the layer
from SMEM, so a decode step hands the kernel the KV cache as it lies (:func:`cached_attention`:
no per-layer slice, transpose or pad by XLA) and the training forward its K/V as a stack of one
(layer 0). K and V rows for one (row, KV head) stay in VMEM while T advances (their block index
does not change), which bounds the cache length by VMEM (about S * D_pad * 8 bytes for bf16 K and
V, double-buffered).

One program for training, prefill and decode. The grid is (B, KV, T), and S and T reach the body
only as SMEM scalars, so the one thing that tells a decode step's kernel (T = 1 against the cache,
S = the cache length) from the training forward's (T = S = the row) in the compiled Mosaic body is
the key extent S_pad of the K, V and key-segment blocks (:data:`EXTENT_AXES`), the size of the VMEM
buffer those rows are copied into. It cannot change a row's arithmetic: the body never reads a
block whole, only windows of ``block_kv + 16`` rows (K, V) and ``128 + block_kv`` lanes (segment
ids) at data-dependent offsets, of static shapes that depend on ``block_kv`` and D alone; the loop
runs ``position // block_kv + 1`` times, a datum; keys at or past S are masked by comparison with
the SMEM scalar. So ``qarl_jax.tools.tpu_compile.mosaic_kernels`` digests the body with exactly
those three extents abstracted (and the grid and SMEM lengths, as for every kernel): a decode step,
a prefill and a training forward show as one kernel, and another ``block_kv`` (other window and
dot shapes) as another.
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._mosaic import LANES, PARALLEL, SUBLANES, compiler_params, cost, interpret_mode, mxu_dot
from kernels_pallas._tiling import pad_axis, round_up
from kernels_pallas.attention.common import MASK, Visibility, normalise, online_softmax_step, token_ids

_ALIGN = 16  # sublane alignment of the K/V window loads (a bf16 tile is 16 rows)
# the blocks' axes that hold the key extent S_pad, by block (q, K, V, key segments, output): the
# only extents in the compiled body (the module doc says why they cannot change a row's bits)
EXTENT_AXES: Final = {1: 3, 2: 3, 3: 2}


def _shift(r: jax.Array, size: int) -> jax.Array:
    """The rotation in [0, size) that brings element ``r`` to 0 (offsets are never negative, so
    truncating division and no sign handling: Mosaic lowers neither ``//`` nor ``%`` on signed ints
    without a target-specific rule)."""
    return jnp.where(r == 0, 0, size - r)


def _window(ref, off: jax.Array, rows: int) -> jax.Array:
    """``ref[off : off + rows]`` (rows of an f32 view) for an unaligned ``off``: an aligned load,
    then a dynamic sublane rotation."""
    base = pl.multiple_of(lax.div(off, _ALIGN) * _ALIGN, _ALIGN)
    w = rows + _ALIGN
    x = ref[pl.ds(base, w), :].astype(jnp.float32)
    return pltpu.roll(x, _shift(off - base, w), 0)[:rows]


def _lane_window(ref, off: jax.Array, width: int, lanes: int) -> jax.Array:
    """``ref[:, off : off + width]`` of a one-row int32 ref, by an aligned load and a lane rotation."""
    base = pl.multiple_of(lax.div(off, LANES) * LANES, LANES)
    x = ref[:, pl.ds(base, lanes)]
    return pltpu.roll(x, _shift(off - base, lanes), 1)[:, :width]


def _kernel(pos_ref, st_ref, seg_ref, len_ref, q_ref, k_ref, v_ref, kseg_ref, o_ref, *, block_kv, scale):
    s, t = len_ref[0], len_ref[1]  # operands, not constants: see "One program" above
    i = pl.program_id(0) * t + pl.program_id(2)
    pos, start, seg = pos_ref[i], st_ref[i], seg_ref[i]
    q = q_ref[...].astype(jnp.float32)
    gp = q.shape[0]
    lanes = LANES + round_up(block_kv, LANES)

    def step(j, carry):
        off = start + j * block_kv
        kb = _window(k_ref, off, block_kv)
        vb = _window(v_ref, off, block_kv)
        kseg = _lane_window(kseg_ref, off, block_kv, lanes)  # [1, block_kv]
        rel = j * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        valid = (rel <= pos) & (start + rel < s) & (kseg == seg)
        sc = mxu_dot(q, kb, jnp.float32, (((1,), (1,)), ((), ())))

        def pv(p):  # the probabilities in V's dtype, as on CPU/GPU
            pc = p.astype(v_ref.dtype).astype(jnp.float32)
            return mxu_dot(pc, vb, jnp.float32)

        return online_softmax_step(carry, sc, valid, scale, pv, keepdims=True)

    init = (
        jnp.full((gp, 1), MASK, jnp.float32),
        jnp.zeros((gp, 1), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    _, denom, acc = lax.fori_loop(0, lax.div(pos, block_kv) + 1, step, init)
    o_ref[...] = normalise(acc, denom, keepdims=True).astype(o_ref.dtype)


def _vmem_bytes(k: jax.Array, s_pad: int, dp: int) -> int:
    """VMEM for one program: K and V of its (row, KV head) resident and double-buffered, plus 16 MiB
    for the rest (windows, q, the output). Mosaic's default scoped limit (16-32 MiB) refused a
    16,896-token cache (Qwen3-8B at 16k on a v5p: 17.3 MB of K and V); past the chip's VMEM the
    compiler still says no, in one line."""
    return 2 * 2 * s_pad * dp * jnp.dtype(k.dtype).itemsize + (16 << 20)


def cache_length(max_len: int, block_kv: int) -> int:
    """Positions a slot's cache holds in :func:`cached_attention`'s layout for ``max_len`` usable
    ones: room for the last K/V window of a query at ``max_len - 1`` (it ends before
    ``max_len - 1 + block_kv + 16``), a multiple of the bf16 sublane tile."""
    return round_up(max_len + block_kv + _ALIGN, _ALIGN)


def _key_extent(s: int, block_kv: int) -> int:
    """Key positions a training row's K/V (and any call's key segment ids) are padded to: room for
    the last window of any token whose own key is in range (``starts + positions < s``)."""
    return round_up(s, LANES) + LANES + round_up(block_kv, LANES)


@functools.partial(jax.jit, static_argnames=("block_kv", "interpret"))
def attention(
    q, k, v, positions, starts, segment_ids, kv_segment_ids, *, block_kv, interpret=False
) -> jax.Array:
    """q [B,T,H,D], k/v [B,S,KV,D] -> [B,T,H,D] (layout as :func:`kernels_pallas.attention.attention`).
    K and V are laid out as :func:`cached_attention` reads a cache, a stack of one layer, and run
    through the same program with layer 0."""
    d, s = q.shape[3], k.shape[1]
    _check_block(block_kv)
    s_pad, dp = _key_extent(s, block_kv), round_up(d, LANES)

    def keys(a):  # [B, S, KV, D] -> [1, B, KV, S_pad, D_pad]
        return pad_axis(pad_axis(a.transpose(0, 2, 1, 3), 2, s_pad), 3, dp)[None]

    ids = Visibility(positions, starts, segment_ids, kv_segment_ids)
    return _call(q, keys(k), keys(v), jnp.int32(0), ids, s, block_kv, interpret)


@functools.partial(jax.jit, static_argnames=("length", "block_kv", "interpret"))
def cached_attention(q, k_cache, v_cache, layer, positions, *, length, block_kv, interpret=False):
    """q [B,T,H,D] against layer ``layer`` (an int32 scalar) of a stacked cache k/v
    [L, B, KV, S, D_pad] (``S = cache_length(length, block_kv)``, D_pad the head size rounded up to
    128 lanes; the KV-cache visibility: key index = position, keys at or past ``length`` masked) ->
    [B,T,H,D]. The stack goes to the kernel as it is: the layer is a scalar-prefetched operand its
    K/V index maps read, so XLA copies, transposes and pads nothing."""
    _check_block(block_kv)
    if k_cache.shape[3] < cache_length(length, block_kv) or k_cache.shape[4] % LANES:
        raise ValueError(
            f"cache {k_cache.shape} is not [L, B, KV, >= {cache_length(length, block_kv)}, D_pad] for "
            f"length {length} and block_kv {block_kv}"
        )
    ids = Visibility(positions)
    return _call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), ids, length, block_kv, interpret)


def _check_block(block_kv: int) -> None:
    if block_kv < 1 or block_kv % SUBLANES:
        raise ValueError(f"the TPU attention kernel needs block_kv a multiple of 8, got {block_kv}")


def _call(q, k, v, layer, ids: Visibility, s: int, block_kv: int, interpret: bool) -> jax.Array:
    """The one Mosaic program: q [B,T,H,D] against layer ``layer`` of k/v [L, B, KV, S_k, D_pad],
    keys at or past ``s`` masked; ``ids`` the visibility (positions, starts, segment ids)."""
    b, t, h, d = q.shape
    kvh, s_k, dp = k.shape[2], k.shape[3], k.shape[4]
    g = h // kvh
    gp = round_up(g, SUBLANES)
    s_seg = _key_extent(s, block_kv)  # the key segment ids' lane windows
    qg = pad_axis(pad_axis(q.reshape(b, t, kvh, g, d), 3, gp), 4, dp)
    pos, st, seg, kseg = token_ids(ids.positions, ids.starts, ids.segment_ids, ids.kv_segment_ids, s, s_seg)
    lengths = jnp.stack([jnp.int32(s), jnp.int32(t), layer])  # the layer: read by K/V's index maps
    scalars = (pos.reshape(-1), st.reshape(-1), seg.reshape(-1), lengths)
    kv_spec = pl.BlockSpec((None, None, None, s_k, dp), lambda i, n, j, *r: (r[3][2], i, n, 0, 0))
    tok_spec = pl.BlockSpec((None, None, None, gp, dp), lambda i, n, j, *_: (i, j, n, 0, 0))
    kseg_spec = pl.BlockSpec((None, 1, s_seg), lambda i, n, j, *_: (i, 0, 0))
    out_shape = jax.ShapeDtypeStruct(qg.shape, q.dtype)
    specs, operands = [tok_spec, kv_spec, kv_spec, kseg_spec], [qg, k, v, kseg[:, None, :]]
    out = pl.pallas_call(
        functools.partial(_kernel, block_kv=block_kv, scale=d**-0.5),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(b, kvh, t),
            in_specs=specs,
            out_specs=tok_spec,
        ),
        interpret=interpret_mode(interpret),
        compiler_params=compiler_params(PARALLEL, PARALLEL, PARALLEL, vmem_bytes=_vmem_bytes(k, s_k, dp)),
        name="qarl_attention_tpu",
        # every query against every key at most (causal masking skips about half): QK^T and PV
        cost_estimate=cost(
            4 * b * t * h * s * d,
            (b, kvh, t),
            [*specs, tok_spec],
            [*operands, out_shape],
            transcendentals=b * t * h * s,
            prefetch=scalars,
        ),
    )(*scalars, *operands)
    return out[:, :, :, :g, :d].reshape(b, t, h, d)
