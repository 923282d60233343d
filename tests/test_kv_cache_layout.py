"""The KV cache in the layout the TPU attention kernel reads ([L, B, KV, S, D_pad], the layer a
scalar-prefetched operand): a token's attention over it has the bits of the kernel over that
layer's K/V as the training forward passes them (Pallas' TPU interpreter, on this CPU), and writes
past ``max_len`` are dropped. That the compiled TPU decode step moves about its weights and its
cache, not per-layer copies of the cache, is checked on the v5p programs
tests/test_tpu_compile.py compiles (test_the_run_compiles_for_a_v5p_slice)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import attention as attn

H, KV, D, LAYERS, ROWS, MAX_LEN = 4, 2, 16, 3, 2, 40


def rand(shape, seed):
    """Numpy operands: drawing them compiles nothing."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_layouts_by_backend():
    """CPU and GPU keep [L, B, S, KV, D] as it was; the TPU's is heads-first, padded to the kernel's
    last key window and to 128 lanes."""
    cpu, tpu = attn.cache_layout(MAX_LEN, D, backend="cpu"), attn.cache_layout(MAX_LEN, D, backend="tpu")
    assert cpu.shape(LAYERS, ROWS, KV) == (LAYERS, ROWS, MAX_LEN, KV, D)
    assert tpu.heads_first and tpu.shape(LAYERS, ROWS, KV) == (LAYERS, ROWS, KV, tpu.length, 128)
    assert tpu.length >= MAX_LEN + attn.default_block_kv(D) + 16 and tpu.length % 16 == 0


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_attention_over_the_cache_has_the_kernels_bits(backend):
    """A prompt written into layer 1 of a stacked cache and a decode token attending to it: the
    output is bitwise the attention kernel's over the same K/V passed as the training forward
    passes them; the other layers are untouched, and a write at ``max_len`` or past it is dropped
    (the padded positions stay zero)."""
    kw = {"backend": backend, "interpret": True} if backend == "tpu" else {"backend": backend}
    layout = attn.cache_layout(MAX_LEN, D, **kw)
    shape = layout.shape(LAYERS, ROWS, KV)
    n = 30
    k, v = rand((ROWS, n, KV, D), 1), rand((ROWS, n, KV, D), 2)
    positions = np.broadcast_to(np.arange(n, dtype=np.int32), (ROWS, n))
    q, at = rand((ROWS, 1, H, D), 3), np.array([[20], [29]], np.int32)

    @jax.jit
    def decode(q, k, v, late):  # the cache written and read in one program, as the engine's are
        kc = layout.write(jnp.zeros(shape), 1, positions, k)
        vc = layout.write(jnp.zeros(shape), 1, positions, v)
        out = attn.cached_attention(q, kc, vc, jnp.int32(1), at, layout, **kw)
        return out, kc, layout.write(kc, 1, jnp.full((ROWS, 1), MAX_LEN, jnp.int32), late)

    out, kc, past = decode(q, k, v, rand((ROWS, 1, KV, D), 4))
    training = jax.jit(lambda q, k, v: attn.attention(q, k, v, at, **kw))  # a program of its own
    np.testing.assert_array_equal(out, training(q, k, v))
    assert np.any(np.asarray(kc)[1]) and not np.any(np.asarray(kc)[[0, 2]])
    np.testing.assert_array_equal(past, kc)
