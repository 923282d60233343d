"""The blockwise attention backward: the dense formula's gradients (GQA, packed segments with
padding, positions/starts, a KV-cache layout, ragged block edges), finite differences, and O(T)
compiled memory (no [T, S] scores)."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import slow_but

from kernels_pallas.attention import Visibility, attention, reference_attention
from kernels_pallas.attention.backward import attention_backward


def _qkv(b, t, s, h=4, kv=2, d=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, h, d))
    k = jax.random.normal(keys[1], (b, s, kv, d))
    v = jax.random.normal(keys[2], (b, s, kv, d))
    return q, k, v, jax.random.normal(keys[3], (b, t, h, d))


def _packed(lens_per_row: list[list[int]], t: int):
    """positions, starts, segment ids [B, T] of rows packing sequences of the given lengths (the
    rest padding, segment 0, positions counting on as the batch builders leave them)."""
    pos, seg = np.zeros((len(lens_per_row), t), np.int32), np.zeros((len(lens_per_row), t), np.int32)
    for r, lens in enumerate(lens_per_row):
        at = 0
        for i, n in enumerate(lens):
            pos[r, at : at + n], seg[r, at : at + n] = np.arange(n), i + 1
            at += n
        pos[r, at:] = np.arange(t - at)
    starts = np.arange(t)[None] - pos
    return jnp.asarray(pos), jnp.asarray(starts), jnp.asarray(seg)


CASES = {
    # name: (q/k/v/g, positions, starts, segment_ids, kv_segment_ids)
    "packed": lambda: (_qkv(2, 37, 37), *_packed([[20, 17], [30]], 37)),
    "one-sequence": lambda: (_qkv(1, 29, 29, h=2, kv=2), jnp.arange(29)[None], None, None),
    "kv-cache": lambda: (_qkv(2, 5, 24), jnp.asarray([[15, 16, 17, 18, 19], [3, 4, 5, 6, 7]]), None, None),
}


def _vjp(f, q, k, v, g):
    """f's output at (q, k, v) and its VJP at g, as one jitted program (op by op, the backward
    compiled dozens of small programs)."""

    def both(q, k, v, g):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(g)

    return jax.jit(both)(q, k, v, g)


@functools.cache
def _dense_vjp(case):
    (q, k, v, g), pos, starts, seg = CASES[case]()
    out, want = _vjp(lambda q, k, v: reference_attention(q, k, v, pos, starts, seg, seg), q, k, v, g)
    return (q, k, v, g, out, pos, starts, seg), want


@pytest.mark.parametrize("blocks", slow_but([(8, 8), (4, 16), (64, 64)], (4, 16), (64, 64)))
def test_blockwise_backward_matches_the_dense_formula(blocks):
    """Two rows packing 20 + 17 and 30 + 7 padding tokens, T = 37: ragged last blocks, a query
    block spanning two sequences, blocks longer than the row."""
    (q, k, v, g, out, pos, starts, seg), want = _dense_vjp("packed")
    bq, bk = blocks
    visibility = Visibility(pos, starts, seg, seg)
    got = jax.jit(lambda *a: attention_backward(*a, visibility, block_q=bq, block_k=bk))(q, k, v, out, g)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("case", slow_but(["one-sequence", "kv-cache"], "one-sequence"))
def test_kernel_custom_vjp_matches_the_dense_formula(case):
    """Through ``attention``'s custom VJP (forward: the invariant kernel; default blocks): one
    unpacked sequence with 2 heads of 2, and 5 queries over a 24-key cache (starts None)."""
    (q, k, v, g, _, pos, starts, seg), want = _dense_vjp(case)
    _, got = _vjp(lambda q, k, v: attention(q, k, v, pos, starts, seg, seg), q, k, v, g)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_bf16_gradients_close_to_f32():
    (q, k, v, g), pos, starts, seg = CASES["packed"]()

    def f(q, k, v):
        return attention(q, k, v, pos, starts, seg, seg)

    want = _vjp(f, q, k, v, g)[1]
    low = [a.astype(jnp.bfloat16) for a in (q, k, v, g)]
    got = _vjp(f, *low)[1]
    for a, b in zip(got, want, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0.05, atol=0.05)


def test_finite_differences():
    """<grad, u> against central differences of sum(sin(attention)) along a random direction."""
    (q, k, v, _), pos, starts, seg = CASES["packed"]()

    @jax.jit
    def loss(q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v, pos, starts, seg, seg)))

    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    dirs = [jax.random.normal(jax.random.key(i + 10), a.shape) for i, a in enumerate((q, k, v))]
    eps = 1e-2
    plus = loss(*(a + eps * u for a, u in zip((q, k, v), dirs, strict=True)))
    minus = loss(*(a - eps * u for a, u in zip((q, k, v), dirs, strict=True)))
    fd = (plus - minus) / (2 * eps)
    analytic = sum(jnp.vdot(gr, u) for gr, u in zip(grads, dirs, strict=True))
    np.testing.assert_allclose(float(analytic), float(fd), rtol=2e-2)


def test_compiled_backward_holds_no_scores_matrix():
    """T = S = 2048: the dense backward's [B, KV, G, T, S] f32 scores alone are 64 MiB; the
    compiled gradient has no array of T x S entries and temporaries under 16 MiB."""
    t = 2048
    q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
    pos = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(q, k, v, pos):
        ones = jnp.ones_like(pos)
        return jnp.sum(attention(q, k, v, pos, jnp.zeros_like(pos), ones, ones))

    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv, pos).compile()
    shapes = re.findall(r"\b(?:f32|bf16|s32|pred)\[([0-9,]+)\]", compiled.as_text())
    assert max(math.prod(int(x) for x in s.split(",")) for s in shapes) < t * t
    assert compiled.memory_analysis().temp_size_in_bytes < 16 * 2**20
