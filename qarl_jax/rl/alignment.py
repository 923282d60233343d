"""Alignment checks' building blocks: a KV-cache rollout straight on the model's decode entry point
(several slots, mixed prompt lengths, sampled tokens; the engine-free reference) and the packed /
padded training batches that re-score the same tokens with :func:`policy_logprobs`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qarl_jax.models import KVCache
from qarl_jax.models.ops import token_logprobs


def rollout(model, frozen, prompts: list[np.ndarray], new_tokens: int, seed: int = 0, max_len: int = 48):
    """Prefill all slots at once (prompts right-padded; the padding's cache entries are overwritten
    before any query can see them), then sample one token per slot per step, each slot at its own
    position. Returns [(prompt + generated tokens, rollout log-probs of the generated tokens)]."""
    b, longest = len(prompts), max(len(p) for p in prompts)
    lens = np.array([len(p) for p in prompts])
    padded = np.zeros((b, longest), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p

    @jax.jit
    def step(cache, tokens, positions, last, key):
        logits, cache = model.apply({"params": frozen}, tokens, positions, cache, method="decode")
        logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        nxt = jax.random.categorical(key, logits.astype(jnp.float32))
        return cache, nxt, token_logprobs(logits, nxt)

    cache = KVCache.init(model.config, b, max_len)
    keys = jax.random.split(jax.random.key(seed), new_tokens)
    positions = jnp.broadcast_to(jnp.arange(longest, dtype=jnp.int32), (b, longest))
    cache, nxt, lp = step(cache, jnp.asarray(padded), positions, jnp.asarray(lens - 1), keys[0])
    gen, lps = [np.asarray(nxt)], [np.asarray(lp)]
    for i in range(1, new_tokens):
        pos = jnp.asarray(lens + i - 1, jnp.int32)[:, None]
        cache, nxt, lp = step(cache, nxt[:, None], pos, jnp.zeros((b,), jnp.int32), keys[i])
        gen.append(np.asarray(nxt))
        lps.append(np.asarray(lp))
    sampled, sampled_lps = np.stack(gen, 1), np.stack(lps, 1)
    return [(np.concatenate([p, sampled[i]]), sampled_lps[i]) for i, p in enumerate(prompts)]


def pack(seqs: list[np.ndarray], rows: int, length: int) -> dict[str, Any]:
    """Greedy first-fit packing of sequences into [rows, length] training rows (inputs seq[:-1],
    targets seq[1:]); also returns where each sequence landed."""
    batch = {k: np.zeros((rows, length), np.int32) for k in ("tokens", "targets", "positions", "segment_ids")}
    fill, where = [0] * rows, []
    for i, s in enumerate(seqs):
        n = len(s) - 1
        r = next(r for r in range(rows) if fill[r] + n <= length)
        o = fill[r]
        batch["tokens"][r, o : o + n] = s[:-1]
        batch["targets"][r, o : o + n] = s[1:]
        batch["positions"][r, o : o + n] = np.arange(n)
        batch["segment_ids"][r, o : o + n] = i + 1
        fill[r] += n
        where.append((r, o))
    return batch | {"where": where}


def generated_logprobs(logp: np.ndarray, batch, prompts, seqs) -> list[np.ndarray]:
    """Per sequence, the training log-probs of its generated tokens."""
    out = []
    for (r, o), p, s in zip(batch["where"], prompts, seqs, strict=True):
        out.append(np.asarray(logp)[r, o + len(p) - 1 : o + len(s) - 1])
    return out
