"""Model config: presets sized for CPU and int4 groups, config.json round trip, validation errors."""

import jax
import pytest

from qarl_jax.models import PRESETS, Qwen3ForCausalLM, TransformerConfig, init_params, preset

# published checkpoints' architectures (for planning)
REAL = ("qwen3-1.7b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b")


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
    assert TransformerConfig.from_hf(config.to_hf()) == config


def test_moe_layer_rule():
    c = preset("qwen3-moe-tiny").replace(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [c.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_legacy_rope_theta_and_num_local_experts():
    raw = preset("qwen3-moe-tiny").to_hf()
    raw.pop("rope_parameters")
    raw["rope_theta"] = 123.0
    raw["num_local_experts"] = raw.pop("num_experts")
    c = TransformerConfig.from_hf(raw)
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
    ],
)
def test_unsupported_hf_configs(change, match):
    raw = dict(preset("qwen3-tiny").to_hf(), **change)
    with pytest.raises(ValueError, match=match):
        TransformerConfig.from_hf(raw, source="x/config.json")
