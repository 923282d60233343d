"""The full-sequence forward over a batch in chunks of rows, in layer-major order: each layer's
weights gathered once, then every chunk run through that layer.

Why: a forward-only pass over a batch (old log-probs, the KL reference) runs in chunks of rows so
that one chunk's layer temporaries and logits are alive at a time. Chunk after chunk (the whole
layer stack per chunk), each chunk re-gathers every layer's FSDP-sharded weights: the TPU compiler
counted 967 GB of collectives a chip per pass for ``configs/qwen3_30b_a3b_v5p64.yaml`` (8 chunks of
the f32 master weights), 2,734 GB for the 235B. Layer-major, each layer's weights cross the
interconnect once a pass.

Bits: every chunk meets each layer as it does chunk-major: the same :class:`DecoderLayer` on the
same rows, positions and weights (only the loop nest is swapped), and the embedding, the final
norm and the head are the same row-wise ops, so the hidden states are the chunk-major pass's bit
for bit (``tests/test_layer_major.py``). Memory: every chunk's hidden states live at once (the
batch's [rows, T, H] in the compute dtype, a chip's share) plus one layer's gathered weights; a
layer's temporaries are one chunk's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from qarl_jax.models.config import TransformerConfig
from qarl_jax.models.qwen3 import DecoderLayer, Qwen3ForCausalLM, _expert_axis
from qarl_jax.models.stacking import layer_runs, run_key

GATHER_SCOPE = "gather_weights"  # the name scope of the weights' once-a-pass gathers


def split_rows(v: jax.Array, chunks: int) -> jax.Array:
    """[N, ...] -> [chunks, N / chunks, ...], chunk c holding rows c, c + chunks, c + 2 chunks, ...:
    the rows sit on the devices in contiguous blocks, so every chunk is a slice of each device's
    own rows (no resharding) and all chunks have one shape (one compile)."""
    return jnp.swapaxes(v.reshape(-1, chunks, *v.shape[1:]), 0, 1)


def merge_rows(v: jax.Array) -> jax.Array:
    """The inverse of :func:`split_rows`: [chunks, N / chunks, ...] -> [N, ...] in row order."""
    return jnp.swapaxes(v, 0, 1).reshape(-1, *v.shape[2:])


def gathered_layer(c: TransformerConfig, layer_params: dict) -> dict:
    """One layer's weights laid out as its per-device programs read them, once: whole (the
    projections, norms, router), the experts split over the expert axis when the MoE is expert
    parallel (:func:`qarl_jax.models.qwen3._expert_axis`). A no-op off a mesh. Without it XLA:TPU
    leaves the FSDP all-gather inside the chunk loop (as it did for the head,
    ``qarl_jax.rl.logprobs._gathered_head``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or mesh.manual_axes:
        return layer_params
    axis = _expert_axis(c)
    experts = P() if axis is None else P(axis)

    def place(path, w):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return lax.with_sharding_constraint(w, experts if "experts" in names else P())

    with jax.named_scope(GATHER_SCOPE):  # names the gathers in the HLO (tests find them by it)
        return jax.tree_util.tree_map_with_path(place, layer_params)


def hidden(
    model: Qwen3ForCausalLM,
    params: dict,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    chunks: int,
) -> jax.Array:
    """Final-norm hidden states [chunks, N / chunks, T, H] of ``tokens`` [N, T] (chunks as
    :func:`split_rows` cuts them): for each chunk bitwise ``model.apply(..., method="hidden")`` of
    its rows, computed layer by layer over all chunks. ``model`` is the forward to run (its
    ``quant`` spec is every layer's). Meant for forward-only passes: differentiated, it would keep
    every chunk's activations of every layer at once."""
    c = model.config
    variables = {"params": params}
    embed = jnp.asarray(model.apply(variables, tokens, method=lambda m, t: m.embed_tokens(t)))  # a lookup
    x = split_rows(embed, chunks)
    t = tokens.shape[1]
    starts = jnp.arange(t, dtype=jnp.int32)[None, :] - positions.astype(jnp.int32)
    rows = tuple(split_rows(v, chunks) for v in (positions, starts, segment_ids))

    def through(layer: int, weights: dict, x: jax.Array) -> jax.Array:
        module = DecoderLayer(c, layer, model.quant)
        weights = gathered_layer(c, weights)

        def one(args):
            xc, pos, st, seg = args
            (out, _), _ = module.apply({"params": weights}, (xc, None), pos, st, seg)
            return out

        return lax.map(one, (x, *rows))

    if c.scan_layers:
        for start, stop in layer_runs(c):
            body = lambda x, w, start=start: (through(start, w, x), None)  # noqa: E731
            x, _ = lax.scan(body, x, params[run_key(start, stop)])
    else:
        for i in range(c.num_hidden_layers):
            x = through(i, params[f"layers_{i}"], x)
    return lax.map(lambda xc: model.apply(variables, xc, method=lambda m, h: m.norm(h)), x)
