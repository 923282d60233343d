"""The Mosaic kernels' ``pl.CostEstimate`` bytes against what their block specs actually move.

``kernels_pallas._mosaic.block_bytes`` counts a block's copies in closed form (from the grid axes
its index map reads); here the same is counted the slow way, by stepping every grid cell in
Pallas' order and evaluating each index map, a copy wherever a block's index changes. The two must
agree exactly on the kernels whose index maps are one-to-one (matmul in every format, attention,
RMSNorm, RoPE, log-sum-exp); the grouped matmul's estimate (its tile lists are data) is an upper
bound of what a real routing moves. Small shapes, traced only (no compile): seconds.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.state.discharge import discharge_state

import kernels_pallas as kp
from kernels_pallas import FORMATS
from kernels_pallas.attention import attention, cache_layout, cached_attention
from kernels_pallas.formats import WEIGHT_BITS
from kernels_pallas.grouped.common import group_tiles
from kernels_pallas.rowwise import rms_norm, rope, token_logprobs
from qarl_jax.tools.tpu_compile import tpu_kernels

BF = jnp.bfloat16


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        else:
            for sub in jex.core.jaxprs_in_params(eqn.params):
                yield from _pallas_calls(sub)


def _extent(d) -> int:
    """A block dimension's extent: squeezed (None) 1, a Blocked its size."""
    return d if isinstance(d, int) else getattr(d, "block_size", 1)


def _stepped_bytes(eqn, prefetch) -> int:
    """Bytes copied in and out, stepping the grid (last axis fastest) and evaluating index maps."""
    gm = eqn.params["grid_mapping"]
    total = 0
    for bm in gm.block_mappings:
        block = math.prod(_extent(d) for d in bm.block_shape)
        # the prefetched lists are refs in the index map: read as values (their final values
        # follow the index among the outputs)
        pure = discharge_state(bm.index_map_jaxpr)
        jaxpr, consts = pure.jaxpr, pure.consts
        outputs = len(bm.index_map_jaxpr.jaxpr.outvars)
        copies, previous = 0, None
        for cell in itertools.product(*(range(g) for g in gm.grid)):
            index = jax.core.eval_jaxpr(jaxpr, consts, *map(np.int32, cell), *prefetch)[:outputs]
            index = tuple(int(i) for i in index)
            copies += index != previous
            previous = index
        total += copies * block * bm.array_aval.dtype.itemsize
    return total


def _check(fn, *args, prefetch=None, exact=True) -> None:
    with tpu_kernels():
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    (eqn,) = list(_pallas_calls(jaxpr))
    estimate = eqn.params["cost_estimate"].bytes_accessed
    gm = eqn.params["grid_mapping"]  # prefetched lists no index map reads: zeros
    zeros = [np.zeros(a.shape, a.dtype) for a in gm.index_map_avals[len(gm.grid) :]]
    moved = _stepped_bytes(eqn, zeros if prefetch is None else prefetch)
    assert estimate == moved if exact else moved <= estimate, (estimate, moved)


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_estimate_is_what_its_blocks_move(fmt):
    """Grid (2, 2, K steps): x re-read for each column block, w for each row block."""
    master = BF if fmt == "bf16" else jnp.float32
    w = kp.quantize(jnp.zeros((512, 384), master), fmt, 128 if WEIGHT_BITS[fmt] == 4 else None)
    _check(lambda x, w: kp.quantized_matmul(x, w, block_m=32), jnp.zeros((64, 512), BF), w)


def test_attention_estimate_is_what_its_blocks_move():
    """K and V of a (row, KV head) once, padded to S_pad x D_pad; q and out per token."""
    q, k = jnp.zeros((2, 16, 4, 64), BF), jnp.zeros((2, 48, 2, 64), BF)
    _check(attention, q, k, k, jnp.zeros((2, 16), jnp.int32))
    # a decode step over the TPU cache layout: one layer's K and V of each (slot, KV head), in place
    layout = cache_layout(48, 64, backend="tpu")
    stack = jnp.zeros(layout.shape(3, 2, 2), BF)
    one = jnp.zeros((2, 1), jnp.int32)
    _check(lambda q, c: cached_attention(q, c, c, jnp.int32(1), one, layout), q[:, :1], stack)


def test_rowwise_estimates_are_what_their_blocks_move():
    x = jnp.zeros((40, 200), BF)
    _check(lambda x, w: rms_norm(x, w, 1e-6), x, jnp.ones((200,), BF))
    _check(lambda x, p: rope(x, p, 1e4, None), jnp.zeros((20, 2, 64), BF), jnp.zeros((20,), jnp.int32))
    _check(lambda x, t: token_logprobs(x, t, 0.7), jnp.zeros((20, 1000), BF), jnp.zeros((20,), jnp.int32))


def test_grouped_estimate_bounds_what_a_routing_moves():
    """Consecutive tiles of one expert share its weight block: a real routing moves at most the
    estimate (every tile's own copy)."""
    sizes = jnp.array([40, 0, 70, 18], jnp.int32)
    x, w = jnp.zeros((128, 256), BF), kp.quantize(jnp.zeros((4, 256, 128)), "w8a8")
    tiles = [np.asarray(t) for t in group_tiles(sizes, 128, 32)]
    _check(lambda x, w, s: kp.grouped_matmul(x, w, s, block_m=32), x, w, sizes, prefetch=tiles, exact=False)
