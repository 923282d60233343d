"""XLA's own memory figures for a run's programs: lower and compile the real train step (old
log-prob scoring, the update with its micro-batches) and the engine's prefill and decode step at the
config's shapes, on a mesh of the config's size, with nothing allocated (every input is a
``jax.ShapeDtypeStruct`` carrying its sharding). ``compiled.memory_analysis()`` is per device: the
SPMD-partitioned program one device runs.

Used by ``python -m qarl_jax.tools.memory_plan --compiled`` (which provides the devices: fake CPU
devices of the mesh's size, ``--xla_force_host_platform_device_count``, or with ``--topology`` a TPU
slice's device descriptions, compiled by the TPU compiler: :mod:`qarl_jax.tools.tpu_compile`) and
by ``benchmarks/long_context.py``. On CPU the figures are XLA:CPU's buffer assignment: the same
programs an accelerator runs, scheduled by another backend, so read them as the size of what
must be alive, not as a byte-exact GPU/TPU prediction. One known CPU-only excess: XLA:CPU scatters
a bf16 array through an f32 copy, so the decode step's temporaries hold the KV cache twice over in
f32 (GPUs and TPUs write the bf16 cache in place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qarl_jax import sharding
from qarl_jax.errors import PlanError
from qarl_jax.models import Qwen3ForCausalLM
from qarl_jax.models.qwen3 import fused_block_rows
from qarl_jax.quant import QuantSpec
from qarl_jax.rl.batch import RolloutBatch, training_batch
from qarl_jax.rl.logprobs import policy_logprobs
from qarl_jax.rl.train_step import (
    ObjectiveConfig,
    OptimizerConfig,
    TrainConfig,
    Trainer,
    TrainState,
    optimizer_shardings,
)
from qarl_jax.rollout import layout
from qarl_jax.rollout.engine import DecodeState, EngineConfig, RolloutEngine
from qarl_jax.tools.collectives import collective_bytes
from qarl_jax.tools.program_cost import Cost, program_cost
from qarl_jax.tools.tpu_compile import MosaicKernel, failure_line, mosaic_kernels


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compiled program's per-device memory (bytes), the bytes its collectives deliver to a
    device per call (:mod:`qarl_jax.tools.collectives`) and its compile time (seconds)."""

    name: str
    argument: int
    output: int
    alias: int
    temp: int
    compile_s: float
    collective: int
    kernels: tuple[MosaicKernel, ...] = ()  # a TPU program's Mosaic kernels, in order
    cost: Cost = Cost(0, 0)  # HBM bytes and MXU FLOPs per call (qarl_jax.tools.program_cost)

    @property
    def peak(self) -> int:
        """Arguments + outputs not aliased to (donated) arguments + temporaries."""
        return self.argument + self.output - self.alias + self.temp


def compile_memory(name: str, jitted, *args, row_blocks: int | None = None) -> Compiled:
    """Lower and compile ``jitted(*args)`` and read its memory analysis; ``row_blocks``: the trip
    count of its CPU row-block loops, where collectives run (a tensor-parallel engine's gathers),
    which XLA does not see (see :mod:`qarl_jax.tools.collectives`). A program the compiler refuses
    (or that does not trace) is a :class:`PlanError` naming it and, for a kernel, the kernel."""
    start = time.perf_counter()
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as e:  # XLA's, Mosaic's or the tracer's refusal, as one line
        raise PlanError(f"the {name} program does not compile: {failure_line(e)}") from None
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    text = compiled.as_text() or ""
    return Compiled(
        name,
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.temp_size_in_bytes,
        seconds,
        collective_bytes(text, row_blocks),
        tuple(mosaic_kernels(text)),
        program_cost(text, row_blocks),
    )


def differentiated_forward(model: Qwen3ForCausalLM, length: int) -> Compiled:
    """The trainer's differentiated forward at one row of ``length`` tokens, unsharded:
    ``jax.grad`` of the sum of ``policy_logprobs(..., remat=True)`` (what an update differentiates,
    without the objective and the optimizer). Its temp bytes are what long sequences cost."""
    params = abstract_params(model, None, sharding.DEFAULT_RULES)
    ints = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def loss(p, tokens, positions, segment_ids, targets):
        return jnp.sum(policy_logprobs(model, p, tokens, positions, segment_ids, targets, 1.0, remat=True))

    return compile_memory("grad", jax.jit(jax.grad(loss)), params, ints, ints, ints, ints)


def _with_sharding(x, s) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)


def abstract_params(model: Qwen3ForCausalLM, mesh: Mesh | None, rules) -> dict:
    """The model's parameters as structs, sharded by ``rules`` on ``mesh`` (None: unsharded)."""
    boxed = sharding.abstract_variables(model)
    boxes = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    # the boxes' values, not nn.meta.unbox (which would add sharding constraints under a mesh)
    params = jax.tree.map(lambda x: x.value if boxes(x) else x, boxed["params"], is_leaf=boxes)
    if mesh is None:
        return params
    shardings = sharding.logical_to_sharding(boxed, mesh, rules)["params"]
    return jax.tree.map(_with_sharding, params, shardings)


def jitted_outputs(fn, *args):
    """Structs of ``jax.jit(fn)(*args)``'s outputs with the shardings XLA gives them (how the
    trainer builds its optimizer state and the loop its frozen weights: jitted, shardings
    propagated from the inputs)."""
    compiled = jax.jit(fn).lower(*args).compile()
    shapes = jax.eval_shape(fn, *args)
    return jax.tree.map(_with_sharding, shapes, compiled.output_shardings)


def abstract_batch(
    rows: int, length: int, mesh: Mesh | None, rules, extra: tuple[str, ...] = ()
) -> RolloutBatch:
    """The trainer's batch of ``rows`` sequences x ``length`` tokens, as the trainer places it
    (rows over the batch axes). Fields and dtypes are those ``rl.batch.training_batch`` builds, plus
    the ``extra`` fields shaped like ``rollout_logp`` (old_logp, ref_logp)."""
    one = training_batch([[1]], [[2]], [[0.0]], [0.0], 1)
    one = one.replace(**{k: one.rollout_logp for k in extra})
    names = () if mesh is None else sharding.batch_axes(rules)

    def abstract(value) -> jax.ShapeDtypeStruct:
        shape = (rows,) + (length,) * (value.ndim - 1)
        s = None if mesh is None else NamedSharding(mesh, PartitionSpec(names or None))
        return jax.ShapeDtypeStruct(shape, value.dtype, sharding=s)

    return one.map(abstract)


def train_step_programs(
    model: Qwen3ForCausalLM,
    objective: ObjectiveConfig,
    train: TrainConfig,
    optimizer: OptimizerConfig,
    sequences: int,
    length: int,
    mesh: Mesh | None,
    rules=sharding.DEFAULT_RULES,
) -> list[Compiled]:
    """The trainer's two jitted programs for a rollout batch of ``sequences`` x ``length``: old
    log-probs (the whole batch, scored in micro-batch chunks) and one update (a minibatch of
    ``sequences / num_minibatches``, accumulated over ``micro_batches``)."""
    trainer = Trainer(model, objective, train, optimizer, mesh=mesh, rules=rules)
    with trainer._context():
        params = abstract_params(model, mesh, rules)
        opt_state = jax.eval_shape(trainer.tx.init, params)
        if mesh is not None:  # as Trainer.init_state places it
            shard = optimizer_shardings(trainer.tx, params, mesh)
            opt_state = jax.tree.map(_with_sharding, opt_state, shard)
        rep = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        ref = params if trainer._kl else None
        state = TrainState(params=params, opt_state=opt_state, step=step, ref_params=ref)  # type: ignore[arg-type]  # abstract
        full = abstract_batch(sequences, length, mesh, rules)
        extra = ("old_logp", "ref_logp") if trainer._kl else ("old_logp",)
        mini = abstract_batch(sequences // train.num_minibatches, length, mesh, rules, extra)
        return [
            compile_memory("old_logprobs", trainer._old_logprobs, params, full),
            compile_memory("update", trainer._update, state, mini),
        ]


def engine_programs(
    model: Qwen3ForCausalLM,
    spec: QuantSpec,
    engine_config: EngineConfig,
    prompt_tokens: int,
    mesh: Mesh | None,
    rules=layout.ENGINE_RULES,
) -> tuple[list[Compiled], int]:
    """(the engine's prefill of ``max_prefill_batch`` prompts of ``prompt_tokens`` (bucketed) and
    its decode step over every slot, KV-cache bytes per device) on frozen ``spec`` weights, on the
    engine's own layout ``mesh`` (:func:`qarl_jax.rollout.layout.engine_mesh`; None: one device)."""
    frozen = jax.eval_shape(lambda p: layout.freeze(p, spec, model), abstract_params(model, None, rules))
    with sharding.activate(mesh, rules) if mesh is not None else contextlib.nullcontext():
        engine = RolloutEngine(model, frozen, engine_config, mesh=mesh, rules=rules)
        frozen = engine.params  # structs on the engine's layout
        state = _abstract_state(engine, mesh)
        rows = engine_config.max_prefill_batch
        t = min(b for b in engine_config.length_buckets if b >= prompt_tokens)
        tokens = jax.ShapeDtypeStruct((rows, t), jnp.int32)
        lengths = jax.ShapeDtypeStruct((rows,), jnp.int32)
        ways = 1 if mesh is None else sharding.batch_ways(mesh, rules)
        block = fused_block_rows(model.config)
        per_device = lambda n: n // ways if n % ways == 0 else n  # noqa: E731  (rows replicated otherwise)
        prefill_tokens = per_device(rows) * min(t, engine_config.prefill_chunk)
        programs = [
            compile_memory(
                "prefill", engine._prefill, frozen, tokens, lengths, row_blocks=-(-prefill_tokens // block)
            ),
            compile_memory(
                "decode_step",
                engine._generate,
                frozen,
                state,
                row_blocks=-(-per_device(engine_config.slots) // block),
            ),
        ]
    return programs, engine.kv_cache_bytes_per_device()


def _abstract_state(engine: RolloutEngine, mesh: Mesh | None) -> DecodeState:
    """The engine's DecodeState as structs, placed as the engine places it
    (:meth:`RolloutEngine.state_shardings`): the programs compiled are the ones the run runs."""
    state = jax.eval_shape(engine.empty_state)
    if mesh is None:
        return state
    return jax.tree.map(_with_sharding, state, engine.state_shardings(state))
