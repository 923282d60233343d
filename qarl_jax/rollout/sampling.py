"""On-device sampling for every decode slot at once, each slot with its own key and settings.

Per-slot settings are arrays, not Python values, so mixing greedy and sampled requests in one
batch never recompiles. Every token comes with two log-probs: under the policy (temperature 1, no
truncation: what RL needs) and under the distribution it was actually drawn from.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from qarl_jax.models import ops

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def is_policy(self) -> bool:
        """True when tokens are drawn from the policy itself (sampling log-prob == policy log-prob)."""
        return self.temperature == 1 and self.top_p == 1 and self.top_k == 0

    def describe(self) -> str:
        """What ``Sample.sampling_logprobs`` is the log-prob under."""
        if self.greedy:
            return "greedy"
        if self.is_policy:
            return "policy"
        return f"temperature={self.temperature},top_p={self.top_p},top_k={self.top_k}"


GREEDY = SamplingParams(temperature=0.0)


def _truncate(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Top-k then top-p (on the top-k-renormalised distribution); removed entries become -inf."""
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], desc, _NEG_INF)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each entry: the first is always kept
    kept = jnp.sum((before < top_p[:, None]) & (desc > _NEG_INF), axis=-1)
    pth = jnp.take_along_axis(desc, (jnp.maximum(kept, 1) - 1)[:, None], axis=-1)
    return jnp.where((scaled >= kth) & (scaled >= pth), scaled, _NEG_INF)


def sample(
    logits: jax.Array, keys: jax.Array, temperature: ArrayLike, top_p: ArrayLike, top_k: ArrayLike
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [S, V], typed keys [S], settings [S] -> (tokens, policy log-probs, sampling log-probs).

    Greedy rows take the argmax of the logits and report sampling log-prob 0 (a point mass). Without
    truncation the sampling log-prob is ``ops.log_softmax(logits, temperature)``: the trainer's
    log-prob at that temperature, bit for bit (temperature 1: the policy log-prob itself)."""
    temperature, top_p, top_k = jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(top_k)
    greedy = temperature <= 0
    tempered = ops.log_softmax(logits, jnp.where(greedy, 1.0, temperature))
    truncating = (~greedy) & ((top_p < 1) | (top_k > 0))
    sampling = jax.lax.cond(
        jnp.any(truncating),
        lambda s: jnp.where(truncating[:, None], jax.nn.log_softmax(_truncate(s, top_p, top_k), axis=-1), s),
        lambda s: s,
        tempered,
    )
    drawn = jax.vmap(jax.random.categorical)(keys, sampling)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    pick = lambda lp: jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    return tokens, pick(ops.log_softmax(logits)), jnp.where(greedy, 0.0, pick(sampling))
