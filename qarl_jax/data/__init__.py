"""Prompt data for RL: sources (synthetic, JSONL, TFDS), templates, tokenizers and grain pipelines."""

from qarl_jax.data.arith_tokenizer import build_arithmetic_tokenizer
from qarl_jax.data.config import DataConfig, SyntheticConfig
from qarl_jax.data.jsonl import JsonlSource
from qarl_jax.data.pipeline import PromptIterator, build_dataset, build_pipeline, make_source
from qarl_jax.data.records import MalformedRowError, Rejected
from qarl_jax.data.synthetic import SyntheticArithmetic
from qarl_jax.data.templates import BOXED_INSTRUCTION, apply_template

__all__ = [
    "BOXED_INSTRUCTION",
    "DataConfig",
    "JsonlSource",
    "MalformedRowError",
    "PromptIterator",
    "Rejected",
    "SyntheticArithmetic",
    "SyntheticConfig",
    "apply_template",
    "build_arithmetic_tokenizer",
    "build_dataset",
    "build_pipeline",
    "make_source",
]
