"""The routed experts' arithmetic (Qwen3-MoE's sparse MLP), per device: top-k routing, every
(token, expert) row through one grouped matmul per projection, the top-k outputs summed in the
router's order. Dropless: every pair is computed, none is dropped.

Two placements of the experts, the same bits:

* **whole** (``axis=None``): the device holds every expert and computes its own tokens' rows;
* **expert parallel** (``axis`` a mesh axis of size P > 1 inside ``shard_map``): the device owns
  experts ``[i E/P, (i+1) E/P)`` of its position i on the axis. The tokens of the axis' devices are
  gathered (or are already the same on each), each device computes its own experts' rows of all of
  them with the same grouped kernel, and each (token, k) output comes back from its owner (an
  all-to-all, or an all-gather when the tokens were not split) and is picked exactly, never summed
  across devices. Every row meets the same program as on one device (the grouped kernels' rows are
  independent of the other rows and of the group layout), so the output is bitwise the whole one.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from qarl_jax import quant
from qarl_jax.models import ops
from qarl_jax.models.config import TransformerConfig

# Tokens per MoE chunk: a longer sequence's routed rows (tokens x top_k copies of the hidden state,
# and their expert activations) are built and differentiated this many tokens at a time.
MOE_CHUNK_TOKENS = 1024


def moe(
    x: jax.Array,
    router: jax.Array,
    expert_weights,
    c: TransformerConfig,
    spec: quant.QuantSpec | None,
    axis: str | None = None,
    split: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """(output [B, T, H], chosen experts [B, T, top_k] in the router's order) of x [B, T, H]. More
    than ``MOE_CHUNK_TOKENS`` tokens run as a scan over chunks of them, each rematerialised in the
    backward pass: tokens are independent (dropless routing, row-wise kernels), so a token's bits do
    not depend on the chunk it falls in. ``axis``/``split``: expert parallel (module docstring),
    ``split`` saying whether the devices of ``axis`` hold different tokens."""
    b, t, hdim = x.shape
    tokens = x.reshape(b * t, hdim).astype(c.dtype)
    n = b * t

    def one(chunk):
        return _moe_tokens(chunk, router, expert_weights, c, spec, axis, split)

    if n <= MOE_CHUNK_TOKENS:
        out, experts = one(tokens)
    else:
        chunks = -(-n // MOE_CHUNK_TOKENS)
        padded = jnp.pad(tokens, ((0, chunks * MOE_CHUNK_TOKENS - n), (0, 0)))
        _, (out, experts) = lax.scan(
            lambda carry, chunk: (carry, jax.checkpoint(one)(chunk)),
            None,
            padded.reshape(chunks, MOE_CHUNK_TOKENS, hdim),
        )
        out, experts = out.reshape(-1, hdim)[:n], experts.reshape(-1, c.num_experts_per_tok)[:n]
    return out.reshape(b, t, hdim), experts.reshape(b, t, c.num_experts_per_tok)


def _moe_tokens(tokens, router, expert_weights, c: TransformerConfig, spec, axis: str | None, split: bool):
    """(output [N, H], chosen experts [N, top_k]) of the routed experts on ``tokens`` [N, H]."""
    k = c.num_experts_per_tok
    n = tokens.shape[0]
    ways = 1 if axis is None else lax.axis_size(axis)
    if ways > 1 and split:  # every device of the axis routes the tokens of all of them
        tokens = lax.all_gather(tokens, axis, tiled=True)
    logits = quant.dot(tokens, router, spec, "router")
    weights, experts = lax.top_k(ops.softmax(logits), k)
    if c.norm_topk_prob:
        weights = weights / sum_in_order([weights[:, i : i + 1] for i in range(k)])
    weights = weights.astype(c.dtype)
    rows = _expert_rows(tokens, experts, expert_weights, c, spec, axis)  # [tokens, k, H]
    if ways > 1:
        me = lax.axis_index(axis)
        if split:  # each device's tokens' rows, from every owner: [ways, n, k, H]
            parts = lax.all_to_all(rows.reshape(ways, n, k, -1), axis, 0, 0)
            experts, weights = (lax.dynamic_slice_in_dim(a, me * n, n) for a in (experts, weights))
        else:
            parts = lax.all_gather(rows, axis)
        owner = experts // (c.num_experts // ways)
        rows = jnp.take_along_axis(parts, owner[None, :, :, None], axis=0)[0]
    return sum_in_order([rows[:, i] * weights[:, i : i + 1] for i in range(k)]), experts


def _expert_rows(tokens, experts, expert_weights, c: TransformerConfig, spec, axis: str | None):
    """[N, top_k, H]: each (token, k) pair's expert output, zero where another device of ``axis``
    owns the expert. Pairs are sorted by expert into contiguous groups for one grouped matmul per
    projection (static shapes: N * top_k rows whatever the routing); this device's experts' groups
    are shifted to the front, the rows after them give zeros."""
    e, k = c.num_experts, c.num_experts_per_tok
    flat = experts.reshape(-1)
    m = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    rows = tokens[order // k]
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    w_gate, w_up, w_down = expert_weights
    local = jax.tree.leaves(w_gate)[0].shape[0]  # experts on this device (a float or frozen weight)
    offset = None
    if local != e:  # expert parallel: this device's experts [first, first + local)
        first = lax.axis_index(axis) * local
        offset = jnp.sum(jnp.where(jnp.arange(e) < first, group_sizes, 0))
        rows = lax.dynamic_slice_in_dim(jnp.concatenate([rows, jnp.zeros_like(rows)]), offset, m)
        group_sizes = lax.dynamic_slice_in_dim(group_sizes, first, local)

    def dot(a, w):
        return checkpoint_name(quant.grouped_dot(a, w, group_sizes, spec, "experts"), ops.MATMUL_OUTPUT)

    out = dot(nn.silu(dot(rows, w_gate)) * dot(rows, w_up), w_down)
    if offset is not None:  # back to the sorted positions; other devices' rows stay zero
        out = lax.dynamic_update_slice_in_dim(jnp.zeros((2 * m, out.shape[1]), out.dtype), out, offset, 0)[:m]
    return jnp.zeros_like(out).at[order].set(out).reshape(-1, k, tokens.shape[1])


def sum_in_order(terms: list[jax.Array]) -> jax.Array:
    """t0 + t1 + ... left to right: elementwise adds in a fixed order instead of an XLA reduction,
    whose order may change with the number of tokens."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total
