"""The rollout engine's own layout (qarl_jax.rollout.layout) on 8 fake CPU devices: bad layouts
fail in one line naming the key and the numbers, the frozen tree lands where the layout says, the
once-per-step move reports the bytes each device receives (hand-derived), the embedding is stored
in the compute dtype without changing a bit, and an expert-parallel or replicated engine decodes
bitwise what one device decodes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from qarl_jax import sharding
from qarl_jax.config import load_config
from qarl_jax.errors import ConfigError
from qarl_jax.models import Qwen3ForCausalLM, init_params, preset
from qarl_jax.quant import QuantSpec, quantize_params
from qarl_jax.rollout import EngineConfig, RolloutEngine, SamplingParams, layout, rollout

# two layers (the MoE's first dense, its second 8 experts): what a layout does to a layer does not
# depend on how many follow, and XLA's compiles (most of this module's time) grow with the layers
MOE = preset("qwen3-moe-tiny", num_hidden_layers=2)  # 8 experts, untied embeddings
DENSE = preset("qwen3-tiny", num_hidden_layers=2)


@pytest.mark.parametrize(
    ("mesh", "model", "message"),
    [
        (layout.RolloutMesh(data=1, expert=3), MOE, r"rollout.mesh: .*8 available"),
        (layout.RolloutMesh(data=-1, expert=16), MOE, r"rollout.mesh: .*expert"),
        (layout.RolloutMesh(data=1, expert=8), DENSE, r"rollout.mesh.expert=8: the model has no experts"),
    ],
)
def test_a_layout_that_does_not_divide_is_one_line_naming_the_key(mesh, model, message):
    with pytest.raises(ConfigError, match=message) as e:
        layout.check_layout(mesh, model, 8)
    assert "\n" not in str(e.value)


def test_experts_that_do_not_divide_name_their_numbers():
    with pytest.raises(ConfigError, match=r"rollout.mesh.expert=16 does not divide the model's 8 experts"):
        layout.check_layout(layout.RolloutMesh(data=1, expert=16), MOE, 16)
    with pytest.raises(ConfigError, match=r"rollout.mesh: tensor must be stated"):
        load_config(None, ["rollout.mesh.tensor=-1", "rollout.mesh.data=1"])
    assert layout.check_layout(layout.RolloutMesh(), MOE, 8) == dict(data=8, fsdp=1, tensor=1, expert=1)


def test_expert_parallel_layout_splits_only_the_experts():
    model = Qwen3ForCausalLM(MOE, QuantSpec("w4a16"))
    frozen = jax.eval_shape(lambda: layout.freeze(init_params(model, jax.random.key(0)), model.quant, model))
    mesh = layout.engine_mesh(layout.RolloutMesh(data=2, expert=4), jax.devices()[:8])
    shardings = layout.frozen_shardings(model, frozen, mesh)
    flat = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
    experts = {k: v.spec for k, v in flat.items() if "experts" in k}
    assert experts and all(v[0] == "expert" for v in experts.values()), experts
    assert all(v.is_fully_replicated for k, v in flat.items() if "experts" not in k)


def test_bytes_received_hand_derived():
    """[8, 4] f32 (128 bytes) in rows over 8 devices -> replicated: each device gets the 7 rows it
    lacks (112 bytes); -> rows over 4 devices (pairs): 1 row it lacks (16 bytes); same layout: 0."""
    mesh = sharding.make_mesh(sharding.MeshConfig(data=8), jax.devices()[:8])
    rows8 = NamedSharding(mesh, PartitionSpec("data"))
    whole = NamedSharding(mesh, PartitionSpec())
    assert set(layout.bytes_received(rows8, whole, (8, 4), 4).values()) == {112}
    pairs = layout.engine_mesh(layout.RolloutMesh(data=4, expert=2), jax.devices()[:8])
    got = layout.bytes_received(rows8, NamedSharding(pairs, PartitionSpec("data")), (8, 4), 4)
    assert set(got.values()) == {16}
    assert set(layout.bytes_received(rows8, rows8, (8, 4), 4).values()) == {0}


def test_weight_sync_moves_once_reports_bytes_and_frees_the_source():
    model = Qwen3ForCausalLM(DENSE, QuantSpec("w4a16"))
    params = init_params(model, jax.random.key(0))
    training = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=8), jax.devices()[:8])
    with sharding.activate(training):
        placed = jax.device_put(params, sharding.param_shardings(model, training))
        frozen = jax.jit(lambda p: layout.freeze(p, model.quant, model))(placed)
    engine_mesh = layout.engine_mesh(layout.RolloutMesh(), jax.devices()[:8])
    sync = layout.WeightSync(layout.frozen_shardings(model, frozen, engine_mesh))
    expected = 0
    for x in jax.tree.leaves(frozen):  # rows split 8 ways -> whole: 7/8 of each sharded leaf
        if not x.sharding.is_fully_replicated:
            expected += x.size * x.dtype.itemsize - x.addressable_shards[0].data.nbytes
    want = jax.tree.map(np.asarray, frozen)
    moved = sync(frozen, donate=True)
    assert sync.bytes_per_device == expected > 0
    assert sync.metrics()["rollout/weight_sync_gb"] == expected / 1e9 and sync.seconds > 0
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(moved))
    buffers = lambda x: {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}  # noqa: E731
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(moved), strict=True):
        assert a.is_deleted() or buffers(a) == buffers(b)  # no training-layout copy left behind
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.slow  # 13 s
def test_embedding_in_the_compute_dtype_keeps_every_bit():
    """The untied MoE preset's embedding, on its first (dense) layer alone: the table is read once,
    before any layer, so one layer shows it (each layer more only added to the forward's compiles)."""
    model = Qwen3ForCausalLM(MOE.replace(dtype="bfloat16", num_hidden_layers=1), QuantSpec("w4a16"))
    params = init_params(model, jax.random.key(0))
    plain, stored = quantize_params(params, model.quant), layout.freeze(params, model.quant, model)
    assert plain["embed_tokens"]["embedding"].dtype == jnp.float32
    assert stored["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 9)), jnp.int32)
    forward = jax.jit(lambda p: model.apply({"params": p}, tokens))
    np.testing.assert_array_equal(np.asarray(forward(stored)), np.asarray(forward(plain)))
    tied = Qwen3ForCausalLM(DENSE, QuantSpec("w4a16"))  # the lm_head reads the table: kept as is
    tied_params = init_params(tied, jax.random.key(0))
    kept = layout.freeze(tied_params, tied.quant, tied)["embed_tokens"]["embedding"]
    assert kept.dtype == tied_params["embed_tokens"]["embedding"].dtype


@pytest.mark.slow  # 29 s; the fast tier's engine-vs-training check: test_rl_train_step's aligned step
def test_engine_on_its_layout_samples_what_one_device_samples():
    """Whole samples (tokens and their log-probs, at temperature 0.7) of qwen3-moe-tiny in w4a16: the
    engine on 8 devices with the experts split 4 ways == the engine on one device. (Replicated and
    the other layouts against the training forward: test_tools_check_alignment.)"""
    model = Qwen3ForCausalLM(MOE, QuantSpec("w4a16"))
    params = init_params(model, jax.random.key(0))
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 3, 12)]
    config = EngineConfig(slots=8, max_len=32)
    freeze = jax.jit(lambda p: layout.freeze(p, model.quant, model))  # one program, not ~30 op by op

    def samples(engine_mesh):
        frozen = freeze(params)
        engine = RolloutEngine(model, frozen, config, mesh=engine_mesh, rules=layout.ENGINE_RULES)
        out = rollout(engine, prompts, 2, 10, SamplingParams(0.7), seed=3, progress=False)
        # each call one program, on a mesh too: the state comes back placed as it went in (before,
        # the decode step was compiled again for each placement the state passed through: 2 here)
        assert engine.compilations() == {"prefill": 1, "insert": 1, "generate": 1}
        return [(s.tokens, np.asarray(s.sampling_logprobs).tolist()) for g in out for s in g]

    split = layout.engine_mesh(layout.RolloutMesh(data=2, expert=4), jax.devices()[:8])
    assert samples(split) == samples(None)
