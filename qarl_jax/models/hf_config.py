"""config.json <-> :class:`TransformerConfig`: the Hugging Face config translation, per family by the
data in :data:`qarl_jax.models.config.FAMILIES`. Apart from the weights' loader so that the
compressed-tensors export (and tools that plan from a config) use it without importing the loader.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from qarl_jax.errors import CheckpointError
from qarl_jax.models.config import FAMILIES, Llama3RopeScaling, TransformerConfig
from qarl_jax.models.safetensors_io import as_path

# config.json keys we read; anything else in the file is carried through untouched on export
_HF_KEYS = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "layer_types",
    "architectures",
    "model_type",
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(cfg: dict[str, Any], arch: str, source: str) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from ``rope_parameters`` (transformers 5) or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in FAMILIES[arch].rope_types:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported for {arch}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise ValueError(f"{source}: the llama3 rope scaling lacks {missing}")
    factor, low, high, original = (rope[k] for k in _LLAMA3_KEYS)
    return theta, Llama3RopeScaling(float(factor), float(low), float(high), int(original))


def config_from_hf(cfg: dict[str, Any], *, source: str = "config.json", **overrides) -> TransformerConfig:
    """A parsed ``config.json`` -> :class:`TransformerConfig` (``overrides``: further fields);
    raises one line naming ``source`` and the setting on what this package does not run."""
    archs = cfg.get("architectures") or []
    by_type = {f.model_type: name for name, f in FAMILIES.items()}
    arch = archs[0] if archs else by_type.get(cfg.get("model_type", ""))
    if arch not in FAMILIES:
        raise ValueError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"qarl_jax runs {sorted(FAMILIES)}"
        )
    family = FAMILIES[arch]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={cfg['hidden_act']!r} is not supported ({arch} uses silu)")
    for key in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases are its architecture's, not these
        if cfg.get(key, False):
            raise ValueError(f"{source}: {key}=true is not supported")
    if cfg.get("use_sliding_window", False):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (sliding-window attention)")
    sliding = sorted({t for t in cfg.get("layer_types") or () if t != "full_attention"})
    if sliding:
        raise ValueError(f"{source}: layer_types {sliding} are not supported (only full_attention)")
    missing = [
        k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in cfg
    ]
    if missing:
        raise ValueError(f"{source}: missing required keys {missing}")
    rope_theta, rope_scaling = _rope(cfg, arch, source)
    heads = cfg["num_attention_heads"]
    fields: dict[str, Any] = dict(
        family=family.family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0),
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", family.tie_default),
        max_position_embeddings=cfg.get("max_position_embeddings", 40960),
    )
    if family.moe:
        fields.update(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    extra = tuple(sorted((k, v) for k, v in cfg.items() if k not in _HF_KEYS and k != "dtype"))
    return TransformerConfig(**fields, extra_hf=extra, **overrides)


def config_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` dict transformers reads back: its family's class, model_type and keys."""
    family = c.spec
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, **dataclasses.asdict(c.rope_scaling)}
    out: dict[str, Any] = dict(c.extra_hf)
    out.update(
        architectures=[c.architecture],
        model_type=family.model_type,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        rope_parameters=rope,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings,
        dtype=c.param_dtype,
    )
    if not family.qkv_bias:  # the classes whose attention biases are a setting (we run none)
        out.update(attention_bias=False)
    if c.family == "llama":
        out.update(mlp_bias=False)
    else:
        out.update(use_sliding_window=False)
    if c.is_moe:
        out.update(
            num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.moe_intermediate_size,
            norm_topk_prob=c.norm_topk_prob,
            decoder_sparse_step=c.decoder_sparse_step,
            mlp_only_layers=list(c.mlp_only_layers),
        )
    return out


def load_config(ckpt: str | os.PathLike, **overrides) -> TransformerConfig:
    """The checkpoint directory's config.json (local or ``gs://``) as a :class:`TransformerConfig`
    (``overrides``: further fields); one line naming the file on what this package does not run."""
    f = as_path(ckpt) / "config.json"
    if not f.exists():
        raise CheckpointError(f"{ckpt}: config.json is missing (not a Hugging Face model directory?)")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: invalid JSON ({e})") from e
    try:
        return config_from_hf(raw, source=str(f), **overrides)
    except (TypeError, ValueError) as e:  # an architecture or setting this package does not run
        raise CheckpointError(str(e)) from e
