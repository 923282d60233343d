"""Every divisibility the kernels assume, one test each: a shape is either taken (with the bits kept)
or refused when the config is checked, in one line naming what is wrong and what to set.

Rules: int4 groups along K (the default group taken per K: 128, else a power of two that divides
K, so a hidden size of 192 runs in groups of 64; a named group size a projection's K cannot take
refused naming the projection); two int4 values per byte (K even); RoPE's pairs (head_dim even);
the GPU kernels' power-of-two heads and groups and the TPU's groups of 64 (refused on those
backends: pure check here); heads a multiple of kv heads and of the column blocks; a vocabulary the
column blocks do not divide (taken: zero columns padded and cut). The expert axis's rule is
test_rollout_layout's; the bitwise end-to-end run of a hidden-192 Qwen2 checkpoint is
test_families_alignment's."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas.shapes import unsupported_shape
from qarl_jax.errors import ConfigError
from qarl_jax.models import preset
from qarl_jax.models.hf_io import config_to_hf
from qarl_jax.quant import QuantSpec, aqt, dot, quantize_params
from qarl_jax.run.build import quant_group_sizes
from qarl_jax.tools.check_alignment import main

# hidden 192 = 6 heads of 32 (2 kv heads), MLP 512: 128 divides only the down projection's K
H192 = preset("qwen3-tiny").replace(
    hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=512
)


@pytest.mark.parametrize(
    "k, group", [(64, 64), (96, 96), (128, 128), (160, 32), (192, 64), (320, 64), (384, 128), (512, 128)]
)
def test_default_int4_group_is_chosen_per_k(k, group):
    for fmt in ("w4a16", "w4a8"):
        assert kp.resolve_group_size(fmt, k, None) == group


def test_quantize_and_aqt_take_the_default_group_of_k_192():
    w = jax.random.normal(jax.random.key(1), (192, 8), jnp.float32)
    ours, theirs = kp.quantize(w, "w4a16"), aqt.quantize(w, "w4a16")
    assert ours.group_size == theirs.group_size == 64 and ours.scales.shape == (3, 8)
    np.testing.assert_array_equal(np.asarray(ours.values), np.asarray(theirs.values))


def test_a_k_no_default_group_divides_is_one_line():
    with pytest.raises(ValueError, match=r"no power-of-two group size from 32 to 128 divides K=200") as e:
        kp.resolve_group_size("w4a16", 200, None)
    assert "\n" not in str(e.value)
    assert kp.resolve_group_size("w4a16", 200, 8) == 8  # a named even divisor still runs
    with pytest.raises(ValueError, match="K=201 is odd"):
        kp.resolve_group_size("w4a16", 201, None)


def test_group_sizes_of_a_hidden_192_model_are_reported_per_projection():
    sizes = quant_group_sizes(QuantSpec(fmt="w4a16"), H192)
    assert sizes == dict(q_proj=64, k_proj=64, v_proj=64, o_proj=64, gate_proj=64, up_proj=64, down_proj=128)
    assert quant_group_sizes(QuantSpec(fmt="w8a8"), H192) == {}
    assert quant_group_sizes(QuantSpec(fmt="bf16", group_size=128), H192) == {}


@pytest.mark.parametrize(
    "spec, arch, message",
    [
        (QuantSpec(fmt="w4a16", group_size=128), H192, r"q_proj \(attention projection, K=192\)"),
        (  # the attention output's K is heads x head_dim, not the hidden size
            QuantSpec(fmt="w4a8", group_size=128),
            preset("qwen3-tiny").replace(num_attention_heads=6, num_key_value_heads=2),
            r"o_proj \(attention projection, K=192\)",
        ),
        (
            QuantSpec(fmt="w4a16", group_size=64),
            preset("qwen3-moe-tiny").replace(moe_intermediate_size=96),
            r"experts down_proj \(experts projection, K=96\)",
        ),
        (QuantSpec(fmt="w8a8", group_size=64), H192, r"q_proj .*one scale per output channel"),
        (
            QuantSpec(fmt="w4a16", quantized=("lm_head",)),
            preset("qwen3-tiny").replace(hidden_size=200),
            r"lm_head \(lm_head projection, K=200\).*no power-of-two group size",
        ),
    ],
)
def test_a_group_a_projection_cannot_take_is_one_config_line(spec, arch, message):
    with pytest.raises(ConfigError, match=message) as e:
        quant_group_sizes(spec, arch)
    assert "\n" not in str(e.value) and str(e.value).startswith("quant: ")


def test_check_alignment_refuses_before_loading_any_weight(tmp_path, capsys):
    """A checkpoint directory with only its config.json: the refusal comes first (exit code 2)."""
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(H192)))
    assert main([f"model.path={tmp_path}", "quant.fmt=w4a16", "quant.group_size=128", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: quant: q_proj (attention projection, K=192)"), err
    assert "\n" not in err


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_dim=30, num_attention_heads=4), None),  # even: taken
        (dict(head_dim=15), "head_dim=15 is odd"),
        (dict(num_attention_heads=6, num_key_value_heads=4), "not a multiple of num_key_value_heads"),
        (dict(tensor_blocks=3), "tensor_blocks=3 must be >= 1 and divide the 4 attention heads"),
    ],
)
def test_head_rules(change, message):
    if message is None:
        assert preset("qwen3-tiny", **change).head_dim == change["head_dim"]
        return
    with pytest.raises(ValueError, match=message):
        preset("qwen3-tiny", **change)


@pytest.mark.parametrize(
    "backend, head_dim, groups, message",
    [
        ("gpu", 32, [64, 128], None),
        ("gpu", 128, [32], None),
        ("gpu", 24, [], "power-of-two head_dim >= 16, got 24"),
        ("gpu", 8, [], "power-of-two head_dim >= 16, got 8"),
        ("gpu", 64, [128, 96, 16], "GPU int4 matmul needs power-of-two group sizes >= 32; got [16, 96]"),
        ("tpu", 24, [64, 128, 192], None),  # heads padded to 128 lanes
        ("tpu", 64, [128, 32], "TPU int4 matmul needs group sizes that are multiples of 64; got [32]"),
        ("cpu", 6, [2, 96], None),
    ],
)
def test_backend_shape_rules(backend, head_dim, groups, message):
    reason = unsupported_shape(backend, head_dim, groups)
    assert reason is None if message is None else message in reason


def test_columns_the_blocks_do_not_divide_are_padded_and_cut():
    """A vocabulary of 10 in 3 column blocks (4 + 4 + 2 and 2 zero columns): the frozen weight gives
    the master's bits, and the blocks' outputs are the unblocked call's columns (w8a8: scales per
    column, so slicing commutes with quantizing)."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (5, 64), jnp.float32)
    w = jax.random.normal(kw, (64, 10), jnp.float32)
    spec = QuantSpec(fmt="w8a8", quantized=("lm_head",))
    frozen = quantize_params({"lm_head": {"kernel": w}}, spec)["lm_head"]["kernel"]
    run = jax.jit(lambda w, blocks: dot(x, w, spec, "lm_head", blocks=blocks), static_argnums=1)
    blocked = run(w, 3)
    assert blocked.shape == (5, 10)
    np.testing.assert_array_equal(np.asarray(run(frozen, 3)), np.asarray(blocked))
    np.testing.assert_array_equal(np.asarray(run(w, None)), np.asarray(blocked))
