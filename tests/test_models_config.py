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
    """The scaled RoPE frequencies are transformers' own (f32), bit for bit."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = preset(name)
    hf = transformers.LlamaConfig(**{k: v for k, v in config_to_hf(c).items() if k != "architectures"})
    inv, scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert scale == 1.0
    np.testing.assert_array_equal(np.asarray(c.rope_inv_freq, np.float32), inv.numpy())
