"""Freezing for the rollout: :func:`quantize_params` turns every float matmul weight of a quantized
kind into the :class:`QuantizedWeight` AQT computes (the integers the training forward computes on
the fly); :func:`kind_of` tells a weight's kind from its path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import QuantizedWeight
from qarl_jax.quant.matmul import weight_quantizer
from qarl_jax.quant.spec import ATTENTION_MODULES, MLP_MODULES, QuantSpec


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def kind_of(path: tuple[str, ...]) -> str | None:
    """The layer kind of a parameter leaf, from its path of module/leaf names (None: not a matmul
    weight). Rules: any leaf under an ``experts`` module -> experts; ``kernel`` under q/k/v/o_proj ->
    attention, under gate/up/down_proj -> mlp, under lm_head -> lm_head, under ``gate`` or
    ``router`` -> router. Embedding tables are never frozen (they are gathered)."""
    if "experts" in path[:-1]:
        return "experts"
    if len(path) < 2 or path[-1] != "kernel":
        return None
    module = path[-2]
    if module in ATTENTION_MODULES:
        return "attention"
    if module in MLP_MODULES:
        return "mlp"
    if module == "lm_head":
        return "lm_head"
    if module in ("gate", "router"):
        return "router"
    return None


def quantize_params(params, spec: QuantSpec):
    """Freeze for the rollout: AQT turns every float weight whose kind is quantized into a
    QuantizedWeight (the integers the training forward computes on the fly); all other leaves are
    returned as is."""

    def freeze(path, leaf):
        kind = kind_of(tuple(_key_name(k) for k in path))
        if isinstance(leaf, QuantizedWeight) or kind is None or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        fmt, group_size = spec.format_of(kind)
        return leaf if fmt == "bf16" else weight_quantizer(fmt)(leaf, fmt, group_size)

    return jax.tree_util.tree_map_with_path(freeze, params, is_leaf=lambda v: isinstance(v, QuantizedWeight))
