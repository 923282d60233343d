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
from jax.sharding import PartitionSpec

from qarl_jax.models import Qwen3ForCausalLM, layer_major
from qarl_jax.models.ops import log_softmax, token_logprobs


def training_model(model: Qwen3ForCausalLM, *, remat: bool = False) -> Qwen3ForCausalLM:
    """``model`` with the training forward of its spec's mode (idempotent)."""
    spec = None if model.quant is None else model.quant.training_spec()
    return model.clone(quant=spec, remat=remat)


# Logits alive at a time in the head: about this many f32 entries (256 MiB), forward and backward.
HEAD_CHUNK_ELEMENTS = 1 << 26


def head_chunk_tokens(rows: int, length: int, vocab: int, budget: int | None = None) -> int:
    """Tokens per head chunk: the largest power of two with rows x chunk x vocab <= ``budget``
    (default :data:`HEAD_CHUNK_ELEMENTS`; at least 1), or the whole ``length`` when it fits. A
    function of the shapes only."""
    budget = budget or HEAD_CHUNK_ELEMENTS
    chunk = 1
    while chunk * 2 * rows * vocab <= budget:
        chunk *= 2
    return length if length <= chunk else chunk


def policy_scores(
    model: Qwen3ForCausalLM,
    params,
    tokens: jax.Array,
    positions: jax.Array | None,
    segment_ids: jax.Array | None,
    targets: jax.Array,
    temperature: float = 1.0,
    *,
    remat: bool = False,
    entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """(log p(targets[b, t] | tokens[b, :t+1]), entropy or None) [B, T] f32 under the training
    forward, from the float master ``params``. Packed rows: ``positions`` restart at 0 and
    ``segment_ids`` change at each sequence (0 = padding). ``remat`` recomputes layer activations
    in the backward pass; the head always runs in chunks of tokens (:func:`chunked_head`), where
    ``entropy`` adds one more pass over each chunk's logits, not a second forward."""
    m = training_model(model, remat=remat)
    hidden = jnp.asarray(m.apply({"params": params}, tokens, positions, segment_ids, method="hidden"))
    return chunked_head(m, params, hidden, targets, temperature, entropy=entropy)


def policy_logprobs(*args, **kwargs) -> jax.Array:
    """The log-probs of :func:`policy_scores` (same arguments) alone: no entropy pass."""
    return policy_scores(*args, **kwargs)[0]


def policy_logprobs_and_entropy(*args, **kwargs) -> tuple[jax.Array, jax.Array]:
    """(:func:`policy_logprobs`, entropy of the policy at ``temperature``) [B, T] f32 from one forward
    (:func:`policy_scores`' arguments). The log-probs are bitwise those of :func:`policy_logprobs`
    (same kernel on the same logits); the entropy -sum p log p runs the row-wise log-softmax kernel
    over the vocabulary."""
    logp, ent = policy_scores(*args, entropy=True, **kwargs)
    assert ent is not None  # entropy=True computes it
    return logp, ent


def scores_by_chunks(
    model: Qwen3ForCausalLM,
    params,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    targets: jax.Array,
    temperature: float = 1.0,
    *,
    chunks: int,
    entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """:func:`policy_scores` of a batch [N, T] scored in ``chunks`` chunks of rows
    (:func:`qarl_jax.models.layer_major.split_rows`), forward only: the layers run layer-major
    (each layer's weights gathered once for all chunks, :mod:`qarl_jax.models.layer_major`), then
    each chunk's head, one chunk's logits alive at a time. Every row's log-probs (and entropy) are
    bitwise those of :func:`policy_scores` over its chunk; outputs [N, T] in row order."""
    m = training_model(model)
    hidden = layer_major.hidden(m, params, tokens, positions, segment_ids, chunks)
    head_params = _gathered_head(m, params)  # once, outside the chunk loop

    def one(args):
        return chunked_head(m, head_params, *args, temperature, entropy=entropy)

    logp, ent = jax.lax.map(one, (hidden, layer_major.split_rows(targets, chunks)))
    return layer_major.merge_rows(logp), None if ent is None else layer_major.merge_rows(ent)


def chunked_head(
    model: Qwen3ForCausalLM,
    params,
    hidden: jax.Array,
    targets: jax.Array,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    chunk: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(target log-probs, entropy or None) [B, T] f32 from final-norm ``hidden`` [B, T, H]: lm_head,
    tempered log-softmax, target pick and entropy over chunks of ``chunk`` tokens (default
    :func:`head_chunk_tokens`) in a scan whose body is rematerialised, so neither the forward nor
    the backward holds more than one chunk's [B, chunk, V] logits. Every step of the head is a
    row-wise kernel (the matmul's rows, the log-sum-exp's rows): a token's bits do not depend on
    the chunk it falls in, so these are the unchunked head's log-probs bit for bit."""
    b, t, h = hidden.shape
    chunk = chunk or head_chunk_tokens(b, t, model.config.vocab_size)
    n = -(-t // chunk)
    pad = n * chunk - t
    x = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(targets, ((0, 0), (0, pad)))
    # chunk-major [n, B, chunk, ...]: the batch axis (the one the mesh splits) stays whole
    xs = jnp.swapaxes(x.reshape(b, n, chunk, h), 0, 1)
    ys = jnp.swapaxes(y.reshape(b, n, chunk), 0, 1)

    params = _gathered_head(model, params)

    @jax.checkpoint
    def one(xc, yc):
        logits = model.apply({"params": params}, xc, method="head")
        logp = token_logprobs(logits, yc, temperature)
        if not entropy:
            return logp, None
        logq = log_softmax(logits, temperature)
        return logp, -jnp.sum(jnp.exp(logq) * logq, axis=-1)

    _, (logp, ent) = jax.lax.scan(lambda carry, c: (carry, one(*c)), None, (xs, ys))
    merge = lambda v: jnp.swapaxes(v, 0, 1).reshape(b, n * chunk)[:, :t]  # noqa: E731
    return merge(logp), None if ent is None else merge(ent)


def _gathered_head(model: Qwen3ForCausalLM, params):
    """``params`` with the head's weight (lm_head, or the tied embedding) gathered whole once,
    before the chunk loop. Why: every chunk's matmul runs on the whole weight (``ops.per_device``),
    and XLA:TPU left that all-gather inside the loop: the Qwen3-8B config on a v5p-64 gathered its
    2.5 GB f32 head 576 times a micro-batch (11.7 TB of collectives for one old log-prob pass, by
    ``memory_plan --topology``). Gathered here, the loop reads one replicated copy, which it needs
    whole anyway; its gradient is reduced once. The values, so the log-probs, are the same."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or mesh.manual_axes:
        return params
    name = "embed_tokens" if model.config.tie_word_embeddings else "lm_head"
    whole = lambda w: jax.lax.with_sharding_constraint(w, PartitionSpec())  # noqa: E731
    with jax.named_scope(layer_major.GATHER_SCOPE):
        return {**params, name: jax.tree.map(whole, params[name])}


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
