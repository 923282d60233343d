"""``python -m qarl_jax.tools.memory_plan --config FILE [--devices N] [--platform P | --hbm-gb G]
[--preset NAME] [key=value ...]``

Plans a run's memory per device before the hardware is rented: a sharding rule that does not
divide, or a batch that does not fit, fails here in seconds instead of minutes into a slice.

The architecture comes from ``--preset``, else the checkpoint's ``config.json`` when ``model.path``
exists here, else ``model.preset`` (so a config for a checkpoint elsewhere names the matching preset
too). Every shape is exact: ``jax.eval_shape`` of the model's init, of ``quantize_params`` and of the
optimizer's init (no weight is ever allocated), sharded by the config's rules on an
``AbstractMesh`` of the stated size (no devices needed). Every sharded parameter dimension must
divide by its mesh axes. Persistent memory per device:

  params       the float master weights (model.param_dtype)
  frozen       the rollout's frozen weights: int4 values packed two per byte + f32 group scales for
               the quantized kinds, the other leaves copied as they are; sharded like their kernels
               (a dimension that does not divide, e.g. too few scale groups, counted replicated)
  optimizer    the optimizer's state, sharded like the parameters it mirrors
  gradients    2 x params: the micro-batch accumulator and one micro-batch's gradients
  kv_cache     2 x layers x slots x max_len x kv_heads x head_dim x c (the engine keeps it for
               the whole run), slots over the batch axes and kv heads over tensor where they divide

Then the largest of three phases, estimated (c: compute-dtype bytes, p: master-dtype bytes,
V: vocabulary, H: hidden size, L: layers, rows: sequences per device):

  rollout      prefill of EngineConfig.max_prefill_batch prompts of data.max_prompt_tokens:
               rows x tokens x (a x c + V x c + a layer-stack's K/V) + W
  scoring      old log-probs (and the reference's with objective.kl_coef), one forward per
               chunk of the update's micro-batch rows:
               rows x (max_len x a x c + head x V x (c + 4)) + W
  update       one micro-batch: rows x (max_len x S x c + head x V x (c + 4)) + 2 W, with
               S = sum of a over layers + max a (no remat) or L x H + 2 max a (train.remat)
               and head = the tokens of one head chunk (``rl.logprobs.head_chunk_tokens``: the
               loss computes the logits that many tokens at a time)

where a = activation elements per token of one layer, kept for the backward: 4 H + 4 (q_heads +
kv_heads) x head_dim + 4 x intermediate (dense MLP) or experts + top_k x (2 H + 4 x
moe_intermediate) (MoE); logits are in c with an f32 log-softmax or gradient beside them; W = the
largest layer (or lm_head) gathered whole in p, since ``ops.per_device`` runs every matmul on the
gathered weight (twice in the update: the weight and its full-size gradient; an MoE layer's experts
a 1/expert share on a mesh with an expert axis, whose MoE is expert parallel); the rollout engine's
weights sit on its own layout, gathered by nothing. The frozen weights count in the rollout phase
only, the gradients outside it. Per host: RAM while loading and checkpointing
(:mod:`qarl_jax.tools.host_memory`; ``--host-ram-gb``, default the platform's host). These are estimates:
XLA's temporaries and fragmentation come on top, so leave headroom.

``--compiled`` also lowers and compiles the real programs at these shapes on the mesh (fake CPU
devices of its size; see :mod:`qarl_jax.tools.compiled_memory`) and prints XLA's per-device memory
of each (arguments, outputs, temporaries) and of the run at that program: the program's own
peak plus what stays resident beside it (update: the frozen weights and KV cache; old log-probs:
also the optimizer state; decode and prefill: the train state, and for prefill the KV cache),
and ``moved``: the GB the program's collectives deliver to each device per call (an FSDP weight
gathered whole counts its full size; one inside the layer scan counts once per layer), from the
optimized HLO (:mod:`qarl_jax.tools.collectives`). With ``--topology`` also, per program, the HBM
bytes and MXU FLOPs of the compiled TPU program and a floor in seconds on the chip's published
figures, and the RL step's floor (:mod:`qarl_jax.tools.program_cost`): floors, not timings.
``--json`` prints the plan instead of the
tables, as the one JSON object on stdout: ``{"plan": {...}, "compiled": {"programs": {"decode_step":
{"collective_bytes": N, "hbm_bytes": N, "flops": N, "seconds_floor": S, ...}, ...}, "rl_step_floor":
{...}, ...}}`` (``compiled`` with ``--compiled``; the floors with ``--topology``).
Compiling a large model on CPU takes minutes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from qarl_jax import cli, sharding
from qarl_jax.config import Config, ConfigError, ModelConfig, load_config
from qarl_jax.errors import PlanError
from qarl_jax.models import KVCache, Qwen3ForCausalLM, TransformerConfig, preset
from qarl_jax.models.hf_io import load_config as hf_config
from qarl_jax.rl.logprobs import head_chunk_tokens
from qarl_jax.rl.train_step import make_optimizer
from qarl_jax.rollout import EngineConfig, layout
from qarl_jax.rollout.engine import bucket
from qarl_jax.run.build import model_dir
from qarl_jax.tools import program_cost
from qarl_jax.tools.host_memory import HOST_RAM_GB, format_host, host_plan

GB = 1e9
HBM_GB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "tpu7x": 192, "a100": 80, "h100": 80, "h200": 141}
# devices a host: the rollout engine's (per host) mesh in a multi-host slice; a TPU VM of a pod
# slice holds 4 chips, a GPU host 8
HOST_DEVICES = {"v4": 4, "v5e": 4, "v5p": 4, "v6e": 4, "tpu7x": 4, "a100": 8, "h100": 8, "h200": 8}
PERSISTENT = ("params", "reference", "frozen", "optimizer", "gradients", "kv_cache")
PHASES = ("rollout", "scoring", "update")


def architecture(config: Config, preset_name: str | None = None) -> tuple[TransformerConfig, str]:
    """(architecture, where it came from): ``preset_name``, else the checkpoint's config.json when
    ``model.path`` exists here, else ``model.preset``, which must then be stated (not the default)."""
    m = config.model
    dtypes: dict[str, Any] = dict(param_dtype=m.param_dtype, dtype=m.compute_dtype)
    dtypes.update(
        scan_layers=m.scan_layers, remat_policy=m.remat_policy, tensor_blocks=config.rollout.mesh.tensor
    )
    try:
        if preset_name is not None:
            return preset(preset_name, **dtypes), f"preset {preset_name}"
        if m.path is None:
            depth = {} if m.num_hidden_layers is None else {"num_hidden_layers": m.num_hidden_layers}
            return preset(m.preset, **dtypes, **depth), f"preset {m.preset}"
        path = model_dir(m.path)
        if (path / "config.json").exists():
            return hf_config(path, **dtypes), str(path / "config.json")
        if m.preset == ModelConfig().preset:
            raise PlanError(
                f"model.path {m.path} is not here and model.preset is the default {m.preset!r}: "
                "name the checkpoint's architecture with model.preset or --preset"
            )
        return preset(m.preset, **dtypes), f"preset {m.preset} ({m.path} is not here)"
    except ValueError as e:  # an unknown preset, an unreadable config.json
        raise PlanError(str(e)) from e


def _names(path) -> tuple[str, ...]:
    """The dict keys along a pytree path (optimizer states nest the parameter tree under others)."""
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _shard_bytes(shape, dtype, spec, mesh: dict[str, int]) -> int:
    """Bytes of one device's shard; a dimension its axes do not divide counts as replicated."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    dims = [
        d // w if d % (w := sharding.axis_ways(a, mesh)) == 0 else d for d, a in zip(shape, spec, strict=True)
    ]
    return math.prod(dims) * jnp.dtype(dtype).itemsize


def _param_specs(model: Qwen3ForCausalLM, mesh: dict[str, int], rules) -> tuple[dict, dict]:
    """(abstract params, path -> mesh PartitionSpec) under ``rules``; raises PlanError naming every
    parameter dimension its mesh axes do not divide."""
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    abstract_mesh = AbstractMesh(tuple(mesh.values()), tuple(mesh))
    shardings = sharding.logical_to_sharding(boxed, abstract_mesh, rules)["params"]
    params = nn.meta.unbox(boxed["params"])
    specs, bad = {}, []
    for (path, leaf), s in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings), strict=True
    ):
        name = "/".join(_names(path))
        specs[_names(path)] = s.spec
        for i, (dim, axes) in enumerate(zip(leaf.shape, s.spec, strict=False)):
            if dim % (w := sharding.axis_ways(axes, mesh)):
                bad.append(
                    f"{name} {leaf.shape}: dim {i} ({dim}) does not divide by mesh axes {axes!r} = {w}"
                )
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise PlanError("parameters do not shard evenly: " + "; ".join(bad[:3]) + more)
    return params, specs


def _tree_bytes(tree, specs: dict, mesh: dict[str, int]) -> int:
    """Per-device bytes of ``tree``, each leaf sharded like the parameter at its dict-key path
    (optimizer moments; a frozen kernel's values and scales); other leaves (step counts) replicated."""
    return sum(
        _shard_bytes(leaf.shape, leaf.dtype, specs.get(_names(path), ()), mesh)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    )


def _layer_activations(c: TransformerConfig, layer: int) -> int:
    """a: activation elements per token of one decoder layer kept for the backward (module doc)."""
    attn = 4 * c.hidden_size + 4 * (c.num_attention_heads + c.num_key_value_heads) * c.head_dim
    if c.is_moe_layer(layer):
        return (
            attn + c.num_experts + c.num_experts_per_tok * (2 * c.hidden_size + 4 * c.moe_intermediate_size)
        )
    return attn + 4 * c.intermediate_size


def _rows(sequences: int, ways: int, what: str) -> int:
    """Sequences per device of a training batch: it must split over the batch axes (the trainer
    places it sharded; ``ops.per_device`` would replicate rows that do not split)."""
    if sequences % ways:
        raise PlanError(
            f"{what}: {sequences} sequences do not split over the {ways} devices of the batch axes"
        )
    return sequences // ways


def _batch_sizes(config: Config, ways: int) -> dict[str, int]:
    """Sequences per device of the training micro-batch and of one scoring forward: the same, as
    the trainer scores old log-probs in micro-batch chunks."""
    n = config.data.batch_size * config.rollout.samples_per_prompt
    parts = config.train.num_minibatches * config.train.micro_batches
    if n % parts:
        raise PlanError(
            f"a rollout batch of {n} sequences (data.batch_size x rollout.samples_per_prompt) does not "
            f"split into train.num_minibatches x train.micro_batches = {parts} micro-batches"
        )
    micro = _rows(n // parts, ways, "a train micro-batch (rollout batch / minibatches / micro-batches)")
    return dict(micro=micro, scoring=micro)


def plan(
    config: Config,
    devices: int | None = None,
    *,
    preset_name: str | None = None,
    hbm_gb: float | None = None,
    per_host: int | None = None,
    host_ram_gb: float | None = None,
) -> dict[str, Any]:
    """Per-device memory plan of ``config`` on ``devices`` (default: the mesh's stated size, which
    must then have no -1 axis), ``per_host`` of them on each host (default and at most: all; the engine
    runs per host, on ``rollout.mesh`` over them, with ``rollout.slots`` slots). Bytes are per
    device; see the module doc for what each entry holds."""
    m = config.mesh
    if devices is None:
        if -1 in (m.data, m.fsdp, m.tensor, m.expert):
            raise PlanError("the mesh has a -1 axis: state the device count (--devices N)")
        devices = m.data * m.fsdp * m.tensor * m.expert
    try:
        mesh = m.shape(devices)
    except ValueError as e:
        raise PlanError(str(e)) from e
    c, source = architecture(config, preset_name)
    per_host = devices if per_host is None else min(per_host, devices)
    if per_host < 1 or devices % per_host:
        raise PlanError(f"{per_host} devices a host do not divide the {devices} devices")
    model = Qwen3ForCausalLM(c)  # the parameter tree does not depend on the quant spec
    params, specs = _param_specs(model, mesh, m.rules)
    try:
        engine_mesh = layout.check_layout(config.rollout.mesh, c, per_host)
    except ConfigError as e:
        raise PlanError(str(e)) from e
    frozen = jax.eval_shape(lambda p: layout.freeze(p, config.quant, model), params)
    engine_abstract = AbstractMesh(tuple(engine_mesh.values()), tuple(engine_mesh))
    engine_shardings = layout.frozen_shardings(model, frozen, engine_abstract)
    opt_state = jax.eval_shape(make_optimizer(config.optimizer).init, params)
    ways = sharding.batch_ways(mesh, m.rules)

    r, cb, pb = config.rollout, jnp.dtype(c.dtype).itemsize, jnp.dtype(c.param_dtype).itemsize
    kv_spec = nn.logical_to_mesh_axes(KVCache.logical_axes, layout.ENGINE_RULES)
    assert kv_spec is not None  # logical names given: a PartitionSpec comes back
    kv_shape = (c.num_hidden_layers, r.slots, r.max_len, c.cache_kv_heads, c.head_dim)
    notes = [
        f"KV cache: {d} does not split over {ax!r}: replicated"
        for d, ax in zip(kv_shape, kv_spec, strict=True)
        if d % sharding.axis_ways(ax, engine_mesh)
    ]
    param_bytes = _tree_bytes(params, specs, mesh)
    persistent = dict(
        params=param_bytes,
        reference=param_bytes if config.objective.kl_coef else 0,  # frozen initial policy for the KL term
        frozen=sum(
            math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
            for x, sh in zip(jax.tree.leaves(frozen), jax.tree.leaves(engine_shardings), strict=True)
        ),
        optimizer=_tree_bytes(opt_state, specs, mesh),
        gradients=2 * param_bytes,
        kv_cache=2 * _shard_bytes(kv_shape, c.dtype, kv_spec, engine_mesh),
    )
    frozen_training_layout = _tree_bytes(frozen, specs, mesh)

    layers = [_layer_activations(c, i) for i in range(c.num_hidden_layers)]
    a = max(layers)
    groups: collections.Counter[str] = collections.Counter()  # top-level modules: layers_i, lm_head, ...
    expert_ways = mesh["expert"] if c.is_moe and c.num_experts % mesh["expert"] == 0 else 1
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = _names(path)
        top = names[0]  # a scanned run's stack is gathered one layer at a time
        size = leaf.size * pb // (leaf.shape[0] if top.startswith("stack_") else 1)
        groups[top] += size // (expert_ways if "experts" in names else 1)  # expert parallel: a share
    gathered = max(groups.values())
    engine = EngineConfig(slots=r.slots, max_len=r.max_len)
    prompt = bucket(config.data.max_prompt_tokens, engine.length_buckets)
    prefill_rows = engine.max_prefill_batch  # replicated by per_device unless it splits
    engine_ways = sharding.batch_ways(engine_mesh, layout.ENGINE_RULES)
    if prefill_rows % engine_ways == 0:
        prefill_rows //= engine_ways
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * cb
    rows = _batch_sizes(config, ways)
    saved = c.num_hidden_layers * c.hidden_size + 2 * a if config.train.remat else sum(layers) + a

    def logits(rows: int) -> int:  # one head chunk's logits (compute dtype) and f32 log-softmax
        return rows * head_chunk_tokens(rows, r.max_len, c.vocab_size) * c.vocab_size * (cb + 4)

    phases = dict(
        rollout=prefill_rows * prompt * (a * cb + c.vocab_size * cb + kv_token),  # weights in place
        scoring=rows["scoring"] * r.max_len * a * cb + logits(rows["scoring"]) + gathered,
        update=rows["micro"] * r.max_len * saved * cb + logits(rows["micro"]) + 2 * gathered,
    )
    # the engine's frozen weights live through the rollout only (the loop frees them for the update
    # and moves new ones in after it); the rest persists
    # and the gradients are the update's (the old log-probs run beside the optimizer state only)
    resident = {k: sum(persistent.values()) - persistent["frozen"] for k in PHASES}
    resident["rollout"] += persistent["frozen"] - persistent["gradients"]
    peak = max(PHASES, key=lambda name: resident[name] + phases[name])
    total = resident[peak] + phases[peak]
    hbm = None if hbm_gb is None else hbm_gb * GB
    largest_leaf = max(
        _shard_bytes(x.shape, c.param_dtype, specs[_names(path)], mesh)
        for path, x in jax.tree_util.tree_leaves_with_path(params)
    )
    host = host_plan(largest_leaf, per_host, param_bytes, persistent["optimizer"], host_ram_gb)
    return dict(
        architecture=source,
        param_count=sum(x.size for x in jax.tree.leaves(params)),
        devices=devices,
        per_host=per_host,
        frozen_training_layout=frozen_training_layout,
        mesh=mesh,
        engine_mesh=engine_mesh,
        batch_ways=ways,
        rows=dict(rows, prefill=prefill_rows, prefill_tokens=prompt),
        bytes=persistent | phases,
        peak_phase=peak,
        total_bytes=total,
        hbm_bytes=hbm,
        fits=None if hbm is None else total <= hbm,
        host=host,
        notes=notes,
    )


def compiled_plan(
    config: Config, p: dict[str, Any], preset_name: str | None = None, topology: str | None = None
) -> dict[str, Any]:
    """XLA's per-device memory of the run's programs (see the module doc) on ``p``'s mesh, and the
    run's peak by them. Needs ``p['devices']`` devices (fake CPU devices are fine), or a TPU
    ``topology`` of that many chips, whose programs the TPU compiler compiles (Mosaic kernels)."""
    from qarl_jax.tools import tpu_compile

    devices = jax.devices() if topology is None else tpu_compile.topology_devices(topology)
    if len(devices) < p["devices"]:
        raise PlanError(
            f"--compiled needs {p['devices']} devices, {len(devices)} present: run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={p['devices']} JAX_PLATFORMS=cpu"
            if topology is None
            else f"the mesh needs {p['devices']} chips, TPU topology {topology} has {len(devices)}"
        )
    with tpu_compile.tpu_kernels() if topology else contextlib.nullcontext():
        chip = tpu_compile.generation(topology) if topology else None
        return _compiled_plan(config, p, preset_name, devices, chip) | dict(topology=topology)


def _compiled_plan(
    config: Config, p: dict[str, Any], preset_name: str | None, devices: list, generation: str | None
) -> dict[str, Any]:
    from qarl_jax.tools import compiled_memory

    c, _ = architecture(config, preset_name)
    model = Qwen3ForCausalLM(c, config.quant)
    mesh = sharding.make_mesh(config.mesh, devices[: p["devices"]])
    r, rules = config.rollout, config.mesh.rules
    n = config.data.batch_size * r.samples_per_prompt
    programs = compiled_memory.train_step_programs(
        model, config.objective, config.train, config.optimizer, n, r.max_len, mesh, rules
    )
    engine = EngineConfig(slots=r.slots, max_len=r.max_len)
    engine_mesh = layout.engine_mesh(config.rollout.mesh, devices[: p["per_host"]])
    decode, kv_bytes = compiled_memory.engine_programs(
        model, config.quant, engine, config.data.max_prompt_tokens, engine_mesh
    )
    b = p["bytes"]
    state = b["params"] + b["reference"] + b["optimizer"]
    beside = dict(  # the frozen weights are freed for the update (old log-probs included)
        old_logprobs=b["optimizer"] + kv_bytes,
        update=kv_bytes,
        prefill=state + kv_bytes,
        decode_step=state,
    )
    programs += decode
    run = {x.name: x.peak + beside[x.name] for x in programs}
    # the move after the update: the new frozen weights on the training layout and on the engine's
    run["weight_sync"] = state + kv_bytes + p["frozen_training_layout"] + b["frozen"]
    peak = max(run, key=lambda name: run[name])
    hbm = p["hbm_bytes"]
    per_engine = -(-n // (p["devices"] // p["per_host"]))  # each host's engine rolls out its share
    calls = dict(  # a step's calls of each program, every sequence at its longest
        decode_step=-(-per_engine // r.slots) * r.max_new_tokens,
        prefill=-(-per_engine // engine.max_prefill_batch),
        old_logprobs=1,
        update=config.train.num_minibatches,
    )
    floors = generation and program_cost.floors(
        {x.name: (x.cost, x.collective) for x in programs}, calls, b["frozen"], generation, config.quant.fmt
    )
    return dict(
        floors=floors,
        programs=programs,
        kv_cache=kv_bytes,
        run=run,
        peak_program=peak,
        total_bytes=run[peak],
        fits=None if hbm is None else run[peak] <= hbm,
    )


def format_compiled(cp: dict[str, Any], p: dict[str, Any]) -> str:
    """The compiled plan as a table of GB per device, beside the estimate."""
    lines = [
        "compiled (XLA memory_analysis per device, GB):",
        f"  {'program':<14}"
        + "".join(f"{h:>8}" for h in ("args", "out", "alias", "temp", "peak", "run", "moved"))
        + f"{'compile s':>11}",
    ]
    for x in cp["programs"]:
        vals = (x.argument, x.output, x.alias, x.temp, x.peak, cp["run"][x.name], x.collective)
        lines.append(f"  {x.name:<14}" + "".join(f"{v / GB:>8.2f}" for v in vals) + f"{x.compile_s:>11.1f}")
    lines.append(f"  engine KV cache {cp['kv_cache'] / GB:.2f} GB per device")
    if cp["topology"]:
        lines[0] = f"compiled by the TPU compiler for {cp['topology']} (memory_analysis per chip, GB):"
        lines.append("  " + _kernel_line(cp))
    if cp["floors"]:
        lines += program_cost.format_floors(cp["floors"])
    lines.append(
        f"  weight sync {cp['run']['weight_sync'] / GB:.2f} GB: the train state, the KV cache and the new"
        " frozen weights on the training layout and on the engine's"
    )
    total = (
        f"  compiled total {cp['total_bytes'] / GB:.2f} GB at {cp['peak_program']} "
        f"(estimate {p['total_bytes'] / GB:.2f} GB at {p['peak_phase']})"
    )
    if p["hbm_bytes"] is not None:
        verdict = "fits" if cp["fits"] else "DOES NOT FIT"
        total += f"; {cp['total_bytes'] / p['hbm_bytes']:.0%} of {p['hbm_bytes'] / GB:g} GB HBM: {verdict}"
    return "\n".join(lines + [total])


def _kernel_line(cp: dict[str, Any]) -> str:
    """Whether the decode step's and the prefill's Mosaic kernels are the training programs' own."""
    from qarl_jax.tools.tpu_compile import same_kernels

    by_name = {x.name: list(x.kernels) for x in cp["programs"]}
    rollout = by_name["decode_step"] + by_name["prefill"]
    shared, missing = same_kernels(rollout, by_name["old_logprobs"] + by_name["update"])
    line = f"Mosaic kernels of the decode step and the prefill also in the training programs: {len(shared)}"
    return line + (f"; NOT in them: {', '.join(missing)}" if missing else f" of {len(shared)}")


def compiled_json(cp: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """The compiled plan as JSON-ready data: bytes per device, per program and for the run."""
    programs = {
        x.name: dict(
            argument_bytes=x.argument,
            output_bytes=x.output,
            alias_bytes=x.alias,
            temp_bytes=x.temp,
            peak_bytes=x.peak,
            run_bytes=cp["run"][x.name],
            collective_bytes=x.collective,
            compile_s=x.compile_s,
            mosaic_kernels=[f"{k.name}:{k.digest}" for k in x.kernels],
        )
        for x in cp["programs"]
    }
    floors = cp["floors"]
    for x in cp["programs"]:
        programs[x.name] |= (floors or {}).get("programs", {}).get(x.name, {})
        programs[x.name].setdefault("hbm_bytes", x.cost.hbm_bytes)
        programs[x.name].setdefault("flops", x.cost.flops)
    return dict(
        rl_step_floor=floors and floors["rl_step"],
        chip=floors and floors["chip"],
        programs=programs,
        kv_cache_bytes=cp["kv_cache"],
        weight_sync_bytes=cp["run"]["weight_sync"],
        peak_program=cp["peak_program"],
        total_bytes=cp["total_bytes"],
        hbm_bytes=p["hbm_bytes"],
        fits=cp["fits"],
        estimate_total_bytes=p["total_bytes"],
        topology=cp["topology"],
    )


def format_plan(p: dict[str, Any], config: Config) -> str:
    """The plan as a table of GB (1e9 bytes) per device."""
    m, r, t = config.model, config.rollout, config.train
    mesh = " ".join(f"{k}={v}" for k, v in p["mesh"].items())
    rows = p["rows"]
    how = dict(
        params=f"{m.param_dtype} master",
        reference="initial policy (objective.kl_coef > 0)"
        if config.objective.kl_coef
        else "none (kl_coef = 0)",
        frozen=f"{config.quant.fmt} rollout weights on rollout.mesh "
        + " ".join(f"{a}={p['engine_mesh'][a]}" for a in ("data", "tensor", "expert"))
        + f" ({p['per_host']} devices a host); rollout only",
        optimizer=config.optimizer.name,
        gradients=f"2 x {m.param_dtype}",
        kv_cache=f"{r.slots} slots x {r.max_len} tokens, {m.compute_dtype}",
        rollout=f"prefill {rows['prefill']} x {rows['prefill_tokens']} tokens",
        scoring=f"old log-probs, chunks of {rows['scoring']} x {r.max_len} tokens",
        update=f"micro-batch {rows['micro']} x {r.max_len} tokens" + (", remat" if t.remat else ""),
    )
    b = p["bytes"]
    lines = [
        f"architecture: {p['architecture']}, {p['param_count'] / 1e9:.3f}B parameters",
        f"mesh: {mesh} ({p['devices']} devices; batch over {p['batch_ways']})",
        f"{'per device':<20}{'GB':>8}  how",
    ]
    lines += [f"  {k:<18}{b[k] / GB:>8.2f}  {how[k]}" for k in PERSISTENT]
    lines.append(f"  {'persistent':<18}{sum(b[k] for k in PERSISTENT) / GB:>8.2f}")
    for k in PHASES:
        mark = "  <- peak" if k == p["peak_phase"] else ""
        lines.append(f"  phase {k:<12}{b[k] / GB:>8.2f}  {how[k]}{mark}")
    less = "gradients" if p["peak_phase"] == "rollout" else "frozen weights (freed for the update)"
    total = f"  {'total':<18}{p['total_bytes'] / GB:>8.2f}  persistent less the {less} + {p['peak_phase']}"
    if p["hbm_bytes"] is not None:
        verdict = "fits" if p["fits"] else "DOES NOT FIT"
        total += f"; {p['total_bytes'] / p['hbm_bytes']:.0%} of {p['hbm_bytes'] / GB:g} GB HBM: {verdict}"
    lines.append(total)
    lines.append(format_host(p["host"], p["per_host"]))
    lines += [f"note: {n}" for n in p["notes"]]
    return "\n".join(lines)


def _exec_with_fake_devices(devices: int) -> None:
    """Run this command again with ``devices`` fake CPU devices (XLA reads the flag at start-up);
    once only: a run that already has the flag reports the shortfall instead."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    env = dict(
        os.environ,
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        JAX_PLATFORMS="cpu",
    )
    os.execve(sys.executable, [sys.executable, "-m", "qarl_jax.tools.memory_plan", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.tools.memory_plan", description=cli.plain(__doc__.split("\n\n")[1])
    )
    parser.add_argument("--config", help="YAML file of overrides (see configs/)")
    parser.add_argument(
        "--devices", type=cli.at_least(1), help="device count (default: the mesh's stated size)"
    )
    parser.add_argument("--preset", help="architecture preset (default: config.json, else model.preset)")
    parser.add_argument("--platform", choices=sorted(HBM_GB), help="sets --hbm-gb to the chip's HBM")
    parser.add_argument(
        "--hbm-gb", type=cli.at_least(0, float, strict=True), help="HBM per device in GB (1e9 bytes), > 0"
    )
    parser.add_argument(
        "--host-ram-gb",
        type=cli.at_least(0, float, strict=True),
        help="RAM a host in GB (default: --platform's host)",
    )
    parser.add_argument(
        "--per-host",
        type=cli.at_least(1),
        help="devices a host: the rollout engine's mesh (default: --platform's host, else all devices)",
    )
    parser.add_argument(
        "--compiled", action="store_true", help="also compile the real programs and print XLA's memory"
    )
    parser.add_argument(
        "--topology",
        help="compile for this TPU slice with the TPU compiler (e.g. v5p:4x4x2; implies --compiled, "
        "sets --platform and the device count to the slice's chips)",
    )
    cli.add_json(parser, "the plan (and with --compiled the compiled plan)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.micro_batches=8")
    args = parser.parse_intermixed_args(argv)
    return cli.run(lambda: _main(args, reexec=argv is None))


def _main(args: argparse.Namespace, reexec: bool) -> int:
    if args.topology:
        from qarl_jax.tools.tpu_compile import generation, topology_devices

        chip = generation(args.topology)
        if chip not in HBM_GB:
            raise PlanError(f"--topology {args.topology}: unknown TPU generation {chip!r}")
        args.platform, args.compiled = chip, True
        args.devices = args.devices or len(topology_devices(args.topology))
    hbm = args.hbm_gb if args.hbm_gb is not None else HBM_GB.get(args.platform)
    config = load_config(args.config, args.overrides)
    per_host = args.per_host or HOST_DEVICES.get(args.platform or "")
    host_ram = args.host_ram_gb if args.host_ram_gb is not None else HOST_RAM_GB.get(args.platform or "")
    p = plan(
        config, args.devices, preset_name=args.preset, hbm_gb=hbm, per_host=per_host, host_ram_gb=host_ram
    )
    if args.compiled and not args.topology and reexec and jax.device_count() < p["devices"]:
        _exec_with_fake_devices(p["devices"])
    if not args.json:
        print(format_plan(p, config), flush=True)
    cp = compiled_plan(config, p, args.preset, args.topology) if args.compiled else None
    if args.json:
        print(json.dumps({"plan": p} | ({"compiled": compiled_json(cp, p)} if cp else {})))
    elif cp:
        print(format_compiled(cp, p))
    fits = p["fits"] if cp is None else cp["fits"]
    return 1 if fits is False or p["host"]["fits"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
