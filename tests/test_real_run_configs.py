"""The shipped real-run configs (Qwen3-8B / Qwen3-30B-A3B on a v5p slice and on 8 GPUs, Qwen3-235B-A22B
on a v5p-256, the paper's four rows on OpenR1-Math-46K on 8 GPUs and on a v5p slice) load, shard
evenly on their stated mesh and fit their chips' HBM with 10% to spare, planned by shape alone (no
weights)."""

import pathlib

import flax.linen as nn
import jax
import pytest
from tiers import slow_but

from qarl_jax import sharding
from qarl_jax.config import MeshConfig, load_config
from qarl_jax.models import Qwen3ForCausalLM, preset
from qarl_jax.quant import QuantSpec
from qarl_jax.rollout import EngineConfig, RolloutEngine, layout
from qarl_jax.tools import compiled_memory
from qarl_jax.tools.collectives import collective_bytes_by_kind
from qarl_jax.tools.compiled_memory import Compiled
from qarl_jax.tools.host_memory import HOST_RAM_GB
from qarl_jax.tools.memory_plan import (
    HBM_GB,
    HOST_DEVICES,
    PlanError,
    compiled_json,
    format_compiled,
    main,
    plan,
)

CONFIGS = pathlib.Path(__file__).parents[1] / "configs"
# config -> (the platform its header names, the published parameter count)
REAL_RUNS = {
    "qwen3_8b_v5p64.yaml": ("v5p", 8.19e9),
    "qwen3_8b_8gpu.yaml": ("h100", 8.19e9),
    "qwen3_30b_a3b_v5p64.yaml": ("v5p", 30.5e9),
    "qwen3_30b_a3b_8gpu.yaml": ("h200", 30.5e9),
    # 16k-token responses on math (scanned layers; their compiled plans are in the headers)
    "qwen3_8b_16k_v5p64.yaml": ("v5p", 8.19e9),
    "qwen3_8b_16k_8gpu.yaml": ("h200", 8.19e9),
    "qwen3_30b_a3b_16k_8gpu.yaml": ("h200", 30.5e9),
    # a frozen model larger than a chip: the rollout splits its experts over each host's 4 chips
    "qwen3_235b_a22b_v5p256.yaml": ("v5p", 235.1e9),
    # the paper's Qwen2.5-Math rows (Qwen2ForCausalLM) on OpenR1-Math-46K
    "qwen2.5_math_1.5b_8gpu.yaml": ("h200", 1.54e9),
    "qwen2.5_math_7b_8gpu.yaml": ("h200", 7.62e9),
    "qwen2.5_math_1.5b_v5p8.yaml": ("v5p", 1.54e9),
    "qwen2.5_math_7b_v5p8.yaml": ("v5p", 7.62e9),
    # the paper's Qwen3 Base rows (baselines GRPO / GSPO in the paper) on OpenR1-Math-46K
    "qwen3_8b_base_math_8gpu.yaml": ("h200", 8.19e9),
    "qwen3_8b_base_math_v5p16.yaml": ("v5p", 8.19e9),
    "qwen3_30b_a3b_base_math_8gpu.yaml": ("h200", 30.5e9),
    "qwen3_30b_a3b_base_math_v5p32.yaml": ("v5p", 30.5e9),
}


# the fast tier plans one config of each kind (a dense Qwen3 on a v5p slice, the MoE on GPUs, the
# Qwen2 family, the 235B's experts split over each host's chips); the whole suite plans them all
FAST_CONFIGS = (
    "qwen3_8b_v5p64.yaml",
    "qwen3_30b_a3b_8gpu.yaml",
    "qwen2.5_math_1.5b_8gpu.yaml",
    "qwen3_235b_a22b_v5p256.yaml",
)


@pytest.mark.parametrize("name", slow_but(sorted(REAL_RUNS), *FAST_CONFIGS))
def test_real_run_config_shards_and_fits(name):
    platform, params = REAL_RUNS[name]
    config = load_config(CONFIGS / name)
    assert (config.quant.fmt, config.quant.mode, config.objective.name) == ("w4a16", "aligned", "tbpo")
    # raises PlanError on any dimension that does not divide; the engine runs per host
    p = plan(
        config,
        hbm_gb=HBM_GB[platform],
        per_host=HOST_DEVICES[platform],
        host_ram_gb=HOST_RAM_GB[platform],
    )
    m = config.mesh
    assert p["devices"] == m.data * m.fsdp * m.tensor * m.expert
    assert p["param_count"] == pytest.approx(params, rel=0.01)
    assert p["notes"] == []  # nothing falls back to replication (the KV cache splits too)
    assert p["total_bytes"] <= 0.9 * p["hbm_bytes"], (
        f"{name}: {p['total_bytes'] / 1e9:.1f} GB of {HBM_GB[platform]}"
    )
    assert p["host"]["fits"], f"{name}: {p['host']['peak'] / 1e9:.1f} GB of a host's {HOST_RAM_GB[platform]}"


def test_mesh_that_does_not_divide_names_param_dim_and_axes():
    config = load_config(CONFIGS / "qwen3_8b_v5p64.yaml", ["mesh.tensor=3"])
    with pytest.raises(PlanError, match=r"embed_tokens/embedding \(151936, 4096\): dim 0 \(151936\) does not "
                       r"divide by mesh axes 'tensor' = 3"):  # fmt: skip
        plan(config)


def test_absent_checkpoint_needs_a_stated_preset():
    config = load_config(CONFIGS / "qwen3_8b_8gpu.yaml", ["model.preset=qwen3-tiny"])
    with pytest.raises(PlanError, match="name the checkpoint's architecture with model.preset or --preset"):
        plan(config)


def test_cli_prints_the_table_and_fails_what_does_not_fit(capsys):
    path = str(CONFIGS / "qwen3_8b_8gpu.yaml")
    assert main(["--config", path, "--platform", "h100"]) == 0
    out = capsys.readouterr().out
    assert "8.191B parameters" in out and "fits" in out and "<- peak" in out
    assert main(["--config", path, "--hbm-gb", "16"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["--config", path, "--devices", "16"]) == 2
    assert "plan error: mesh {'data': 1, 'fsdp': 8" in capsys.readouterr().err


@pytest.mark.slow
def test_the_engine_layout_stops_the_decode_step_gathering_the_weights():
    """What the engine's compiled decode step moves per call (collectives of its optimized HLO). On
    the training layout (FSDP rules), which the engine decoded on before it had a layout of its
    own, it gathers every sharded frozen weight whole, each step (so at least their full bytes
    arrive); on its own layouts it moves next to nothing: replicated weights (data=8), and for MoE
    the experts split over expert=8 (each token's routed rows travel, not the weights), and on
    tensor 2 x data 4 it gathers activations, never a weight. The text table and --json carry the
    same figure. One layer (two for the MoE: its first is dense): what a step moves is per layer,
    and each layer is one more copy of the same compiled code. The decode steps alone are compiled
    (the prefill's figures are another program's)."""
    model = Qwen3ForCausalLM(preset("qwen3-tiny", num_hidden_layers=1), QuantSpec("w4a16"))
    training = sharding.make_mesh(MeshConfig(data=1, fsdp=8), jax.devices()[:8])
    fsdp, placed = _decode_step(model, training, sharding.DEFAULT_RULES)
    sharded = [x for x in jax.tree.leaves(placed) if not x.sharding.is_fully_replicated]
    assert sharded, "nothing of the tiny model is sharded: the test would prove nothing"
    assert fsdp.collective >= sum(x.size * x.dtype.itemsize for x in sharded)
    replicated = layout.engine_mesh(layout.RolloutMesh(data=8), jax.devices()[:8])
    data, _ = _decode_step(model, replicated)
    assert data.collective < fsdp.collective / 10  # per-slot vectors only
    moe = Qwen3ForCausalLM(preset("qwen3-moe-tiny", num_hidden_layers=2), QuantSpec("w4a16"))
    experts = layout.engine_mesh(layout.RolloutMesh(data=1, expert=8), jax.devices()[:8])
    step, placed = _decode_step(moe, experts)
    expert_bytes = sum(
        x.size * x.dtype.itemsize
        for path, x in jax.tree_util.tree_leaves_with_path(placed)
        if "experts" in jax.tree_util.keystr(path)
    )
    # the routed rows move (all-to-all), the experts do not
    assert 0 < step.collective < expert_bytes / 10, (step.collective, expert_bytes)
    programs = [data]
    run = {p.name: p.peak for p in programs} | {"weight_sync": 0}
    cp = dict(
        floors=None,  # no TPU topology: no floors
        programs=programs,
        run=run,
        kv_cache=0,
        peak_program="decode_step",
        total_bytes=1,
        fits=None,
        topology=None,
    )
    p = dict(hbm_bytes=None, total_bytes=1, peak_phase="update")
    assert compiled_json(cp, p)["programs"]["decode_step"]["collective_bytes"] == data.collective
    assert "moved" in format_compiled(cp, p)
    _tensor_parallel_decode_gathers_activations_never_a_weight()


def _decode_step(model: Qwen3ForCausalLM, mesh, rules=layout.ENGINE_RULES) -> tuple[Compiled, dict]:
    """(the engine's decode step over 8 slots of 64 tokens compiled on ``mesh`` under ``rules``: the
    decode step of :func:`compiled_memory.engine_programs`, without its prefill; the frozen weights
    as the engine places them)."""
    abstract = compiled_memory.abstract_params(model, None, rules)
    frozen = jax.eval_shape(lambda p: layout.freeze(p, model.quant, model), abstract)
    with sharding.activate(mesh, rules):
        engine = RolloutEngine(model, frozen, EngineConfig(slots=8, max_len=64), mesh=mesh, rules=rules)
        state = compiled_memory._abstract_state(engine, mesh)
        # row_blocks: the CPU row-block loops' trips; at most 8 slots a device are one block
        step = compiled_memory.compile_memory(
            "decode_step", engine._generate, engine.params, state, row_blocks=1
        )
    return step, engine.params


def _tensor_parallel_decode_gathers_activations_never_a_weight() -> None:
    """The compiled tensor-parallel decode step (tensor 2 x data 4, the projections in 2 column
    blocks) all-gathers only [slots, width] activations: no all-gather's result has the shape of a
    whole projection weight, and all of them together are less than one device's frozen weights.
    One of qwen3-small's layers: the check is per layer; at qwen3-tiny's widths a block of
    activations has the shape of a packed weight ([64, 128])."""
    config = preset("qwen3-small", dtype="bfloat16", tensor_blocks=2, num_hidden_layers=1)
    model = Qwen3ForCausalLM(config, QuantSpec("w4a16"))
    mesh = layout.engine_mesh(layout.RolloutMesh(data=4, tensor=2), jax.devices()[:8])
    abstract = compiled_memory.abstract_params(model, None, None)
    frozen = jax.eval_shape(lambda p: layout.freeze(p, model.quant, model), abstract)
    with jax.set_mesh(mesh), nn.logical_axis_rules(layout.ENGINE_RULES):
        engine = RolloutEngine(
            model, frozen, EngineConfig(slots=8, max_len=64), mesh=mesh, rules=layout.ENGINE_RULES
        )
        state = compiled_memory._abstract_state(engine, mesh)
        text = engine._generate.lower(engine.params, state).compile().as_text()
    weight_shapes = {tuple(x.shape) for x in jax.tree.leaves(frozen) if x.ndim == 2}
    assert weight_shapes, "no 2-D weight: the test would prove nothing"
    gathered = [line for line in text.splitlines() if "all-gather(" in line or "all-gather-start(" in line]
    assert gathered, "a tensor-parallel decode step gathers its column products"
    for line in gathered:  # activations (row blocks of column products, the new tokens' K/V): no weight
        shape = tuple(int(d) for d in line.split("[", 1)[1].split("]", 1)[0].split(",") if d)
        assert shape not in weight_shapes, line
    frozen_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(frozen))
    moved = collective_bytes_by_kind(text, unknown_trips=1)  # 2 slots a device: one row block
    assert 0 < moved["all-gather"] < frozen_bytes  # at these toy widths a block of activations is not small
