"""Model configuration (field names follow a Hugging Face ``config.json``), the families it covers
and tiny presets. What differs between Qwen3, Qwen2/Qwen2.5 and Llama 3 is data (:data:`FAMILIES`),
read by the one decoder in ``qwen3.py``; the translation to and from ``config.json`` and the
safetensors names lives in ``hf_config.py`` and ``safetensors_io.py``."""

from __future__ import annotations

import dataclasses
import decimal
from typing import Any

import jax.numpy as jnp
import numpy as np

from kernels_pallas.rowwise.common import PI_40, exact_inv_freq

REMAT_POLICIES = ("full", "save_dots", "none")


@dataclasses.dataclass(frozen=True)
class Family:
    """What one Hugging Face architecture changes in the shared decoder."""

    family: str  # TransformerConfig.family: the dense and MoE classes of one family share it
    model_type: str  # config.json's model_type
    moe: bool  # routed experts (num_experts > 0)
    qkv_bias: bool  # q/k/v projections carry a bias (o_proj and the MLP never do)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    rope_types: tuple[str, ...]  # the RoPE variants implemented for it ("default", "llama3")
    tie_default: bool  # tie_word_embeddings when config.json leaves it out (transformers' default)


# Hugging Face class name -> its family's data: the only place an architecture is named.
FAMILIES: dict[str, Family] = {
    "Qwen3ForCausalLM": Family("qwen3", "qwen3", False, False, True, ("default",), False),
    "Qwen3MoeForCausalLM": Family("qwen3", "qwen3_moe", True, False, True, ("default",), False),
    "Qwen2ForCausalLM": Family("qwen2", "qwen2", False, True, False, ("default",), False),
    "LlamaForCausalLM": Family("llama", "llama", False, False, False, ("default", "llama3"), False),
}


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's ``rope_scaling`` (``rope_type: llama3``): frequencies whose wavelength exceeds
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those below
    ``/ high_freq_factor`` kept, those between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not (self.factor > 0 and self.original_max_position_embeddings > 0):
            raise ValueError(
                f"llama3 rope_scaling needs factor and original_max_position_embeddings > 0: {self}"
            )
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor: {self}")

    def inv_freq(self, theta: float, head_dim: int) -> np.ndarray:
        """The scaled D/2 inverse frequencies: transformers' ``_compute_llama3_parameters`` formula
        in 40-digit decimal arithmetic, rounded to f32 once. Not its f32 steps: f32 ``power`` has
        CPU-dependent code paths (numpy's AVX-512 one differs from its baseline, torch's from both),
        so those bits depend on the host, and two hosts of one run would bake different constants
        into their programs; these are the same everywhere (within 3 ulp of transformers')."""
        with decimal.localcontext() as ctx:
            ctx.prec = 40
            old = decimal.Decimal(self.original_max_position_embeddings)
            low, high, factor = (
                decimal.Decimal(repr(float(v)))
                for v in (self.low_freq_factor, self.high_freq_factor, self.factor)
            )
            out = []
            for inv in exact_inv_freq(theta, head_dim):
                wavelen = 2 * PI_40 / inv
                if wavelen < old / high:
                    out.append(inv)
                elif wavelen > old / low:
                    out.append(inv / factor)
                else:
                    smooth = (old / wavelen - low) / (high - low)
                    out.append((1 - smooth) * inv / factor + smooth * inv)
            return np.array([float(f) for f in out], np.float64).astype(np.float32)


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
    """Architecture of a decoder-only causal LM of one of the :data:`FAMILIES` (Qwen3 dense or MoE,
    Qwen2/Qwen2.5, Llama 3); field names follow ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Llama3RopeScaling | None = None  # None: the default RoPE
    family: str = "qwen3"  # a Family.family of FAMILIES: qwen3 | qwen2 | llama
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
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd: RoPE rotates pairs of a head's lanes")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not any(f.family == self.family for f in FAMILIES.values()):
            families = sorted({f.family for f in FAMILIES.values()})
            raise ValueError(f"TransformerConfig.family={self.family!r} is not one of {families}")
        if not any(f.family == self.family and f.moe == self.is_moe for f in FAMILIES.values()):
            raise ValueError(
                f"family {self.family!r} has no {'MoE' if self.is_moe else 'dense'} model "
                "(the only MoE is Qwen3-MoE)"
            )
        if self.rope_scaling is not None and "llama3" not in self.spec.rope_types:
            raise ValueError(f"family {self.family!r} does not take the llama3 rope_scaling")
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
        kv, t = self.num_key_value_heads, self.tensor_blocks
        if kv % t and t % kv:
            raise ValueError(
                f"TransformerConfig.tensor_blocks={t} and the {kv} kv heads: one must divide the other "
                "(a block holds whole kv heads, or one kv head is shared by whole blocks)"
            )

    def column_blocks(self, projection: str) -> int:
        """The column blocks of ``projection`` (k_proj and v_proj: never narrower than a head)."""
        if projection in ("k_proj", "v_proj"):
            return min(self.tensor_blocks, self.num_key_value_heads)
        return self.tensor_blocks

    def projections(self) -> tuple[tuple[str, str, int], ...]:
        """(layer kind, projection, K) of every matmul weight, K its input width: what a quantization
        format's groups along K must divide (checked before any weight loads)."""
        h, heads = self.hidden_size, self.num_attention_heads * self.head_dim
        out = [("attention", p, h) for p in ("q_proj", "k_proj", "v_proj")] + [("attention", "o_proj", heads)]
        if not all(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            out += [("mlp", "gate_proj", h), ("mlp", "up_proj", h)]
            out += [("mlp", "down_proj", self.intermediate_size)]
        if self.is_moe:
            inter = self.moe_intermediate_size
            out += [("router", "gate", h), ("experts", "experts gate_proj", h)]
            out += [("experts", "experts up_proj", h), ("experts", "experts down_proj", inter)]
        return (*out, ("lm_head", "lm_head", h))

    @property
    def kv_replicas(self) -> int:
        """How many column blocks share each kv head: ``tensor_blocks / num_key_value_heads`` when the
        blocks outnumber the kv heads, else 1. Each block then attends with its own copy of its kv
        head (the forward repeats k and v that many times), so a tensor-parallel engine of that
        degree, whose devices hold one copy each (vLLM's kv-head replication), runs every block's
        attention on the same shapes as the training forward."""
        kv = self.num_key_value_heads
        return self.tensor_blocks // kv if self.tensor_blocks > kv else 1

    @property
    def cache_kv_heads(self) -> int:
        """kv heads in the attention and the KV cache: ``num_key_value_heads`` times its replicas."""
        return self.num_key_value_heads * self.kv_replicas

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
        """The Hugging Face class name (a key of :data:`FAMILIES`)."""
        return next(k for k, f in FAMILIES.items() if f.family == self.family and f.moe == self.is_moe)

    @property
    def spec(self) -> Family:
        """This model's row of :data:`FAMILIES`."""
        return FAMILIES[self.architecture]

    @property
    def rope_inv_freq(self) -> tuple[float, ...] | None:
        """RoPE's D/2 inverse frequencies when scaled (llama3), None for theta's default ones (the
        kernels compute those themselves)."""
        if self.rope_scaling is None:
            return None
        return tuple(float(f) for f in self.rope_scaling.inv_freq(self.rope_theta, self.head_dim))

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)


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

# Qwen2.5-Math (Qwen2ForCausalLM: q/k/v biases, no q/k norms; the paper's Qwen2.5 rows) and Llama 3
# (LlamaForCausalLM, llama3 rope_scaling), their config.json values
PRESETS["qwen2.5-math-1.5b"] = TransformerConfig(  # 1.54B params
    family="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
PRESETS["qwen2.5-math-7b"] = PRESETS["qwen2.5-math-1.5b"].replace(  # 7.62B params
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
PRESETS["llama-3.2-1b"] = TransformerConfig(  # 1.24B params
    family="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192),
    tie_word_embeddings=True,
    max_position_embeddings=131072,
)
PRESETS["llama-3.1-8b"] = PRESETS["llama-3.2-1b"].replace(  # 8.03B params
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    head_dim=128,
    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192),
    tie_word_embeddings=False,
)
# tiny ones of each family for tests: Qwen2 tied (as Qwen2.5-Math-1.5B), Llama untied with a
# llama3 scaling whose original context (64) puts frequencies in all three of its bands
PRESETS["qwen2-tiny"] = _TINY.replace(family="qwen2")
PRESETS["llama-tiny"] = _TINY.replace(
    family="llama",
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64),
    tie_word_embeddings=False,
)


def preset(name: str, **overrides) -> TransformerConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
