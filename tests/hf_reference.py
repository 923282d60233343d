"""Tiny random transformers Qwen3 / Qwen3-MoE / Qwen2 / Llama models: the outside reference for model
parity."""

from __future__ import annotations

import numpy as np
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

DENSE = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, max_position_embeddings=128
)
MOE = dict(DENSE, num_hidden_layers=3, moe_intermediate_size=24, num_experts=4)
# Llama 3.1's rope scaling with an original context of 16 positions: the test sequences (up to 12
# tokens at rope_theta 500000) put head frequencies in all three of its bands
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)

# name -> (model class, config class, config kwargs): tied/untied, GQA 1/2/4, head_dim != hidden/heads,
# MoE top-1/top-2, with/without norm_topk_prob, mlp_only_layers, decoder_sparse_step; Qwen2 (q/k/v
# biases, no q/k norms) tied/untied with an unused sliding_window as Qwen2.5's configs carry; Llama
# with the llama3 rope scaling tied/untied and with the default RoPE
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
    "qwen2-untied-gqa2": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(
            DENSE,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=64,
            max_window_layers=1,
        ),
    ),
    "qwen2-tied-gqa4-theta": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(
            DENSE,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    "llama-untied-llama3": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            DENSE,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters=LLAMA3_ROPE,
        ),
    ),
    "llama-tied-llama3-mha": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            DENSE,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            tie_word_embeddings=True,
            rope_parameters=LLAMA3_ROPE,
        ),
    ),
    "llama-untied-default": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(DENSE, num_attention_heads=4, num_key_value_heads=1, head_dim=12, tie_word_embeddings=False),
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
