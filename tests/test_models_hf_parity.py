"""Our Flax model (Qwen3, Qwen3-MoE, Qwen2, Llama 3) against transformers' PyTorch models loaded from the
same files."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import CASES, make_hf_model, padded_batch

from qarl_jax.models import KVCache, from_pretrained

# the cache and packing tests (slow: one compiled decode step per position) on every Qwen3 case and on
# Llama 3's scaled RoPE at decode positions; the logits test on every case. Qwen2's decode steps are
# checked bitwise against its full forward by tests/test_families_alignment.py
CACHE_CASES = [c for c in sorted(CASES) if not c.startswith(("qwen2", "llama"))] + ["llama-untied-llama3"]
# the cache and packing tests' rows: one shape, so their full forwards are one compiled program
ROWS, LENGTH = 4, 12


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """transformers' model, ours loaded from its files, and our forward and decode step jitted: one
    compile per shape costs a quarter of the CPU time of running the model op by op (measured)."""
    hf = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, params, _ = from_pretrained(path, dtype="float32")
    forward = jax.jit(lambda p, *args: model.apply({"params": p}, *args))
    decode = jax.jit(lambda p, *args: model.apply({"params": p}, *args, method="decode"))
    return hf, model, functools.partial(forward, params), functools.partial(decode, params)


@pytest.mark.parametrize("seed", [0, 1])
def test_logits_match_transformers_on_padded_batches(pair, seed):
    hf, model, forward, _ = pair
    tokens, mask = padded_batch(model.config.vocab_size, batch=4, length=12, seed=seed)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = np.asarray(forward(jnp.asarray(tokens), None, jnp.asarray(mask)))
    valid = mask.astype(bool)
    rel = np.abs(ours - ref)[valid].max() / np.abs(ref[valid]).max()
    assert rel < 1e-4, rel
    np.testing.assert_array_equal(ours.argmax(-1)[valid], ref.argmax(-1)[valid])


def _rows(tokens: np.ndarray, positions: np.ndarray, segments: np.ndarray) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(np.asarray(x, np.int32)) for x in (tokens, positions, segments))


@pytest.mark.parametrize("pair", CACHE_CASES, indirect=True)
def test_kv_cache_decode_reproduces_full_forward(pair):
    """The full forward is run on [ROWS, LENGTH] rows with explicit positions and segments: the
    program test_packed_segments_equal_separate_sequences runs (one compile for both)."""
    _, model, forward, decode = pair
    tokens, _ = padded_batch(model.config.vocab_size, batch=ROWS, length=LENGTH, seed=3)
    positions = np.broadcast_to(np.arange(LENGTH), (ROWS, LENGTH))
    full = np.asarray(forward(*_rows(tokens, positions, np.ones_like(tokens))))
    # prefill the first 4 tokens in one call, then decode one token at a time
    cache = KVCache.init(model.config, batch=ROWS, max_len=16)
    logits, cache = decode(jnp.asarray(tokens[:, :4]), jnp.asarray(positions[:, :4]), cache)
    steps = [np.asarray(logits)]
    for t in range(4, LENGTH):
        pos = jnp.full((ROWS, 1), t)
        logits, cache = decode(jnp.asarray(tokens[:, t : t + 1]), pos, cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=1e-5 * np.abs(full).max())


@pytest.mark.parametrize("pair", CACHE_CASES, indirect=True)
def test_packed_segments_equal_separate_sequences(pair):
    """Two sequences packed in one row (positions restarting), in both orders, give the logits of
    each alone in a row of its own (padding after it), all in one [ROWS, LENGTH] call."""
    _, model, forward, _ = pair
    rng = np.random.RandomState(5)
    a, b = rng.randint(0, model.config.vocab_size, 7), rng.randint(0, model.config.vocab_size, 5)
    pad_a, pad_b = np.zeros(LENGTH - 7, int), np.zeros(LENGTH - 5, int)
    tokens = [np.concatenate(r) for r in ((a, b), (a, pad_a), (b, pad_b), (b, a))]
    positions = [np.concatenate([np.arange(n), np.arange(LENGTH - n)]) for n in (7, 7, 5, 5)]
    segments = [[1] * 7 + [2] * 5, [1] * 7 + [0] * 5, [1] * 5 + [0] * 7, [1] * 5 + [2] * 7]
    out = np.asarray(forward(*_rows(np.stack(tokens), np.stack(positions), np.asarray(segments))))
    alone_a, alone_b = out[1, :7], out[2, :5]
    np.testing.assert_allclose(out[0, :7], alone_a, atol=1e-5)
    np.testing.assert_allclose(out[0, 7:], alone_b, atol=1e-5)
    np.testing.assert_allclose(out[3, :5], alone_b, atol=1e-5)
    np.testing.assert_allclose(out[3, 5:], alone_a, atol=1e-5)
    assert np.isfinite(out).all()
