"""Model configuration mirroring a Hugging Face Qwen3 / Qwen3-MoE ``config.json``, and tiny presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

REMAT_POLICIES = ("full", "save_dots", "none")
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}

# config.json keys we read; anything else in the file is carried through untouched on export.
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
    "use_sliding_window",
    "architectures",
    "model_type",
}


FLOAT_DTYPES = ("float32", "bfloat16")


def dtype_name(dtype: Any, what: str) -> str:
    """``dtype`` ("bfloat16", ``jnp.bfloat16``, ``np.float32``, ``jnp.dtype("float32")``) as the
    name the configs store, so JAX's own dtype objects work wherever a name does (the Flax and
    MaxText convention); ``what`` names the argument in the error."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in FLOAT_DTYPES:
        raise ValueError(f"{what} must be one of {FLOAT_DTYPES} (a name or a JAX/NumPy dtype), got {dtype!r}")
    return name


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture of a Qwen3 dense or MoE causal LM (field names follow ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    # MoE (num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # numerics: params are stored in param_dtype, matmuls run in dtype
    param_dtype: str = "float32"
    dtype: str = "float32"
    # config.json entries we do not interpret, kept for a faithful export
    extra_hf: tuple[tuple[str, Any], ...] = ()
    # execution (not exported): scan runs of identical layers over stacked parameters (one compiled
    # layer per run instead of one per layer), and what a rematerialised layer saves for the
    # backward pass: "full" nothing, "save_dots" the matmul outputs, "none" everything (no remat)
    scan_layers: bool = False
    remat_policy: str = "full"
    # column blocks every projection computes in (q/k/v/o, gate/up/down, lm_head; k and v in at most
    # num_key_value_heads): each block is its own kernel call on a [K, N / blocks] slice, so a
    # tensor-parallel engine of this degree, whose device holds one block, computes the same bits
    tensor_blocks: int = 1

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransformerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts]")
        if self.is_moe and self.moe_intermediate_size <= 0:
            raise ValueError("a MoE config needs moe_intermediate_size > 0")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"TransformerConfig.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}"
            )
        for name in ("param_dtype", "dtype"):
            object.__setattr__(self, name, dtype_name(getattr(self, name), f"TransformerConfig.{name}"))
        if self.tensor_blocks < 1 or self.num_attention_heads % self.tensor_blocks:
            raise ValueError(
                f"TransformerConfig.tensor_blocks={self.tensor_blocks} must be >= 1 and divide the "
                f"{self.num_attention_heads} attention heads (a block holds whole heads)"
            )

    def column_blocks(self, projection: str) -> int:
        """The column blocks of ``projection`` (k_proj and v_proj: never narrower than a head)."""
        if projection in ("k_proj", "v_proj"):
            return min(self.tensor_blocks, self.num_key_value_heads)
        return self.tensor_blocks

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % max(self.decoder_sparse_step, 1) == 0
        )

    @property
    def architecture(self) -> str:
        return "Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, source: str = "config.json", **overrides) -> TransformerConfig:
        """Build from a parsed ``config.json``; raises naming ``source`` on what it cannot run."""
        archs = cfg.get("architectures") or []
        arch = (
            archs[0]
            if archs
            else {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(
                cfg.get("model_type", "")
            )
        )
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"qarl_jax runs {sorted(ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={cfg['hidden_act']!r} is not supported (Qwen3 uses silu)")
        if cfg.get("attention_bias", False):
            raise ValueError(f"{source}: attention_bias=true is not supported (Qwen3 has no attention bias)")
        if cfg.get("use_sliding_window", False):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (only the default RoPE)")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
            if k not in cfg
        ]
        if missing:
            raise ValueError(f"{source}: missing required keys {missing}")
        heads = cfg["num_attention_heads"]
        is_moe = ARCHITECTURES[arch] == "qwen3_moe"
        fields = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 40960),
        )
        if is_moe:
            fields.update(
                num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)),
                num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
                moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
                norm_topk_prob=cfg.get("norm_topk_prob", True),
                decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            )
        extra = tuple(sorted((k, v) for k, v in cfg.items() if k not in _HF_KEYS and k != "dtype"))
        return cls(**fields, extra_hf=extra, **overrides)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers reads back."""
        out: dict[str, Any] = dict(self.extra_hf)
        out.update(
            architectures=[self.architecture],
            model_type="qwen3_moe" if self.is_moe else "qwen3",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=False,
            use_sliding_window=False,
            dtype=self.param_dtype,
        )
        if self.is_moe:
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return out


# Tiny presets for tests and the CPU default: hidden/intermediate sizes are multiples of 128 so
# int4 group quantization (group 128) applies to every projection.
_TINY = TransformerConfig(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
_QWEN3_1_7B = TransformerConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
)
PRESETS: dict[str, TransformerConfig] = {
    "qwen3-tiny": _TINY,  # 0.8M params
    "qwen3-small": _TINY.replace(  # 4.7M params
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    "qwen3-moe-tiny": _TINY.replace(  # 1.6M params, 8 experts top-2, first layer dense
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        mlp_only_layers=(0,),
    ),
    # Real checkpoints' architectures (their Hugging Face config.json values), for planning runs
    # without the weights (python -m qarl_jax.tools.memory_plan) and GPU benchmarks at real shapes.
    "qwen3-1.7b": _QWEN3_1_7B,
    "qwen3-8b": _QWEN3_1_7B.replace(  # 8.19B params
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": _QWEN3_1_7B.replace(  # 30.5B params, 3.3B active: 128 experts top-8 in every layer
        num_hidden_layers=48,  # intermediate_size 6144 is in its config.json, unused: every layer is sparse
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
    ),
}
# 235B params, 22B active: Qwen3-30B-A3B's MoE (128 experts, top-8 in every layer, 4 kv heads) wider
# and deeper (intermediate_size is in its config.json, unused: every layer is sparse)
PRESETS["qwen3-235b-a22b"] = PRESETS["qwen3-30b-a3b"].replace(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=94,
    num_attention_heads=64,
    moe_intermediate_size=1536,
)


def preset(name: str, **overrides) -> TransformerConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
