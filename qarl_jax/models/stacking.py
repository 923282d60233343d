"""Where each decoder layer's parameters live, per-layer or stacked, and conversion between the two.

With ``TransformerConfig.scan_layers`` the decoder is one ``nn.scan`` per run of consecutive layers of the
same kind (dense MLP or MoE: ``mlp_only_layers`` / ``decoder_sparse_step`` split the runs); run
``[start, stop)`` keeps its layers' parameters stacked on a leading axis under the top-level key
``stack_{start}_{stop}``. Without it, layer i is ``layers_{i}`` (the Hugging Face-like layout).
Checkpoint import/export, routing read-back and tests go through these helpers, never through
either naming directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qarl_jax.models.config import TransformerConfig


def layer_runs(config: TransformerConfig) -> tuple[tuple[int, int], ...]:
    """Maximal runs ``(start, stop)`` of consecutive layers of one kind (dense MLP or MoE)."""
    runs, start = [], 0
    for i in range(1, config.num_hidden_layers + 1):
        if i == config.num_hidden_layers or config.is_moe_layer(i) != config.is_moe_layer(start):
            runs.append((start, i))
            start = i
    return tuple(runs)


def run_key(start: int, stop: int) -> str:
    """Top-level parameter key of the stacked run of layers ``[start, stop)``."""
    return f"stack_{start}_{stop}"


def layer_location(config: TransformerConfig, layer: int) -> tuple[str, int | None]:
    """(top-level key, index on the stacked axis or None) of layer ``layer``'s parameters."""
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(f"layer {layer} is out of range for a {config.num_hidden_layers}-layer model")
    if not config.scan_layers:
        return f"layers_{layer}", None
    start, stop = next(r for r in layer_runs(config) if r[0] <= layer < r[1])
    return run_key(start, stop), layer - start


def stack_layers(params: dict, config: TransformerConfig) -> dict:
    """A per-layer (``layers_{i}``) tree -> the stacked layout of ``config`` (which scans)."""
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    for start, stop in layer_runs(config):
        layers = [params[f"layers_{i}"] for i in range(start, stop)]
        out[run_key(start, stop)] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return out


def unstack_layers(params: dict, config: TransformerConfig) -> dict:
    """The stacked layout of ``config`` -> per-layer ``layers_{i}`` trees (slices of the stacks)."""
    out = {k: v for k, v in params.items() if not k.startswith("stack_")}
    for start, stop in layer_runs(config):
        stack = params[run_key(start, stop)]
        for i in range(start, stop):
            out[f"layers_{i}"] = jax.tree.map(lambda x, j=i - start: x[j], stack)
    return out
