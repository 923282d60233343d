"""Qwen3 dense and MoE models (Flax linen), their configs, presets and Hugging Face import/export."""

from qarl_jax.models.config import PRESETS, TransformerConfig, preset
from qarl_jax.models.hf_io import CheckpointError, from_pretrained, load_tokenizer, save_pretrained
from qarl_jax.models.qwen3 import KVCache, Qwen3ForCausalLM, init_params, init_sharded

__all__ = [
    "PRESETS",
    "CheckpointError",
    "KVCache",
    "TransformerConfig",
    "Qwen3ForCausalLM",
    "from_pretrained",
    "init_params",
    "init_sharded",
    "load_tokenizer",
    "preset",
    "save_pretrained",
]
