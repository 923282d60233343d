"""Tiny random transformers Qwen3 / Qwen3-MoE models: the outside reference for model parity."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

DENSE = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, max_position_embeddings=128
)
MOE = dict(DENSE, num_hidden_layers=3, moe_intermediate_size=24, num_experts=4)

# name -> (model class, config class, config kwargs): tied/untied, GQA 1/2/4, head_dim != hidden/heads,
# MoE top-1/top-2, with/without norm_topk_prob, mlp_only_layers, decoder_sparse_step
CASES = {
    "dense-untied-gqa2": (
        Qwen3ForCausalLM,
        Qwen3Config,
        dict(DENSE, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    ),
    "dense-tied-mha": (
        Qwen3ForCausalLM,
        Qwen3Config,
        dict(DENSE, num_attention_heads=4, num_key_value_heads=4, head_dim=12, tie_word_embeddings=True),
    ),
    "dense-gqa4-theta": (
        Qwen3ForCausalLM,
        Qwen3Config,
        dict(
            DENSE,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    "moe-top2-norm-mlponly": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        dict(
            MOE,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "moe-top1-nonorm": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        dict(
            MOE,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            num_experts_per_tok=1,
            norm_topk_prob=False,
        ),
    ),
    "moe-top2-sparse-step2-tied": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        dict(
            MOE,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
    ),
}


def random_model(model_cls, config, seed: int = 0, scale: float = 0.2):
    """A random transformers model perturbed away from its default init by ``scale`` x N(0, 1)
    (norm weights of ones, zero-ish routers and equal experts would hide bugs)."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def make_hf_model(case: str, seed: int = 0):
    """:func:`random_model` of one of the :data:`CASES`."""
    model_cls, config_cls, kwargs = CASES[case]
    return random_model(model_cls, config_cls(**kwargs), seed)


def padded_batch(vocab: int, batch: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens and an attention mask with right padding of random lengths (row 0 full)."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, vocab, (batch, length))
    lengths = np.concatenate([[length], rng.randint(1, length + 1, batch - 1)])
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
    return tokens, mask
