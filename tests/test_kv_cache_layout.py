"""The KV cache in the layout the TPU attention kernel reads ([L, B, KV, S, D_pad], the layer a
scalar-prefetched operand): a token's attention over it has the bits of the kernel over that
layer's K/V as the training forward passes them (Pallas' TPU interpreter, on this CPU), writes past
``max_len`` are dropped, and the compiled TPU decode step moves about its weights and its cache,
not per-layer copies of the cache (the TPU compiler, no chip)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import attention as attn
from qarl_jax.tools import memory_plan

H, KV, D, LAYERS, ROWS, MAX_LEN = 4, 2, 16, 3, 2, 40


def rand(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


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
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (ROWS, n))
    kc = layout.write(jnp.zeros(shape), 1, positions, k)
    vc = layout.write(jnp.zeros(shape), 1, positions, v)
    q, at = rand((ROWS, 1, H, D), 3), jnp.array([[20], [29]], jnp.int32)
    out = attn.cached_attention(q, kc, vc, jnp.int32(1), at, layout, **kw)
    np.testing.assert_array_equal(out, attn.attention(q, k, v, at, **kw))
    assert not np.any(np.asarray(kc)[[0, 2]])
    past = layout.write(kc, 1, jnp.full((ROWS, 1), MAX_LEN, jnp.int32), rand((ROWS, 1, KV, D), 4))
    np.testing.assert_array_equal(past, kc)


@pytest.mark.slow
def test_the_tpu_decode_step_moves_its_weights_and_cache_not_copies_of_them(capsys):
    """The decode step compiled for a v5p chip moves at most 2.5x its packed weights plus its KV
    cache (the padded one the chip holds) a step. Before the cache took the kernel's layout, each
    layer's K/V was sliced out of the stack, transposed and padded for the kernel: 19x on this
    preset (44 of 12 GB a chip on Qwen3-8B)."""
    code = memory_plan.main(
        [
            "--config",
            "configs/loop_smoke.yaml",
            "--topology",
            "v5p:2x2x1",
            "--json",
            "model.preset=qwen3-small",
            "quant.fmt=w4a16",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    programs = out["compiled"]["programs"]
    kernels = lambda *names: {k for n in names for k in programs[n]["mosaic_kernels"]}  # noqa: E731
    assert kernels("decode_step", "prefill") <= kernels("old_logprobs", "update")  # the same programs
    moved = programs["decode_step"]["hbm_bytes"]
    held = out["plan"]["bytes"]["frozen"] + out["compiled"]["kv_cache_bytes"]
    assert moved <= 2.5 * held, (moved, held)
