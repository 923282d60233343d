"""The policy log-prob function: the one forward the trainer differentiates.

The rollout samples with ``Qwen3ForCausalLM(config, spec)`` on ``quantize_params(params, spec)``
(frozen integers, KV cache). The trainer scores the same tokens here, with the training forward
chosen by ``spec.mode``:

  aligned  the same quantized kernels on weights quantized on the fly from the master weights
           (straight-through backward); log-probs equal the rollout's bit for bit.
  naive    full-precision matmuls on the master weights (the paper's baseline): a mismatch.

Log-probs are of ``logits / temperature`` (the rollout must sample and record with the same
temperature) and come back as an auxiliary output of the loss, so what is compared with the
rollout is exactly what enters the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from qarl_jax.models import Qwen3ForCausalLM
from qarl_jax.models.ops import log_softmax, token_logprobs


def training_model(model: Qwen3ForCausalLM, *, remat: bool = False) -> Qwen3ForCausalLM:
    """``model`` with the training forward of its spec's mode (idempotent)."""
    spec = None if model.quant is None else model.quant.training_spec()
    return model.clone(quant=spec, remat=remat)


def policy_logprobs(
    model: Qwen3ForCausalLM,
    params,
    tokens: jax.Array,
    positions: jax.Array | None,
    segment_ids: jax.Array | None,
    targets: jax.Array,
    temperature: float = 1.0,
    *,
    remat: bool = False,
) -> jax.Array:
    """log p(targets[b, t] | tokens[b, :t+1]) [B, T] f32 under the training forward, from the float
    master ``params``. Packed rows: ``positions`` restart at 0 and ``segment_ids`` change at each
    sequence (0 = padding). ``remat`` recomputes layer activations in the backward pass."""
    logits = _training_logits(model, params, tokens, positions, segment_ids, remat)
    return token_logprobs(logits, targets, temperature)


def _training_logits(model, params, tokens, positions, segment_ids, remat: bool) -> jax.Array:
    return training_model(model, remat=remat).apply({"params": params}, tokens, positions, segment_ids)


def policy_logprobs_and_entropy(
    model: Qwen3ForCausalLM,
    params,
    tokens: jax.Array,
    positions: jax.Array | None,
    segment_ids: jax.Array | None,
    targets: jax.Array,
    temperature: float = 1.0,
    *,
    remat: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(:func:`policy_logprobs`, entropy of the policy at ``temperature``) [B, T] f32 from one forward.
    The log-probs are bitwise those of :func:`policy_logprobs` (same kernel on the same logits); the
    entropy -sum p log p runs the row-wise log-softmax kernel over the vocabulary, so it costs one
    more pass over the logits, not a second forward."""
    logits = _training_logits(model, params, tokens, positions, segment_ids, remat)
    logq = log_softmax(logits, temperature)
    entropy = -jnp.sum(jnp.exp(logq) * logq, axis=-1)
    return token_logprobs(logits, targets, temperature), entropy


Batch = Mapping[str, jax.Array]


def logprob_loss(
    model: Qwen3ForCausalLM,
    loss_fn: Callable[[jax.Array, Batch], jax.Array],
    temperature: float = 1.0,
    *,
    remat: bool = False,
) -> Callable[[object, Batch], tuple[jax.Array, jax.Array]]:
    """``f(params, batch) -> (loss_fn(logprobs, batch), logprobs)`` for
    ``jax.value_and_grad(f, has_aux=True)``. ``batch`` holds tokens, positions, segment_ids and
    targets [B, T] plus whatever ``loss_fn`` reads."""

    def f(params, batch: Batch):
        logp = policy_logprobs(
            model,
            params,
            batch["tokens"],
            batch["positions"],
            batch["segment_ids"],
            batch["targets"],
            temperature,
            remat=remat,
        )
        return loss_fn(logp, batch), logp

    return f
