"""Invariant attention (CPU path): float64 reference, and a token's output bitwise the same in a
packed full-sequence call and in decode over KV caches of other lengths and batch sizes. Each
kernel call is its own jitted program (as the rollout's and the training's are); the operands are
numpy arrays, so slicing them compiles nothing (op by op, each slice of a JAX array was a program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import slow_but

from kernels_pallas.attention import attention, reference_attention, reference_attention_f64

H, KV, D = 4, 2, 32


def qkv(b: int, t: int, seed: int = 0, s: int | None = None, heads=(H, KV), d: int = D, dtype=np.float32):
    """Random q [b, t, heads, d], k and v [b, s, kv heads, d] (numpy)."""
    rng = np.random.default_rng(seed)
    s, (h, kv) = s or t, heads
    return tuple(
        rng.standard_normal(shape, np.float32).astype(dtype) for shape in ((b, t, h, d), *[(b, s, kv, d)] * 2)
    )


def positions(b: int, t: int) -> np.ndarray:
    return np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))


def packed_row(lens: list[int], t: int):
    """positions / starts / segment ids of sequences packed back to back in one row of length t."""
    pos, seg = np.zeros(t, np.int32), np.zeros(t, np.int32)
    o = 0
    for i, n in enumerate(lens):
        pos[o : o + n], seg[o : o + n] = np.arange(n), i + 1
        o += n
    starts = np.arange(t, dtype=np.int32) - pos
    return (a[None] for a in (pos, starts, seg))


ATTN = jax.jit(attention, static_argnames=("block_kv",))
REFERENCE = jax.jit(reference_attention)


def test_packed_full_matches_f64_reference():
    q, k, v = qkv(1, 70)
    pos, starts, seg = packed_row([7, 40, 20], 70)  # 3 padding tokens (segment 0) at the end
    out = np.asarray(ATTN(q, k, v, pos, starts, seg, seg))
    ref = reference_attention_f64(q, k, v, pos, starts, seg, seg)
    np.testing.assert_allclose(out[:, :67], ref[:, :67], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        out, np.asarray(REFERENCE(q, k, v, pos, starts, seg, seg)), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("block_kv", slow_but([None, 16], 16))
def test_decode_over_cache_equals_packed_full_bitwise(block_kv):
    """Sequence B (40 tokens) packed after a 7-token sequence, against B alone in slot 1 of a 3-slot
    KV cache of length 96 (other slots hold other data), queried one token at a time and all at once."""
    q, k, v = qkv(1, 70)
    pos, starts, seg = packed_row([7, 40, 20], 70)
    full = np.asarray(ATTN(q, k, v, pos, starts, seg, seg, block_kv=block_kv))[0, 7:47]
    cq, ck, cv = qkv(3, 40, seed=1, s=96)
    ck[1, :40], cv[1, :40], cq[1] = k[0, 7:47], v[0, 7:47], q[0, 7:47]
    for t in (0, 1, 15, 16, 17, 39):
        step_pos = np.asarray([[5], [t], [60]], np.int32)
        out = np.asarray(ATTN(cq[:, t : t + 1], ck, cv, step_pos, block_kv=block_kv))
        np.testing.assert_array_equal(out[1, 0], full[t])
    prefill = np.asarray(ATTN(cq[1:2], ck[1:2, :64], cv[1:2, :64], positions(1, 40), block_kv=block_kv))
    np.testing.assert_array_equal(prefill[0], full)


def test_rows_invariant_to_batch_and_neighbours():
    q, k, v = qkv(5, 33, seed=2)
    pos = positions(5, 33)
    full = np.asarray(ATTN(q, k, v, pos))
    np.testing.assert_array_equal(np.asarray(ATTN(q[2:3], k[2:3], v[2:3], pos[2:3])), full[2:3])
    np.testing.assert_array_equal(np.asarray(ATTN(q[:, 20:21], k, v, pos[:, 20:21])), full[:, 20:21])
    perm = np.array([4, 0, 3, 1, 2])
    np.testing.assert_array_equal(np.asarray(ATTN(q[perm], k[perm], v[perm], pos[perm])), full[perm])


@pytest.mark.parametrize(  # the f32 shapes' heads differed before (2026-12-04)
    "heads,kv,d,t,dtype",
    slow_but(
        [(16, 8, 24, 50, jnp.float32), (4, 4, 48, 70, jnp.float32), (16, 8, 24, 50, jnp.bfloat16)],
        (4, 4, 48, 70, jnp.float32),
        several=True,
    ),
)
def test_heads_invariant_to_their_neighbours(heads, kv, d, t, dtype):
    """A tensor-parallel device holds some of the heads (or one kv head shared by several devices):
    each head's bits must be those of the whole-model call, in f32 as in bf16 (with the heads a batch
    axis of the kernel's dots, XLA:CPU's f32 code changed with their number: these shapes differed)."""
    q, k, v = qkv(3, t, seed=7, heads=(heads, kv), d=d, dtype=dtype)
    pos = positions(3, t)
    f32 = lambda a: np.asarray(a).astype(np.float32)
    full = f32(ATTN(q, k, v, pos))
    for devices in (2, kv):  # each device kv / devices kv heads and their q heads
        hq, hk = heads // devices, kv // devices
        for i in range(devices):
            qs, kvs = slice(hq * i, hq * (i + 1)), slice(hk * i, hk * (i + 1))
            np.testing.assert_array_equal(
                f32(ATTN(q[:, :, qs], k[:, :, kvs], v[:, :, kvs], pos)), full[:, :, qs]
            )
            step = ATTN(q[:, -1:, qs], k[:, :, kvs], v[:, :, kvs], pos[:, -1:])  # a decode step
            np.testing.assert_array_equal(f32(step), full[:, -1:, qs])
    if heads % (2 * kv):
        return
    # 2 x kv devices: each kv head repeated over the two that share it
    rep = f32(ATTN(q, np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2), pos))
    hq = heads // (2 * kv)
    for i in range(2 * kv):
        qs, kvs = slice(hq * i, hq * (i + 1)), slice(i // 2, i // 2 + 1)
        np.testing.assert_array_equal(f32(ATTN(q[:, :, qs], k[:, :, kvs], v[:, :, kvs], pos)), rep[:, :, qs])


@pytest.mark.slow
@pytest.mark.parametrize("kv", [1, 2])
def test_one_row_over_one_key_block(kv):
    """One sequence whose keys fit in one key block, one query head per kv head, f32: the bits of the
    same row beside others, prefilled and in a decode step (a tensor-parallel device holding one q
    head, or an MHA model, prefilling one short prompt). A key array of one row and one block made
    every key slice the whole array, which XLA:CPU compiled into other f32 dot code: these rows
    differed (issue 37: f32 rollouts with kv heads replicated over tensor 4 lost the bits)."""
    t = 20  # < one block of keys (default_block_kv: 32)
    q, k, v = qkv(3, t, seed=8, heads=(kv, kv))
    pos = positions(3, t)
    full = np.asarray(ATTN(q, k, v, pos))
    np.testing.assert_array_equal(np.asarray(ATTN(q[1:2], k[1:2], v[1:2], pos[1:2])), full[1:2])
    step = ATTN(q[1:2, -1:], k[1:2], v[1:2], pos[1:2, -1:])
    np.testing.assert_array_equal(np.asarray(step), full[1:2, -1:])


def test_masked_keys_contribute_nothing():
    """Garbage (even huge values) in keys the query must not see leaves its bits unchanged."""
    q, k, v = qkv(1, 40, seed=3)
    pos = positions(1, 40)
    base = np.asarray(ATTN(q[:, :20], k, v, pos[:, :20]))
    k2, v2 = k.copy(), v.copy()
    k2[:, 20:], v2[:, 20:] = 1e4, -1e4
    np.testing.assert_array_equal(np.asarray(ATTN(q[:, :20], k2, v2, pos[:, :20])), base)


@pytest.mark.slow
def test_gradients_match_reference():
    q, k, v = qkv(2, 12, seed=4)
    pos, starts, seg = packed_row([5, 6], 12)
    pos, starts, seg = (np.broadcast_to(a, (2, 12)) for a in (pos, starts, seg))

    def grads(f):  # one jitted program (op by op, the backward compiled dozens)
        return jax.jit(
            jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, pos, starts, seg, seg))), (0, 1, 2))
        )

    for a, b in zip(grads(attention)(q, k, v), grads(reference_attention)(q, k, v), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_invariance_check_can_fail():
    """Negative control: another key-block size is another summation order, and the bits show it."""
    q, k, v = qkv(2, 64, seed=5)
    pos = positions(2, 64)
    assert not np.array_equal(
        np.asarray(ATTN(q, k, v, pos, block_kv=16)), np.asarray(ATTN(q, k, v, pos, block_kv=32))
    )


def test_errors():
    q, k, v = qkv(1, 4)
    with pytest.raises(ValueError, match="both"):
        attention(q, k, v, jnp.zeros((1, 4), jnp.int32), None, jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="positions"):
        attention(q, k, v, jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="KV"):
        attention(q, k[..., :16], v, jnp.zeros((1, 4), jnp.int32))
