"""Per-step training metrics as pure, jit-able functions of the padded training batch.

Arrays follow :func:`qarl_jax.rl.batch.training_batch`: one response per row, ``mask`` [B, T] is 1
on the response's target positions (contiguous), ``targets`` holds the response tokens there and
``rollout_logp`` the engine's log-probs. Reward mean/std and accuracy belong to the loop (it has
the rewards); everything here needs only the batch and the training forward.

Error tokens (the paper's failure mode of long quantized rollouts: repetitive, garbled,
very-low-probability tokens) are flagged per response by two rules:

- **repetition loop**: the response *ends* in a contiguous repetition of one n-gram, n in
  1..``max_ngram``, repeated at least ``min_repeats`` times and covering at least ``min_tokens``
  tokens. Formally, with x the response tokens, the longest suffix of period n (x[i] == x[i - n]
  for every i of the suffix past its first n tokens) has length L_n; the response loops when some
  n has L_n >= max(min_tokens, min_repeats * n). Only the end counts: a loop that the model
  escaped is not one it was caught in, and a response caught in a loop runs to the length limit.
  Defaults (n <= 4, >= 3 repeats, >= 12 tokens): "to to to ... to" needs 12 copies, a 4-gram 3.
- **low probability**: a sampled token whose rollout probability is below ``low_prob_threshold``
  (1e-3): sampling noise the policy itself considered near impossible.

A third rate needs the training forward: **implausible** tokens, sampled tokens to which the
training forward gives probability below the same threshold (:func:`implausible_tokens`). Aligned,
they are exactly the low-probability ones; under a quantized rollout scored at full precision, the
excess is what quantization made the sampler draw that the full-precision policy finds near
impossible (the paper's error tokens as they come about).

A response with either is an error sequence; the trainer can report the share of the gradient
norm such sequences carry (``TrainConfig.error_token_grad_share``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def response_length_stats(mask: jax.Array, truncated: jax.Array | None = None) -> dict[str, jax.Array]:
    """Mean/max response length over non-empty rows and, given ``truncated`` [B] (finish reason
    "length"), the truncation rate among them."""
    lengths = jnp.sum(mask.astype(jnp.float32), axis=1)
    valid = (lengths > 0).astype(jnp.float32)
    out = {"response_len_mean": _masked_mean(lengths, valid), "response_len_max": jnp.max(lengths)}
    if truncated is not None:
        out["truncation_rate"] = _masked_mean(truncated.astype(jnp.float32), valid)
    return out


def entropy_mean(entropy: jax.Array, mask: jax.Array) -> jax.Array:
    """Token-mean policy entropy over response tokens (rises when a policy degenerates)."""
    return _masked_mean(entropy, mask.astype(jnp.float32))


def mismatch_stats(old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """The alignment check's statistics of training (old) vs rollout log-probs on response tokens:
    bitwise-equal fraction, max/mean |diff| and the k3 estimate of KL(rollout || old) (samples come
    from the rollout). All exactly 1/0/0/0 when aligned."""
    m = mask.astype(jnp.float32)
    log_r = (old_logp - rollout_logp) * m  # log old/rollout at the rollout's samples
    return {
        "mismatch_frac_bitwise_equal": _masked_mean((old_logp == rollout_logp).astype(jnp.float32), m),
        "mismatch_max_abs_diff": jnp.max(jnp.abs(log_r)),
        "mismatch_mean_abs_diff": _masked_mean(jnp.abs(log_r), m),
        "mismatch_kl_k3": _masked_mean(jnp.expm1(log_r) - log_r, m),
    }


def repetition_loop(
    targets: jax.Array, mask: jax.Array, max_ngram: int = 4, min_repeats: int = 3, min_tokens: int = 12
) -> jax.Array:
    """[B] bool: the response ends in an n-gram loop (rule in the module docstring)."""
    _, t = targets.shape
    inside = mask > 0
    idx = jnp.arange(t)
    last = (t - 1) - jnp.argmax(inside[:, ::-1], axis=1)  # last response position of each row
    caught = jnp.zeros(targets.shape[:1], bool)
    for n in range(1, max_ngram + 1):
        same = (
            jnp.zeros_like(inside)
            .at[:, n:]
            .set((targets[:, n:] == targets[:, :-n]) & inside[:, n:] & inside[:, :-n])
        )
        # run of consecutive matches ending at each position: i - (last mismatch at or before i)
        breaks = jax.lax.cummax(jnp.where(same, -1, idx[None, :]), axis=1)
        run = jnp.take_along_axis(idx[None, :] - breaks, last[:, None], axis=1)[:, 0]
        caught |= run + n >= max(min_tokens, min_repeats * n)
    return caught & jnp.any(inside, axis=1)


def low_prob_tokens(rollout_logp: jax.Array, mask: jax.Array, threshold: float = 1e-3) -> jax.Array:
    """[B, T] bool: response tokens the rollout sampled with probability below ``threshold``."""
    return (rollout_logp < math.log(threshold)) & (mask > 0)


def implausible_tokens(
    train_logp: jax.Array, mask: jax.Array, threshold: float = 1e-3
) -> dict[str, jax.Array]:
    """The share of response tokens, and of non-empty responses holding one, whose probability
    under the training forward (``train_logp``, at the rollout's samples) is below ``threshold``."""
    low = low_prob_tokens(train_logp, mask, threshold)  # the same rule, on the training forward
    valid = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
    return {
        "implausible_token_frac": _masked_mean(low.astype(jnp.float32), mask.astype(jnp.float32)),
        "implausible_seq_frac": _masked_mean(jnp.any(low, axis=1).astype(jnp.float32), valid),
    }


def error_sequences(
    targets: jax.Array,
    mask: jax.Array,
    rollout_logp: jax.Array,
    low_prob_threshold: float = 1e-3,
    max_ngram: int = 4,
    min_repeats: int = 3,
    min_tokens: int = 12,
) -> dict[str, jax.Array]:
    """Per-response flags [B] bool: ``repetition``, ``low_prob`` (any such token) and ``error``
    (either), plus the per-token ``low_prob_tokens`` [B, T]."""
    rep = repetition_loop(targets, mask, max_ngram, min_repeats, min_tokens)
    low = low_prob_tokens(rollout_logp, mask, low_prob_threshold)
    low_seq = jnp.any(low, axis=1)
    return {"repetition": rep, "low_prob": low_seq, "error": rep | low_seq, "low_prob_tokens": low}


def error_token_stats(flags: dict[str, jax.Array], mask: jax.Array) -> dict[str, jax.Array]:
    """Fractions from :func:`error_sequences`: responses in a repetition loop, response tokens with
    low rollout probability, and error responses (over non-empty responses)."""
    m = mask.astype(jnp.float32)
    valid = (jnp.sum(m, axis=1) > 0).astype(jnp.float32)
    return {
        "repetition_frac": _masked_mean(flags["repetition"].astype(jnp.float32), valid),
        "low_prob_token_frac": _masked_mean(flags["low_prob_tokens"].astype(jnp.float32), m),
        "error_seq_frac": _masked_mean(flags["error"].astype(jnp.float32), valid),
    }


def tree_norm(tree) -> jax.Array:
    """Global L2 norm of a pytree, accumulated in f32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))
