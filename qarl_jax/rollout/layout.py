"""The rollout engine's own device layout, and the once-per-step move of the frozen weights into it.

The trainer keeps its parameters on the training mesh (FSDP: each device holds a slice of every
weight). Decoding on that layout would all-gather every frozen weight at every token step (the
kernels run per device on whole weights), so the engine gets a mesh of its own over this process's
devices (one rule for one process and many), ``rollout.mesh``:

* ``data``: devices (or groups) decoding their own slots on replicated frozen weights;
* ``expert``: the MoE experts split over it (each device owns E / expert of them); each token's
  routed rows travel to their owners and back inside the layer (:mod:`qarl_jax.models.expert_parallel`),
  every other weight is replicated, and the slots are split over ``data`` x ``expert``;
* ``tensor``: every projection's columns (q/k/v/o, gate/up/down, lm_head) and the attention heads
  split over it; a device computes its columns and gathers the products where a whole row is next
  needed (an all-gather is an exact concatenation: no float sum crosses devices). The training
  forward computes the same column blocks one after another (``TransformerConfig.tensor_blocks``, set from
  ``rollout.mesh.tensor``), each block its own kernel call, so every layout gives the same bits.

The frozen tree is quantized on the training layout, then moved to the engine's layout in one
resharding per step (:class:`WeightSync`): the old engine copy is dropped before, and the training
layout copy donated to, the move. Every row of every kernel is computed by the same program on
every layout, so the rollout's bits do not depend on it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from kernels_pallas import QuantizedWeight
from qarl_jax import sharding
from qarl_jax.errors import ConfigError
from qarl_jax.models.config import TransformerConfig
from qarl_jax.quant import QuantSpec, kind_of, pad_columns, quantize_params

# The engine's logical rules: slots over data x expert; experts over expert; with a tensor axis,
# the heads of the activations and of the KV cache over it (every projection's columns too, placed
# by frozen_shardings); everything else whole.
ENGINE_RULES: sharding.Rules = (
    ("batch", ("data", "expert")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", None),
    ("embed", None),
    ("vocab", None),
    ("q_heads", None),
    ("kv_heads", "tensor"),  # the KV cache's heads (the kernels are placed by frozen_shardings)
    ("mlp", None),
    ("experts", "expert"),
    ("expert_mlp", None),
    ("norm", None),
    ("tensor_parallel", "tensor"),  # names the engine's tensor axis (qarl_jax.models.ops.tensor_parallel)
)


@dataclasses.dataclass(frozen=True)
class RolloutMesh:
    """``rollout.mesh``: the engine's layout over this process's devices (one axis may be -1: the
    devices left). Default: every device on ``data`` (replicated frozen weights)."""

    data: int = -1
    tensor: int = 1
    expert: int = 1

    def __post_init__(self):
        sizes = dataclasses.asdict(self)
        if any(v == 0 or v < -1 for v in sizes.values()) or list(sizes.values()).count(-1) > 1:
            raise ValueError(f"axes must be positive with at most one -1, got {sizes}")
        if self.tensor == -1:
            raise ValueError(
                "tensor must be stated (the training forward computes in that many column blocks)"
            )

    def mesh_config(self) -> sharding.MeshConfig:
        return sharding.MeshConfig(
            data=self.data, fsdp=1, tensor=self.tensor, expert=self.expert, rules=ENGINE_RULES
        )


def engine_mesh(layout: RolloutMesh, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The engine's mesh over ``devices`` (default: this process's devices)."""
    devices = list(jax.local_devices() if devices is None else devices)
    try:
        return sharding.make_mesh(layout.mesh_config(), devices)
    except ValueError as e:
        raise ConfigError(f"rollout.mesh: {e}") from e


def check_layout(layout: RolloutMesh, model: TransformerConfig, num_devices: int) -> dict[str, int]:
    """The layout's axis sizes on ``num_devices`` devices, or a one-line ConfigError naming the key
    and the numbers that do not divide (before any weight is loaded)."""
    try:
        sizes = layout.mesh_config().shape(num_devices)
    except ValueError as e:
        raise ConfigError(f"rollout.mesh: {e}") from e
    expert = sizes["expert"]
    if expert > 1 and not model.is_moe:
        raise ConfigError(f"rollout.mesh.expert={expert}: the model has no experts")
    if model.is_moe and model.num_experts % expert:
        raise ConfigError(
            f"rollout.mesh.expert={expert} does not divide the model's {model.num_experts} experts"
        )
    tensor = sizes["tensor"]
    if tensor > 1:
        kv = model.num_key_value_heads
        widths = {"attention heads": model.num_attention_heads, "hidden size": model.hidden_size}
        if any(not model.is_moe_layer(i) for i in range(model.num_hidden_layers)):
            widths["intermediate size"] = model.intermediate_size
        for what, n in widths.items():
            if n % tensor:
                raise ConfigError(f"rollout.mesh.tensor={tensor} does not divide the model's {n} {what}")
        if kv % tensor and tensor % kv:  # whole kv heads a device, or one kv head on whole devices
            raise ConfigError(
                f"rollout.mesh.tensor={tensor} and the model's {kv} kv heads: one must divide the other"
            )
    return sizes


def frozen_shardings(
    model: nn.Module, frozen, mesh: Mesh | AbstractMesh, rules: sharding.Rules = ENGINE_RULES
):
    """A NamedSharding for every leaf of the frozen tree ``frozen`` (arrays or shape structs): a
    parameter's logical axes under ``rules``; a QuantizedWeight's values and scales both take its
    kernel's axes (a packed or grouped K axis is never split by the engine's rules). A dimension
    the mesh does not divide stays whole; so do k_proj and v_proj when a kv head is shared by
    several devices (``kv_replicas`` > 1: each device computes the blocks and keeps its head's)."""
    boxed = sharding.abstract_variables(model)["params"]
    logical = nn.get_partition_spec(boxed)
    tensor = mesh.shape.get("tensor", 1)
    replicas = model.config.kv_replicas  # type: ignore[attr-defined]  # the causal LM's field
    by_columns = ("attention", "mlp", "lm_head")  # a tensor-parallel engine's column-split kinds

    def place(path, axes: PartitionSpec, leaf):
        names = tuple(str(getattr(k, "key", k)) for k in path)
        replicated_kv = replicas > 1 and ("k_proj" in names or "v_proj" in names)  # whole on every device
        columns = tensor > 1 and kind_of(names) in by_columns and not replicated_kv

        def one(x):
            names = tuple(axes) + (None,) * (x.ndim - len(axes))
            spec = sharding.fitting_spec(x.shape, names, mesh, rules)
            if columns:  # every projection's columns over tensor (its rows stay whole)
                spec = PartitionSpec(*(None,) * (x.ndim - 1), "tensor")
            return NamedSharding(mesh, spec)

        if isinstance(leaf, QuantizedWeight):
            return jax.tree.map(one, leaf)
        return one(leaf)

    return jax.tree_util.tree_map_with_path(
        place, logical, frozen, is_leaf=lambda v: isinstance(v, PartitionSpec)
    )


def freeze(params, spec: QuantSpec, model: nn.Module):
    """The rollout's frozen weights of float master ``params``: ``quantize_params`` (AQT's freeze),
    then :func:`compute_dtype_leaves` and :func:`pad_vocabulary`. Every place that hands weights to
    an engine calls this."""
    return pad_vocabulary(compute_dtype_leaves(quantize_params(params, spec), model), model)


def pad_vocabulary(frozen, model: nn.Module):
    """``frozen`` with an untied lm_head padded with zero columns to a multiple of the tensor degree
    (``tensor_blocks``), so a tensor-parallel engine splits it evenly (vLLM pads its vocabulary
    too): the training forward pads its master the same way and computes the same blocks
    (:func:`qarl_jax.quant.dot`), and the pad's logits are cut off before any softmax, sample,
    log-prob or loss sees them (``Dense``)."""
    c: TransformerConfig = model.config  # type: ignore[attr-defined]  # the causal LM's field
    if "lm_head" not in frozen or c.vocab_size % c.tensor_blocks == 0:
        return frozen
    padded = -(-c.vocab_size // c.tensor_blocks) * c.tensor_blocks
    return frozen | {"lm_head": {"kernel": pad_columns(frozen["lm_head"]["kernel"], padded)}}


def compute_dtype_leaves(frozen, model: nn.Module):
    """``frozen`` with the leaves the forward casts to the compute dtype anyway stored in it: the
    input embedding of an untied model (``nn.Embed`` casts its table before the lookup). The lm_head
    and the norm scales stay as they are: the bf16-format kernel and RMSNorm compute with the
    weight's own dtype, so casting them would change the rollout's bits."""
    c: TransformerConfig = model.config  # type: ignore[attr-defined]  # Qwen3ForCausalLM's field
    if c.tie_word_embeddings or "embed_tokens" not in frozen:
        return frozen
    table = frozen["embed_tokens"]["embedding"]
    dtype = jnp.dtype(c.dtype)
    return frozen | {"embed_tokens": {"embedding": table.astype(dtype) if table.dtype != dtype else table}}


def bytes_received(src: jax.sharding.Sharding, dst: jax.sharding.Sharding, shape, itemsize: int) -> dict:
    """Bytes each device receives when an array of ``shape`` goes from ``src`` to ``dst``: its
    ``dst`` shard less the part of it the device already held under ``src``."""
    shape = tuple(shape)
    have = src.devices_indices_map(shape)
    out = {}
    for device, want in dst.devices_indices_map(shape).items():
        size = math.prod(_extent(s, n) for s, n in zip(want, shape, strict=True))
        held = have.get(device)
        overlap = 0
        if held is not None:
            overlap = math.prod(_overlap(a, b, n) for a, b, n in zip(want, held, shape, strict=True))
        out[device] = (size - overlap) * itemsize
    return out


def _extent(s: slice, n: int) -> int:
    start, stop, _ = s.indices(n)
    return stop - start


def _overlap(a: slice, b: slice, n: int) -> int:
    a0, a1, _ = a.indices(n)
    b0, b1, _ = b.indices(n)
    return max(0, min(a1, b1) - max(a0, b0))


class WeightSync:
    """Moves each step's frozen weights from the training layout to the engine's in one resharding
    (``jax.device_put`` of the whole tree, the training-layout copy deleted after it); records its
    time and the bytes the busiest device receives (:meth:`metrics`)."""

    def __init__(self, shardings):
        self.shardings = shardings
        self.seconds = 0.0
        self.bytes_per_device = 0
        self._counted: tuple | None = None  # (source shardings, bytes): layouts repeat every step

    def received(self, frozen) -> int:
        """The most bytes one device receives moving ``frozen`` to the engine's layout."""
        leaves = jax.tree.leaves(frozen)
        sources = tuple(getattr(x, "sharding", None) for x in leaves)
        if self._counted is None or self._counted[0] != sources:
            per_device: dict = {}
            for x, s in zip(leaves, jax.tree.leaves(self.shardings), strict=True):
                if isinstance(x, jax.Array) and x.sharding != s:
                    for d, n in bytes_received(x.sharding, s, x.shape, x.dtype.itemsize).items():
                        per_device[d] = per_device.get(d, 0) + n
            self._counted = (sources, max(per_device.values(), default=0))
        return self._counted[1]

    def __call__(self, frozen, donate: bool = True):
        """``frozen`` on the engine's layout (``donate``: its arrays may be consumed by the move)."""
        start = time.perf_counter()
        moved = self.received(frozen)
        # not donate=True: a source donated to other devices is left invalid but not deleted, and
        # reading its buffers then crashed the process (XLA:CPU, disjoint device groups); the
        # resharding copies anyway, so the sources are deleted right after, unless they are the output
        out = jax.block_until_ready(jax.device_put(frozen, self.shardings))
        if donate:
            kept = {p for x in jax.tree.leaves(out) for p in _buffers(x)}
            for x in jax.tree.leaves(frozen):
                if isinstance(x, jax.Array) and not x.is_deleted() and not kept & _buffers(x):
                    x.delete()
        self.seconds, self.bytes_per_device = time.perf_counter() - start, moved
        return out

    def metrics(self) -> dict[str, float]:
        return {"time/weight_sync": self.seconds, "rollout/weight_sync_gb": self.bytes_per_device / 1e9}


def _buffers(x: jax.Array) -> set[int]:
    """The device buffers behind ``x`` (an array moved without a copy shares them)."""
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
