"""The sequence-chunked head of the trainer's forward: log-probs bitwise those of the whole-sequence
head, gradients and entropy equal to the unchunked reference, and no [B, T, vocab] buffer."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qarl_jax.models import Qwen3ForCausalLM, init_params, preset
from qarl_jax.models.ops import log_softmax, token_logprobs
from qarl_jax.quant import QuantSpec
from qarl_jax.rl import logprobs


@functools.cache
def _setup(name: str, fmt: str):
    model = Qwen3ForCausalLM(preset(name, num_hidden_layers=1), QuantSpec(fmt))
    # the master weights, the same bits as the quantized model's init, whose program would also
    # compile its quantized forward (flax's init runs one)
    params = init_params(Qwen3ForCausalLM(model.config), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 23), 0, model.config.vocab_size)
    return model, params, tokens, jnp.roll(tokens, -1, axis=1)


def _whole_head(model, params, tokens, targets, temperature):
    """Today's head: the full [B, T, V] logits, then the log-prob kernel."""
    logits = logprobs.training_model(model).apply({"params": params}, tokens)
    return token_logprobs(logits, targets, temperature), logits


def test_head_chunk_tokens():
    assert logprobs.head_chunk_tokens(1, 32768, 151936) == 256  # 256 x 151936 <= 2^26 < 512 x 151936
    assert logprobs.head_chunk_tokens(8, 32768, 151936) == 32
    assert logprobs.head_chunk_tokens(2, 23, 128) == 23  # fits whole
    assert logprobs.head_chunk_tokens(1024, 100, 1 << 20) == 1  # never below one token
    assert logprobs.head_chunk_tokens(2, 23, 128, budget=2 * 4 * 128) == 4


@pytest.mark.parametrize(
    "name, fmt, temperature", [("qwen3-tiny", "w4a16", 0.7), ("qwen3-moe-tiny", "w8a8", 1.0)]
)
def test_chunked_logprobs_bitwise_and_gradients_match(monkeypatch, name, fmt, temperature):
    """Chunks of 4 tokens (23 = 5 x 4 + 3: a padded last chunk), tied and untied heads: the
    log-probs equal the whole head's bit for bit, also as the aux output under value_and_grad;
    the gradients and the entropy match the unchunked formulas."""
    model, params, tokens, targets = _setup(name, fmt)

    def ref_loss(p):  # the unchunked reference: log-probs, logits and gradients in one program
        logp, logits = _whole_head(model, p, tokens, targets, temperature)
        logq = log_softmax(logits, temperature)
        return jnp.sum(logp) - 0.1 * jnp.sum(jnp.exp(logq) * logq), (logp, logits)

    (_, (ref, logits)), ref_grads = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(params)
    monkeypatch.setattr(logprobs, "HEAD_CHUNK_ELEMENTS", 2 * 4 * model.config.vocab_size)
    assert logprobs.head_chunk_tokens(2, 23, model.config.vocab_size) == 4

    def loss(p):
        logp, ent = logprobs.policy_logprobs_and_entropy(
            model, p, tokens, None, None, targets, temperature, remat=True
        )
        return jnp.sum(logp) + 0.1 * jnp.sum(ent), (logp, ent)

    (_, (logp, ent)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    np.testing.assert_array_equal(logp, ref)
    plain = jax.jit(lambda p: logprobs.policy_logprobs(model, p, tokens, None, None, targets, temperature))
    np.testing.assert_array_equal(plain(params), ref)
    logq = log_softmax(logits, temperature)
    np.testing.assert_allclose(ent, -jnp.sum(jnp.exp(logq) * logq, axis=-1), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))
    tied = model.config.tie_word_embeddings
    head = grads["embed_tokens"]["embedding"] if tied else grads["lm_head"]["kernel"]
    assert float(jnp.abs(head).max()) > 0


def test_no_full_logits_buffer_in_the_compiled_backward(monkeypatch):
    """A 1-layer model with an 8k vocabulary at T = 512, 32-token head chunks: no array of the
    compiled gradient program has as many entries as the [T, V] logits (the unchunked one has
    several), and its temporaries shrink by more than one such f32 buffer (16 MiB)."""
    config = preset("qwen3-tiny", num_hidden_layers=1, vocab_size=8192)
    model = Qwen3ForCausalLM(config, QuantSpec("w4a16"))
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((1, 512), jnp.int32)

    def compiled():
        def loss(p, tokens):
            return jnp.sum(logprobs.policy_logprobs(model, p, tokens, None, None, tokens, remat=True))

        return jax.jit(jax.grad(loss)).lower(params, tokens).compile()

    def largest(c) -> int:
        shapes = re.findall(r"\b(?:f32|bf16|s32|s8|pred)\[([0-9,]+)\]", c.as_text())
        return max(math.prod(int(d) for d in s.split(",")) for s in shapes)

    whole = compiled()  # the default budget: one chunk of 512 tokens
    monkeypatch.setattr(logprobs, "HEAD_CHUNK_ELEMENTS", 32 * 8192)
    chunked = compiled()
    assert largest(whole) >= 512 * 8192 > largest(chunked)
    saved = whole.memory_analysis().temp_size_in_bytes - chunked.memory_analysis().temp_size_in_bytes
    assert saved > 512 * 8192 * 4, saved
