"""Model config: presets sized for CPU and int4 groups, config.json round trip, validation errors."""

import jax
import numpy as np
import pytest

from qarl_jax.models import PRESETS, Qwen3ForCausalLM, init_params, preset
from qarl_jax.models.hf_io import config_from_hf, config_to_hf

# published checkpoints' architectures (for planning)
REAL = (
    "qwen3-1.7b",
    "qwen3-8b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "qwen2.5-math-1.5b",
    "qwen2.5-math-7b",
    "llama-3.2-1b",
    "llama-3.1-8b",
)


@pytest.mark.parametrize("name", sorted(set(PRESETS) - set(REAL)))
def test_presets_are_tiny_and_int4_groupable(name):
    config = preset(name)
    shapes = jax.eval_shape(lambda: init_params(Qwen3ForCausalLM(config), jax.random.key(0)))
    n = sum(x.size for x in jax.tree.leaves(shapes))
    assert 0.5e6 <= n <= 5e6, n
    dims = [config.hidden_size, config.intermediate_size, config.num_attention_heads * config.head_dim]
    if config.is_moe:
        dims.append(config.moe_intermediate_size)
    assert all(d % 128 == 0 for d in dims), dims


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
    config = preset(name)
    assert config_from_hf(config_to_hf(config)) == config


def test_moe_layer_rule():
    c = preset("qwen3-moe-tiny").replace(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [c.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_legacy_rope_theta_and_num_local_experts():
    raw = config_to_hf(preset("qwen3-moe-tiny"))
    raw.pop("rope_parameters")
    raw["rope_theta"] = 123.0
    raw["num_local_experts"] = raw.pop("num_experts")
    c = config_from_hf(raw)
    assert (c.rope_theta, c.num_experts) == (123.0, 8)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
        (dict(dtype="float16"), "dtype must be"),
        (dict(hidden_size=0), "hidden_size must be positive"),
    ],
)
def test_invalid_configs(change, match):
    with pytest.raises(ValueError, match=match):
        preset("qwen3-moe-tiny", **change)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "sliding_window"),
        ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types \\['sliding_attention'\\]"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope type 'llama3'"),
    ],
)
def test_unsupported_hf_configs(change, match):
    raw = dict(config_to_hf(preset("qwen3-tiny")), **change)
    with pytest.raises(ValueError, match=match):
        config_from_hf(raw, source="x/config.json")


@pytest.mark.parametrize(
    "name, change, match",
    [
        ("qwen2-tiny", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=true"),
        ("llama-tiny", {"attention_bias": True}, "attention_bias=true"),
        ("llama-tiny", {"mlp_bias": True}, "mlp_bias=true"),
        ("llama-tiny", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        (
            "llama-tiny",
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "llama3 rope scaling lacks",
        ),
    ],
)
def test_unsupported_settings_of_the_other_families(name, change, match):
    raw = dict(config_to_hf(preset(name)), **change)
    with pytest.raises(ValueError, match=match):
        config_from_hf(raw, source="x/config.json")


def test_families_are_data():
    """Qwen2.5's config.json (an unused sliding_window beside use_sliding_window false) and Llama
    3.1's older format (top-level rope_theta, rope_scaling) load; a MoE is Qwen3-MoE only."""
    raw = dict(config_to_hf(preset("qwen2.5-math-1.5b")), sliding_window=4096, max_window_layers=21)
    c = config_from_hf(raw)
    assert (c.architecture, c.spec.qkv_bias, c.spec.qk_norm) == ("Qwen2ForCausalLM", True, False)
    assert config_to_hf(c)["sliding_window"] == 4096 and config_to_hf(c)["use_sliding_window"] is False
    raw = config_to_hf(preset("llama-3.1-8b"))
    raw["rope_scaling"] = {k: v for k, v in raw.pop("rope_parameters").items() if k != "rope_theta"}
    assert config_from_hf(raw) == preset("llama-3.1-8b")
    with pytest.raises(ValueError, match="family 'llama' has no MoE model"):
        preset("llama-tiny", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b", "llama-tiny"])
def test_llama3_frequencies_are_transformers(name):
    """The scaled RoPE frequencies are transformers' own formula: within 3 ulp of its f32 values.
    Not bit for bit: transformers computes them in f32 with torch's ``pow``, whose last bit depends
    on the host's CPU (its vector paths; on one host 10 of 32 base frequencies are 1 ulp from the
    correctly rounded ones), and its f32 steps in the band between ``low_freq_factor`` and
    ``high_freq_factor`` lose up to 2 ulp more; ours are the exact values rounded once, the same on
    every host (their bits: ``test_rope_frequencies_are_pinned``)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = preset(name)
    hf = transformers.LlamaConfig(**{k: v for k, v in config_to_hf(c).items() if k != "architectures"})
    inv, scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert scale == 1.0
    ours = np.asarray(c.rope_inv_freq, np.float32)
    assert ours.shape == inv.shape == (c.head_dim // 2,)
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - inv.numpy().view(np.int32).astype(np.int64))
    assert ulps.max() <= 3, ulps


# Qwen3's theta (1e6) at its head dim 128, and llama-tiny's llama3 scaling (theta 5e5, head dim 32,
# factor 8, low 1, high 4, original context 64): the f32 bits every host must compute
QWEN3_BITS = """
3f800000 3f4e4bac 3f263de0 3f05f6ee 3ed7e89b 3eadfcff 3e8c3504 3e61f836 3e361887 3e12bd91 3dec7fd5
3dbe94c7 3d99940e 3d778512 3d47763f 3d20bc1d 3d0186e2 3cd0c1a8 3ca8398b 3c879008 3c5a7bf1 3c301052
3c0de12d 3be4aa46 3bb8449c 3b947dae 3b6f520d 3b40dac5 3b1b690d 3afa78f1 3ac9d75c 3aa2a6f6 3a83126f
3a533f27 3a2a3b43 3a092e02 39dd1726 39b229fb 398f9272 39676491 393a7753 39164323 38f22ce3 38c327b5
389d43a4 387d75d5 384c3fbd 382497ab 3804a2b3 37d5c442 37ac431d 378ad0ed 375fba4f 37344a0e 371148e2
36ea2731 36bcb0c1 36980e02 36751070 36457bab 361f23e4 36003dec 35ceaf79 35a68e4c
"""
LLAMA_TINY_BITS = """
3f800000 3ee177bb 3da29e0b 3c2ee4ad 3b9a08c8 3b07a9c3 3a6ef74e 39d27720 39395d22 38a3418d 380fc8f8
377d45c2 36df10c4 36447611 35ad07a7 351864a7
"""


def _f32_of(values) -> np.ndarray:
    """mpmath values (200 bits) rounded once to f32 (24 bits, nearest even)."""
    import mpmath

    with mpmath.mp.workprec(24):
        return np.array([float(+v) for v in values], np.float32)


def _theta_exact(theta: float, d: int) -> list:
    import mpmath

    with mpmath.mp.workprec(200):
        return [1 / mpmath.power(mpmath.mpf(theta), mpmath.mpf(i) / d) for i in range(0, d, 2)]


def _llama3_exact(c) -> list:
    """transformers' ``_compute_llama3_parameters`` formula in 200-bit arithmetic."""
    import mpmath

    s, out = c.rope_scaling, []
    with mpmath.mp.workprec(200):
        old, low, high = mpmath.mpf(s.original_max_position_embeddings), s.low_freq_factor, s.high_freq_factor
        for inv in _theta_exact(c.rope_theta, c.head_dim):
            wavelen = 2 * mpmath.pi / inv
            if wavelen < old / high:
                out.append(inv)
            elif wavelen > old / low:
                out.append(inv / s.factor)
            else:
                smooth = (old / wavelen - low) / (mpmath.mpf(high) - low)
                out.append((1 - smooth) * inv / s.factor + smooth * inv)
    return out


def _bits(a) -> list[str]:
    return [f"{v:08x}" for v in np.asarray(a, np.float32).view(np.uint32)]


def test_rope_frequencies_are_pinned():
    """RoPE's frequencies are host-independent constants: the exact values rounded to f32 once
    (derived here in mpmath, apart from the project's decimal arithmetic) and these very bits, for
    theta's (what every backend's kernel bakes in) and for the llama3 scaling (the config's)."""
    from kernels_pallas.rowwise.common import inv_freq

    c = preset("llama-tiny")
    assert (c.rope_theta, c.head_dim) == (500000.0, 32)
    assert (preset("qwen3-8b").rope_theta, preset("qwen3-8b").head_dim) == (1_000_000.0, 128)
    assert _bits(inv_freq(1e6, 128)) == QWEN3_BITS.split() == _bits(_f32_of(_theta_exact(1e6, 128)))
    assert _bits(c.rope_inv_freq) == LLAMA_TINY_BITS.split() == _bits(_f32_of(_llama3_exact(c)))
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        assert _bits(preset(name).rope_inv_freq) == _bits(_f32_of(_llama3_exact(preset(name))))
    for theta, d in [(1e4, 64), (5e5, 128), (1234.5, 8), (1e6, 256)]:
        assert _bits(inv_freq(theta, d)) == _bits(_f32_of(_theta_exact(theta, d))), (theta, d)
